"""``lins-ds`` command line. Subcommands import only what they need (``plan`` never imports torch)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence


class _Parser(argparse.ArgumentParser):
    """Errors are one line on stderr and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="built-in name (llama-7b, llama-13b, ...) or a HF config.json")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes M")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node L")
    p.add_argument("--gpu-memory-gb", type=float, help="memory per GPU in GiB (default: the cluster's)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    ck = p.add_mutually_exclusive_group()
    ck.add_argument("--activation-checkpointing", dest="ckpt", action="store_true", default=None,
                    help="checkpoint every layer unit (default: the solver picks how many, 0..N)")
    ck.add_argument("--no-activation-checkpointing", dest="ckpt", action="store_false")
    ck.add_argument("--checkpoint-units", dest="ckpt", type=int, metavar="K", help="checkpoint the first K layer units")
    p.add_argument("--cluster", help="built-in synthetic cluster (default a800-ib); with --profile only its compute "
                   "model, as lins.cluster in the engine (default h200-emulated, lins.cluster's)")
    p.add_argument("--profile", help="profile table JSON written by lins-ds profile")
    p.add_argument("--memory-profile", help="activation memory profile JSON, as lins.memory_profile (what lins-ds "
                   "profile --memory wrote, or an engine start-up cached beside the profiles): its activations, and "
                   "where it timed a layer on a GPU, the compute rate the engine prices with")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="parameter dtype")
    p.add_argument("--grad-accum-dtype", choices=["bf16", "fp16", "fp32"], help="gradient accumulation dtype (default: the parameter dtype, as DeepSpeed)")
    p.add_argument("--grad-reduce-dtype", choices=["bf16", "fp16", "fp32"], help="gradient communication dtype (default: --dtype)")
    p.add_argument("--gradient-clipping", type=float, default=1.0, help="DeepSpeed's gradient_clipping (default 1.0, "
                   "DeepSpeed's where the key is absent); 0 without --dtype fp16 (no loss scaling either): the "
                   "offloaded units' host updates start inside the last backward, as each gradient is final")
    p.add_argument("--reserved-gb", type=float, help="memory outside the allocator (CUDA context, communicator "
                   "buffers), GiB; default 2, or 0 with a --profile measured on CPUs")
    p.add_argument("--fragmentation", type=float, default=0.05, help="allocator margin, fraction")
    p.add_argument("--objective", default="step", choices=["step", "comm"],
                   help="step (default): exposed communication after overlap + recompute + optimizer update; "
                        "comm: all communication + recompute (the paper's, for its Table III)")
    p.add_argument("--host-memory-gb", type=float, help="host memory per node the offloaded optimizer state may "
                   "pin, GiB; with it the solver may offload (--offload auto)")
    p.add_argument("--offload", choices=["auto", "off", "fixed"], help="auto: where no plan fits the GPU, the solver "
                   "may put the last units' optimizer state on the host, as the engine's lins.offload \"auto\" "
                   "(default with --host-memory-gb); off: never; fixed: as lins.offload {\"os\": \"cpu\", ...} "
                   "(--os-fraction, --offload-g, --offload-p)")
    p.add_argument("--os-fraction", type=float, default=1.0, help="--offload fixed: the fraction of units whose "
                   "optimizer state is on the host (lins.offload.os_fraction)")
    p.add_argument("--offload-g", default="auto", choices=["auto", "cpu", "gpu"], help="--offload fixed: the offloaded "
                   "units' gradients (lins.offload.g)")
    p.add_argument("--offload-p", default="gpu", choices=["auto", "cpu", "gpu"], help="--offload fixed: their "
                   "parameters (lins.offload.p)")
    p.add_argument("--host-update-gelems", type=float, default=2.2, help="host optimizer speed, G elements/s "
                   "(default: torch's fused CPU AdamW as measured by an H200 host's engine start-up)")
    p.add_argument("--host-copy-gbs", type=float, default=50.0, help="pinned host<->GPU copy bandwidth, GB/s")
    p.add_argument("--tiling", default="auto", help="sequence tiling of the MLPs and the logits + loss, as lins.tiling: "
                   "auto (only where nothing fits untiled; LLaMA-like models), off, or MLP,LOGITS tile counts")
    p.add_argument("--activation-offload", default="auto", help="checkpointed layers' inputs held on the host, as "
                   "lins.activation_offload: auto (the fewest that fit, only where nothing fits without; needs "
                   "--host-memory-gb), off, or a number of layers")
    p.add_argument("--longest", action="store_true", help="also find the longest sequence (a multiple of 128) that "
                   "fits this budget and host, and say which tensor binds beyond it")
    p.add_argument("--format", default="table", choices=["table", "json"])


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``lins-ds profile`` (also ``python -m bench profile``'s)."""
    p.add_argument("--out", help="write the table here (default: the cache file for this launch)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (what engine start-up runs)")
    p.add_argument("--gpus-per-node", type=int, help="emulate nodes of L GPUs on one host (NCCL_HOSTID)")
    p.add_argument("--max-mb", type=float, help="largest message in MiB")
    p.add_argument("--validate", action="store_true", help="also time every candidate plan's collectives "
                    "on their real groups and report prediction error")
    p.add_argument("--memory", action="store_true", help="also measure the activation memory of --model (one "
                    "layer unit and the head, as the engine does at start-up) and cache it beside the profiles")
    p.add_argument("--model", default="llama-1b", help="with --validate / --memory: the model (a built-in name)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="with --memory")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1)


def _offload_rungs(args: argparse.Namespace, topo) -> tuple:
    """(rungs, host): --offload as the engine's lins.offload, the same ladder (``plan.offload.ladder``), and the host
    given (None without --host-memory-gb)."""
    from .plan.offload import HostSpec, ladder

    mode = args.offload or ("auto" if args.host_memory_gb else "off")
    if mode != "off" and not args.host_memory_gb:
        raise SystemExit(f"lins-ds plan: --offload {mode} needs --host-memory-gb (the host memory per node)")
    host = (HostSpec(args.host_memory_gb / topo.gpus_per_node, args.host_update_gelems * 1e9, args.host_copy_gbs,
                     args.host_copy_gbs, source="given (lins-ds plan)") if args.host_memory_gb else None)
    if mode == "fixed":
        return ladder(mode, lambda: host, args.os_fraction, args.offload_g, args.offload_p), host
    return ladder(mode, lambda: host), host


def cmd_plan(args: argparse.Namespace) -> int:
    from . import plan as P
    from .plan import context, cost, report
    from .plan import sequence
    from .plan.offload import walk

    topo = P.Topology(args.nodes, args.gpus_per_node)
    model = P.load_model(args.model)
    acts = context.read_activations(args.memory_profile, "--memory-profile") if args.memory_profile else None
    if args.profile:  # the engine's rules for a profile JSON (lins.profile): compute from lins.cluster's default
        table = P.ProfileTable.load(args.profile)
        cluster_name = args.cluster or context.DEFAULT_CLUSTER
        capacity = args.gpu_memory_gb if args.gpu_memory_gb is not None else table.meta.get("gpu_memory_gb")
    else:
        cluster = P.get_cluster(args.cluster or "a800-ib")
        table, cluster_name = cluster.table(cost.required_meshes(topo, P.candidates(topo))), cluster.name
        capacity = args.gpu_memory_gb if args.gpu_memory_gb is not None else cluster.gpu_memory_gb
    compute = context.compute_for(table, cluster_name, model, acts)  # the engine's rate where the profile timed one
    if capacity is None:
        raise P.PlanError("--gpu-memory-gb: required when the profile does not record the GPU memory")
    train = P.TrainingSpec(args.seq_len, args.micro_batch_size, args.grad_accum, args.dtype,
                           args.grad_accum_dtype, args.grad_reduce_dtype, activation_checkpointing=args.ckpt,
                           host_update_in_backward=args.gradient_clipping == 0 and args.dtype != "fp16")
    device = "cpu" if args.profile and table.meta.get("device") == "cpu" else "cuda"  # the profile's device
    mem = P.MemorySpec(capacity, context.reserved_gb(args.reserved_gb, device), args.fragmentation)
    rungs, host = _offload_rungs(args, topo)
    tilings = sequence.rungs(_tiling_choice(args.tiling), model.arch == "llama",
                             _activation_offload_choice(args.activation_offload))

    def solve_at(t, mlp, logits, act):  # one tiling rung, the offload ladder walked
        def solve(spec):
            spec = sequence.with_host(spec, act, lambda: host)
            return P.solve(model, topo, sequence.tiled(t, mlp, logits, act), mem, table, compute,
                           objective=args.objective, activations=acts, offload=spec), True
        return walk(rungs, solve, (P.NoFeasiblePlan,))

    def plan_at(t):  # the engine's policies: "auto" offloads, then tiles, then offloads activations, each only where
        return sequence.walk(tilings, lambda *rung: solve_at(t, *rung), (P.NoFeasiblePlan,))  # nothing fits without

    longest = _longest(plan_at, model, train, P, tilings[-1]) if args.longest else None
    try:
        sol = plan_at(train)
    except P.NoFeasiblePlan as e:
        if args.format == "json":
            print(json.dumps({"error": str(e), "smallest_plan": e.smallest.layout.to_json(),
                              "smallest_memory_gb": round(e.smallest.memory.total_gb, 4),
                              "lacking_gb": round(e.smallest.memory.total_gb - e.capacity_gb, 4),
                              **({"longest": longest.to_json()} if longest else {})}))
        print(f"lins-ds plan: {e}", file=sys.stderr)
        if longest:
            print(f"lins-ds plan: {longest.describe()}", file=sys.stderr)
        return 2
    sol.inputs.update(model=model.name, params=model.total_params(), nodes=topo.nodes,
                      gpus_per_node=topo.gpus_per_node, gpu_memory_gb=capacity, seq_len=train.seq_len,
                      micro_batch_size=train.micro_batch_size, grad_accum=train.grad_accum, dtype=train.param_dtype,
                      gradient_clipping=args.gradient_clipping)
    head = sequence.head_tiling(_tiling_choice(args.tiling), model.arch == "llama", sol.plan, sol.best,
                                lambda: solve_at(train, *sequence.HEAD_TILES, False).best, (P.NoFeasiblePlan,))
    if args.format == "json":
        print(json.dumps({**report.to_json(sol), **({"longest": longest.to_json()} if longest else {}),
                          **({"head_tiling": head.strip()} if head else {})}, indent=1))
    else:
        said = context.compute_note(model, acts, compute, cluster_name)
        print(report.to_table(sol) + (f"\n  compute: {said}" if said else "") + head
              + (f"\n{longest.describe()}" if longest else ""))
    return 0


def _activation_offload_choice(text: str):
    """--activation-offload as lins.activation_offload: "auto", False ("off"), or a number of layers."""
    if text in ("auto", "off"):
        return "auto" if text == "auto" else False
    if text.isdigit():
        return int(text)
    raise SystemExit(f"lins-ds plan: --activation-offload {text!r} is not auto, off or a number of layers")


def _tiling_choice(text: str):
    """--tiling as lins.tiling: "auto", False ("off"), or (MLP tiles, logits tiles) from "M,L"."""
    if text in ("auto", "off"):
        return "auto" if text == "auto" else False
    parts = [x.strip() for x in text.split(",")]
    if len(parts) == 2 and all(x.isdigit() and int(x) >= 1 for x in parts):
        return (int(parts[0]), int(parts[1]))
    raise SystemExit(f"lins-ds plan: --tiling {text!r} is not auto, off or MLP,LOGITS (two positive tile counts)")


def _longest(plan_at, model, train, P, last_tiling: tuple):
    """The longest sequence ``plan_at`` finds a plan for (``plan.longest.search``), and at the next length tried the
    smallest plan's terms, the activations split by tensor (``plan.longest``) under the last tiling tried."""
    import dataclasses

    from .plan import longest as L
    from .plan import sequence

    def at(n):
        return dataclasses.replace(train, seq_len=n)

    def fits(n):
        try:
            plan_at(at(n))
            return True
        except P.NoFeasiblePlan:
            return False

    seq, capped = L.search(fits, train.seq_len)
    if capped:
        return L.Longest(seq, True)
    try:
        plan_at(at(seq + L.ALIGN))
        return L.Longest(seq, False)  # not monotone after all: say only the length
    except P.NoFeasiblePlan as e:
        smallest = e.smallest
        gpu = smallest.memory.total_gb - e.capacity_gb
        host = smallest.memory.host_gb - smallest.host_capacity_gb
        tensors = L.activation_tensors(model, sequence.tiled(at(seq + L.ALIGN), *last_tiling[:2]), smallest.ckpt_units,
                                       act_offload_units=smallest.act_offload_units)
        return L.Longest(seq, False, L.binding(smallest.memory.terms, tensors), max(gpu, host),
                         "host" if host > gpu else "GPU")


def cmd_demo(args: argparse.Namespace) -> int:
    from .tools.demo import run

    return run(args)


def _quiet_cpu_accelerator() -> None:
    """DeepSpeed warns on import that it fell back to its CPU accelerator; a command that runs on the CPU anyway
    says so itself (``DS_ACCELERATOR=cpu`` is DeepSpeed's own way to choose it, silently)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def cmd_profile(args: argparse.Namespace) -> int:
    import torch

    if args.compute:
        raise SystemExit("lins-ds profile: --compute (the simulator's compute table) moved out of the package: run "
                         "python -m bench profile --compute from the repository root")
    if not torch.cuda.is_available():
        _quiet_cpu_accelerator()
    from .tools.profile_cli import run

    return run(args)


def cmd_consolidate(args: argparse.Namespace) -> int:
    _quiet_cpu_accelerator()
    from .checkpoint.consolidate import consolidate
    from .checkpoint.formats import LinsCheckpointError

    try:
        out = consolidate(args.ckpt_dir, args.out_dir, args.tag, args.dtype, int(args.max_shard_gb * 2**30))
    except LinsCheckpointError as e:
        print(f"lins-ds consolidate: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote full weights to {out}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    """The decisions ``"plan": "tune"`` cached: one per job (launch, model shape, batch, dtypes, budget)."""
    _quiet_cpu_accelerator()
    from .runtime.switch import tune

    directory = args.dir or tune.cache_dir(argparse.Namespace(profile_cache=None))
    found = tune.list_decisions(directory)
    if not found:
        print(f"no cached tuning decisions in {directory}")
        return 0
    for path, d in found:
        key, plan = d.get("key", {}), d.get("plan", {})
        train, model, budget = key.get("train", {}), key.get("model", {}), key.get("memory", {})
        print(f"{path}  ({d.get('when', '?')})\n  job: {model.get('name', '?')} on {key.get('nodes')} node(s) x "
              f"{key.get('gpus_per_node')} {key.get('device')}, seq {train.get('seq_len')}, micro-batch "
              f"{train.get('micro_batch_size')}, grad-accum {train.get('grad_accum')}, "
              f"{budget.get('capacity_gb', 0):.4g} GiB per GPU\n  decision: "
              f"{next((r['candidate'] for r in d.get('trials', []) if r.get('chosen')), plan)}")
        if args.forget:
            os.remove(path)
            print("  forgotten: the next launch of this job tunes again")
            continue
        print(tune.table(d.get("trials", []), (budget.get("capacity_gb") or 0) - (budget.get("reserved_gb") or 0)))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    _quiet_cpu_accelerator()
    from .checkpoint.convert import to_universal
    from .checkpoint.formats import LinsCheckpointError

    try:
        out = to_universal(args.ckpt_dir, args.out_dir, args.tag, trust_pickle=args.checkpoint_pickle)
    except LinsCheckpointError as e:
        print(f"lins-ds convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a DeepSpeed universal checkpoint to {out}; load it with \"checkpoint\": {{\"load_universal\": true}} "
          f"and engine.load_checkpoint({os.path.dirname(out)!r})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lins-ds", description="Lins: independent P/G/OS sharding for DeepSpeed")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("plan", help="choose P/G/OS sharding factors for a model and cluster")
    _add_plan_args(p)
    p.set_defaults(func=cmd_plan)
    d = sub.add_parser("demo", help="CPU demo: 4 gloo processes as 2 nodes x 2 train a tiny LLaMA under Lins")
    d.add_argument("--steps", type=int, default=30)
    d.set_defaults(func=cmd_demo)
    pr = sub.add_parser("profile", help="measure collective bandwidth per mesh (run on every rank under torchrun)")
    add_profile_arguments(pr)
    pr.add_argument("--compute", action="store_true", help=argparse.SUPPRESS)  # moved to bench: said so below
    pr.set_defaults(func=cmd_profile)
    c = sub.add_parser("consolidate", help="full weights from a Lins checkpoint as HF safetensors")
    c.add_argument("ckpt_dir")
    c.add_argument("out_dir")
    c.add_argument("--tag", help="checkpoint tag (default: the 'latest' file)")
    c.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    c.add_argument("--max-shard-gb", type=float, default=5.0, help="split the weights into files of this size")
    c.set_defaults(func=cmd_consolidate)
    cv = sub.add_parser("convert", help="a Lins checkpoint as a DeepSpeed universal checkpoint (ZeRO-1/2/3 load it)")
    cv.add_argument("ckpt_dir")
    cv.add_argument("out_dir")
    cv.add_argument("--tag", help="checkpoint tag (default: the 'latest' file)")
    cv.add_argument("--to", default="deepspeed-universal", choices=["deepspeed-universal"])
    cv.add_argument("--checkpoint-pickle", action="store_true", help="unpickle any object in the checkpoint's "
                    "client_state (runs code: only for checkpoints you trust)")
    cv.set_defaults(func=cmd_convert)
    t = sub.add_parser("tune", help="the decisions \"plan\": \"tune\" cached (one per job), with their trials")
    t.add_argument("--show", action="store_true", help="list them (the default)")
    t.add_argument("--forget", action="store_true", help="delete them: the next launch of each job tunes again")
    t.add_argument("--dir", help="the cache directory (lins.profile_cache; default ~/.cache/lins_ds/profiles)")
    t.set_defaults(func=cmd_tune)
    return parser


MOVED = {"bench": "run", "memory-bench": "memory", "simulate": "simulate"}  # to the repository's bench package


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .plan import PlanError

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        build_parser().print_help(sys.stderr)
        return 2
    if argv[0] in MOVED:
        print(f"lins-ds {argv[0]}: moved out of the installed package; from a clone of the repository run "
              f"`python -m bench {MOVED[argv[0]]} ...` (bench/README.md)", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PlanError as e:
        print(f"lins-ds {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
