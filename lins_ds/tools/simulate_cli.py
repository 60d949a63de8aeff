"""``lins-ds simulate``: the simulator's command line, tables and plot (the model is ``simulate.py``)."""

from __future__ import annotations

import json

from .. import plan as P
from ..plan import cost
from .simulate import SYSTEMS, calibrate, sim_train, simulate


def run(args) -> int:

    model = P.load_model(args.model)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise P.PlanError(f"--systems: {unknown} not among {SYSTEMS}")
    cluster = P.get_cluster(args.cluster or "a800-ib")
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
        compute = P.ComputeSpec(compute.peak_tflops, args.efficiency, compute.memory_bandwidth_gbs)
        note = f"compute efficiency {args.efficiency:.3f} (given)"
    else:  # the paper, §III-A: ZeRO-1 trains LLaMA-7B at 63 % MFU on 8 GPUs (4M-token batch)
        topo8 = P.Topology(1, args.gpus_per_node)
        cal = sim_train(P.load_model("llama-7b"), topo8, args.seq_len, args.micro_batch_size, args.global_batch_tokens)
        compute = calibrate(P.load_model("llama-7b"), topo8, cal, mem, table_for(topo8), compute, "zero1", 0.63)
        note = (f"compute efficiency {compute.achievable_mfu:.3f}, calibrated so that ZeRO-1 trains llama-7b at "
                f"63 % MFU on 1 node x {args.gpus_per_node} (the paper's 8-GPU point)")
    nodes_list = [int(x) for x in args.sweep_nodes.split(",")] if args.sweep_nodes else [args.nodes]
    out = {"calibration": note, "runs": []}
    for m in nodes_list:
        topo = P.Topology(m, args.gpus_per_node)
        train = sim_train(model, topo, args.seq_len, args.micro_batch_size, args.global_batch_tokens)
        res = simulate(model, topo, train, mem, table_for(topo), compute, systems)
        out["runs"].append({"nodes": m, "gpus": topo.world_size, "micro_batches": train.grad_accum,
                            "systems": {k: v.to_json() for k, v in res.items()}})
    if args.format == "json":
        last = out["runs"][-1]
        print(json.dumps({"systems": last["systems"], "calibration": note, "sweep": out["runs"]}, indent=1))
    else:
        print(f"{model.name}, {args.gpus_per_node} GPUs per node, seq {args.seq_len}, micro-batch "
              f"{args.micro_batch_size}, {args.global_batch_tokens} tokens per step; {note}")
        for run in out["runs"]:
            print(f"\n{run['gpus']} GPUs ({run['nodes']} nodes), {run['micro_batches']} micro-batches per GPU per step")
            print(f"  {'system':<8}{'MFU':>7}{'tok/GPU/s':>11}{'step s':>9}{'exposed s':>10}{'mem GiB':>9}  layout")
            for name, r in run["systems"].items():
                lay = str(P.Layout.from_json(r["layout"]))
                print(f"  {name:<8}{100 * r['mfu']:>6.1f}%{r['tokens_per_gpu_s']:>11.0f}{r['step_s']:>9.3f}"
                      f"{r['exposed_comm_s']:>10.3f}{r['memory_gb_per_gpu']:>9.1f}  {lay}{' +ckpt' if r['checkpointing'] else ''}"
                      f"{'' if r['fits'] else '  (does not fit)'}")
    if args.plot:
        _plot_sweep(out["runs"], systems, args.plot, model.name)
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
