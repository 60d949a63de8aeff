"""``python -m bench simulate``: the simulator's command line, tables and plot (the model is ``simulate.py``)."""

from __future__ import annotations

import json
from dataclasses import replace

from lins_ds import plan as P
from lins_ds.plan import cost
from . import calibrate as fitting
from .simulate import NO_OVERHEADS, SYSTEMS, calibrate, sim_train, simulate

REQUIRED = ("model", "gpus_per_node", "seq_len", "micro_batch_size", "global_batch_tokens")


def _fitted_terms(args):
    """The fitted terms to apply: --calibration's, else those stored in --profile, else none."""
    for path in (args.calibration, args.profile):
        if path:
            found = fitting.stored(P.ProfileTable.load(path), path)
            if found is not None:
                return found, path
            if path == args.calibration:
                raise P.PlanError(f"--calibration {path}: holds no fitted terms (meta.simulator); write one with "
                                  f"python -m bench simulate --fit")
    return NO_OVERHEADS, None


def add_arguments(si) -> None:
    """The options of ``python -m bench simulate``."""
    si.add_argument("--model", help="required unless --fit or --validate")
    si.add_argument("--nodes", type=int, default=1)
    si.add_argument("--gpus-per-node", type=int, help="required unless --fit or --validate")
    si.add_argument("--seq-len", type=int, help="required unless --fit or --validate")
    si.add_argument("--micro-batch-size", type=int, help="required unless --fit or --validate")
    si.add_argument("--global-batch-tokens", type=int, help="required unless --fit or --validate")
    si.add_argument("--gpu-memory-gb", type=float)
    si.add_argument("--cluster", help="built-in cluster (default a800-ib; with fitted terms, the cluster they were "
                    "fitted on; h200-emulated for --fit): its timing table and compute model; with --profile only "
                    "its compute model (peak FLOP/s, memory bandwidth)")
    si.add_argument("--profile", help="measured table from lins-ds profile for the collectives (the real host's, "
                    "with --fit/--validate); terms that --fit stored in it are applied")
    si.add_argument("--emulated-profile", help="with --fit/--validate: the measured table of the emulated nodes")
    si.add_argument("--calibration", help="a profile written by --fit whose fitted terms to apply (e.g. to the "
                    "paper's setting with --cluster)")
    si.add_argument("--fit", nargs="+", metavar="BENCH_JSON", help="fit the per-system terms to these lins-ds "
                    "bench results, print predicted next to measured (with leave-one-out) and write --out")
    si.add_argument("--validate", nargs="+", metavar="BENCH_JSON", help="predicted next to measured step, "
                    "communication and peak memory for the runs in these bench results, with the fitted terms")
    si.add_argument("--compute-table", help="with --fit: price compute from each model's shape with this device's "
                    "measured table (python -m bench profile --compute; bench/compute_tables/), one factor for every model, "
                    "instead of one efficiency per model")
    si.add_argument("--out", help="with --fit: where to write the profile with the fitted terms")
    si.add_argument("--systems", default="zero1,zero2,zero3,zeropp,mics,lins")
    si.add_argument("--efficiency", type=float, help="compute efficiency; default: calibrated (see output)")
    si.add_argument("--sweep-nodes", help="comma-separated node counts, e.g. 1,2,4,...,128")
    si.add_argument("--plot", help="PNG of MFU against GPUs (with --sweep-nodes)")
    si.add_argument("--format", default="table", choices=["table", "json"])
    si.add_argument("--no-overlap-comm", dest="overlap_comm", action="store_false",
                    help="price DeepSpeed's ZeRO-1 and ZeRO-2 with overlap_comm off (DeepSpeed's default for stage 1 "
                    "and 2: the reduction after the backward, exposed); default: on, as ds_configs/ runs them")


def run(args) -> int:
    if args.fit or args.validate:
        return run_fit(args)
    for name in REQUIRED:
        if getattr(args, name) is None:
            raise P.PlanError(f"--{name.replace('_', '-')}: required to simulate (unless --fit or --validate)")
    overheads, terms_from = _fitted_terms(args)
    model = P.load_model(args.model)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise P.PlanError(f"--systems: {unknown} not among {SYSTEMS}")
    if overheads.shape_model and not args.efficiency:
        return _simulate(args, model, systems, overheads, *_shape_compute(args, overheads, terms_from))
    fitted_eff = model.name in overheads.compute and args.profile and not args.efficiency
    if fitted_eff and args.cluster and overheads.cluster and args.cluster != overheads.cluster:
        raise P.PlanError(f"--cluster {args.cluster}: the fitted efficiency of {model.name} ({terms_from}) is a fraction "
                          f"of {overheads.cluster}'s peak; give --cluster {overheads.cluster}, or --efficiency")
    cluster = P.get_cluster(args.cluster or (overheads.cluster if fitted_eff else "") or "a800-ib")
    capacity = args.gpu_memory_gb or (None if args.profile and not args.cluster else cluster.gpu_memory_gb)
    if capacity is None:
        raise P.PlanError("--gpu-memory-gb: required with --profile unless --cluster names the machine")
    mem = P.MemorySpec(capacity)
    compute = cluster.compute()

    def table_for(topo):
        if args.profile:
            return P.ProfileTable.load(args.profile)
        return cluster.table(cost.required_meshes(topo, P.candidates(topo)))

    if args.efficiency:
        compute = compute.at(args.efficiency)
        note = f"compute efficiency {args.efficiency:.3f} (given)"
    elif fitted_eff:
        compute = compute.at(overheads.compute[model.name])
        note = f"compute efficiency {compute.achievable_mfu:.3f} (fitted to GPU runs of {model.name}, {terms_from})"
    else:  # the paper, §III-A: ZeRO-1 trains LLaMA-7B at 63 % MFU on 8 GPUs (4M-token batch)
        topo8 = P.Topology(1, args.gpus_per_node)
        cal = sim_train(P.load_model("llama-7b"), topo8, args.seq_len, args.micro_batch_size, args.global_batch_tokens)
        compute = calibrate(P.load_model("llama-7b"), topo8, cal, mem, table_for(topo8), compute, "zero1", 0.63,
                            overheads, args.overlap_comm)
        note = (f"compute efficiency {compute.achievable_mfu:.3f}, calibrated so that ZeRO-1 trains llama-7b at "
                f"63 % MFU on 1 node x {args.gpus_per_node} (the paper's 8-GPU point)")
    if terms_from:
        note += f"; per-system terms fitted to GPU runs ({terms_from})"
    note += _overlap_note(args)
    nodes_list = [int(x) for x in args.sweep_nodes.split(",")] if args.sweep_nodes else [args.nodes]
    out = {"calibration": note, "runs": []}
    for m in nodes_list:
        topo = P.Topology(m, args.gpus_per_node)
        train = sim_train(model, topo, args.seq_len, args.micro_batch_size, args.global_batch_tokens)
        res = simulate(model, topo, train, mem, table_for(topo), compute, systems, overheads, args.overlap_comm)
        out["runs"].append({"nodes": m, "gpus": topo.world_size, "micro_batches": train.grad_accum,
                            "systems": {k: v.to_json() for k, v in res.items()}})
    return _report(args, out, note, systems, model)


def _overlap_note(args) -> str:
    return ("; DeepSpeed ZeRO-1/2 with overlap_comm " + ("on (as ds_configs/ runs them)" if args.overlap_comm else
                                                         "off (--no-overlap-comm, DeepSpeed's default)"))


def _report(args, out: dict, note: str, systems: list, model) -> int:
    if args.format == "json":
        last = out["runs"][-1]
        print(json.dumps({"systems": last["systems"], "calibration": note, "sweep": out["runs"]}, indent=1))
    else:
        print(f"{model.name}, {args.gpus_per_node} GPUs per node, seq {args.seq_len}, micro-batch "
              f"{args.micro_batch_size}, {args.global_batch_tokens} tokens per step; {note}")
        for run in out["runs"]:
            print(f"\n{run['gpus']} GPUs ({run['nodes']} nodes), {run['micro_batches']} micro-batches per GPU per step")
            print(f"  {'system':<8}{'MFU':>7}{'tok/GPU/s':>11}{'step s':>9}{'update s':>9}{'exposed s':>10}{'mem GiB':>9}"
                  "  layout")
            for name, r in run["systems"].items():
                lay = str(P.Layout.from_json(r["layout"]))
                ckpt = f" +ckpt {r['checkpoint_units']}/{model.num_layers}" if r["checkpointing"] else ""
                print(f"  {name:<8}{100 * r['mfu']:>6.1f}%{r['tokens_per_gpu_s']:>11.0f}{r['step_s']:>9.3f}"
                      f"{r['update_s']:>9.3f}{r['exposed_comm_s']:>10.3f}{r['memory_gb_per_gpu']:>9.1f}  {lay}{ckpt}"
                      f"{'' if r['fits'] else '  (does not fit)'}")
    if args.plot:
        _plot_sweep(out["runs"], systems, args.plot, model.name)
    return 0


def _shape_compute(args, overheads, terms_from: str) -> tuple:
    """(cluster, compute, note) of a calibration fitted with the shape model: its own cluster and device table, or
    --cluster's built-in table (bench/compute_tables/), at the calibration's factor (measured or fitted)."""
    import os

    from bench.compute_model import ComputeTable

    name = args.cluster or overheads.cluster or "h200-emulated"
    cluster = P.get_cluster(name)
    if name == overheads.cluster:
        table = ComputeTable.from_json(overheads.compute_table)
    else:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compute_tables", f"{name}.json")
        if not os.path.exists(path):
            raise P.PlanError(f"--cluster {name}: no built-in compute table (bench/compute_tables/); measure one "
                              "(python -m bench profile --compute) and fit with it")
        table = ComputeTable.load(path)
    factor = overheads.compute["shape"]
    compute = replace(cluster.compute(), table=table, achievable_mfu=factor)
    own = ComputeTable.from_json(overheads.compute_table)
    how = (f"measured by the timed layers of the calibration's own table ({own.device})" if own.layers
           else "fitted to GPU runs")
    note = (f"compute from each model's shape: the {table.device} table ({table.source}) at the factor {factor:.3f} "
            f"{how} ({terms_from})")
    return cluster, compute, note


def _simulate(args, model, systems, overheads, cluster, compute, note) -> int:
    capacity = args.gpu_memory_gb or cluster.gpu_memory_gb
    mem = P.MemorySpec(capacity)
    nodes_list = [int(x) for x in args.sweep_nodes.split(",")] if args.sweep_nodes else [args.nodes]
    note += _overlap_note(args)
    out = {"calibration": note, "runs": []}
    for m in nodes_list:
        topo = P.Topology(m, args.gpus_per_node)
        table = (P.ProfileTable.load(args.profile) if args.profile
                 else cluster.table(cost.required_meshes(topo, P.candidates(topo))))
        train = sim_train(model, topo, args.seq_len, args.micro_batch_size, args.global_batch_tokens)
        res = simulate(model, topo, train, mem, table, compute, systems, overheads, args.overlap_comm)
        out["runs"].append({"nodes": m, "gpus": topo.world_size, "micro_batches": train.grad_accum,
                            "systems": {k: v.to_json() for k, v in res.items()}})
    return _report(args, out, note, systems, model)


def run_fit(args) -> int:
    """--fit (fit the terms, write them with the profile, show every run with leave-one-out) or --validate."""
    if not args.profile:
        raise P.PlanError("--profile: required with --fit/--validate (the measured table of the host the runs used)")
    if args.fit and args.validate:
        raise P.PlanError("--fit and --validate: give one (--fit also prints the validation)")
    if args.fit and not args.out:
        raise P.PlanError("--out: required with --fit (where to write the profile with the fitted terms)")
    if not args.overlap_comm:
        raise P.PlanError("--no-overlap-comm: not with --fit/--validate: a run is priced as it ran, ZeRO-1 and ZeRO-2 "
                          "with ds_configs/' overlap_comm (bench/gpu_*.sh run those configs)")
    tables = {"host": P.ProfileTable.load(args.profile)}
    if args.emulated_profile:
        tables["emulated"] = P.ProfileTable.load(args.emulated_profile)
    runs = fitting.load_all(args.fit or args.validate)
    if args.fit:
        cluster = args.cluster or "h200-emulated"
        compute = P.get_cluster(cluster).compute()
        if args.compute_table:
            from bench.compute_model import ComputeTable

            compute = replace(compute, table=ComputeTable.load(args.compute_table), achievable_mfu=1.0)
        overheads = fitting.fit(runs, tables, compute, source=", ".join(args.fit), cluster=cluster)
        rows = fitting.validate(runs, tables, compute, overheads, leave_one_out=True)
        fitting.write_calibrated_profile(args.profile, args.out, overheads, rows)
    else:
        overheads, terms_from = _fitted_terms(args)
        if terms_from is None:
            raise P.PlanError(f"--profile {args.profile}: holds no fitted terms; give the profile --fit wrote, or "
                              f"--calibration")
        compute = P.get_cluster(args.cluster or overheads.cluster or "h200-emulated").compute()
        rows = fitting.validate(runs, tables, compute, overheads)
    modes = fitting.per_mode(rows)
    if args.format == "json":
        print(json.dumps({"terms": overheads.to_json(), "runs": rows, "modes": modes}, indent=1))
    else:
        print(fitting.terms_text(overheads) + "\n\n" + fitting.table_text(rows))
        for label, key in (("predicted", "error_pct"), ("leave-one-out (the mode's runs left out)", "loo_error_pct")):
            errs = [abs(r[key]) for r in rows if r.get(key) is not None]
            if errs:
                print(f"{label}: {sum(e <= 10 for e in errs)} of {len(errs)} runs within 10 %, largest {max(errs):.1f} %")
        print("\nper mode, repeated runs held to their median:\n" + fitting.per_mode_text(modes))
        if args.fit:
            print(f"wrote {args.out}: {args.profile} with the fitted terms; python -m bench simulate --profile {args.out} "
                  f"(or --calibration {args.out}) applies them")
    return 0


def _plot_sweep(runs, systems, path, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in systems:
        pts = [(r["gpus"], 100 * r["systems"][s]["mfu"]) for r in runs if s in r["systems"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=s)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("MFU (%)")
    ax.set_title(f"{title}: simulated MFU vs scale")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
