"""``python -m bench COMMAND``, from the repository root (bench/README.md)."""

from __future__ import annotations

import argparse
import sys


def _profile(args) -> int:
    """``lins-ds profile`` with the host's speed in the table's meta, where the simulator finds it; with
    ``--compute`` this GPU's compute table instead (bench/compute_profile.py)."""
    import os

    from lins_ds.tools.profile_cli import run

    if args.compute:
        from lins_ds.profiler.cache import default_dir

        from . import compute_profile

        return compute_profile.main(["--out", args.out or compute_profile.default_path(default_dir())]
                                    + (["--quick"] if args.quick else []))

    from .host import slowest_rank

    def host(device) -> dict:
        seconds = slowest_rank(device)
        if os.environ.get("RANK", "0") == "0":
            print(f"host: {1e6 * seconds:.1f} us per module pass (bench/host.py; the simulator scales DeepSpeed's "
                  "per-fetch cost by it)", flush=True)
        return {"host_s_per_module": seconds}

    return run(args, measure_meta=host)


def _unused_params(args) -> int:
    from .unused_params import main

    main(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from lins_ds.cli import add_profile_arguments

    from . import memory, run, simulate_cli

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="every DeepSpeed mode and Lins side by side (GPUs; one command)")
    run.add_arguments(r)
    r.set_defaults(func=run.main)
    m = sub.add_parser("memory", help="predicted next to measured peak memory, Lins and DeepSpeed (GPUs)")
    memory.add_arguments(m)
    m.set_defaults(func=memory.main)
    s = sub.add_parser("simulate", help="predict MFU of Lins and the DeepSpeed baselines at any scale; fit and "
                       "check the simulator against GPU runs (--fit, --validate)")
    simulate_cli.add_arguments(s)
    s.set_defaults(func=simulate_cli.run)
    p = sub.add_parser("profile", help="lins-ds profile, recording the host's speed for the simulator (every "
                       "rank, under torchrun -m bench profile)")
    add_profile_arguments(p)
    p.add_argument("--compute", action="store_true", help="instead: measure this GPU's compute table (GEMMs by size, "
                   "GEMMs of linear layers of a width off a multiple of 8, attention by sequence length, bandwidth, "
                   "and a few whole decoder layers timed as training runs them: the table's in-training factor; one "
                   "process) for the simulator's shape model")
    p.set_defaults(func=_profile)
    c = sub.add_parser("init-cost", help="start-up cost of lins.init eager against per_module, on the CPU")
    c.add_argument("--model", default="7b", help="comma-separated built-in LLaMA names")
    c.set_defaults(func=lambda a: __import__("bench.init_cost", fromlist=["main"]).main(a))
    o = sub.add_parser("overlap", help="what a copy kernel beside the training step costs it (one GPU; a stand-in "
                       "for the communication Lins overlaps)")
    __import__("bench.overlap", fromlist=["add_arguments"]).add_arguments(o)
    o.set_defaults(func=lambda a: __import__("bench.overlap", fromlist=["main"]).main(a))
    hp = sub.add_parser("host-probe", help="what a layer pass and a checkpointed one cost the host, measured on "
                        "host-bound steps, next to the simulator's fitted terms")
    __import__("bench.host_probe", fromlist=["add_arguments"]).add_arguments(hp)
    hp.set_defaults(func=lambda a: __import__("bench.host_probe", fromlist=["main"]).main(a))
    sh = sub.add_parser("shapes", help="the shape compute model held to one-GPU runs of shapes it was not fitted on")
    sh.set_defaults(func=lambda a: __import__("bench.shapes", fromlist=["main"]).main(a))
    __import__("bench.shapes", fromlist=["add_arguments"]).add_arguments(sh)
    ls = sub.add_parser("layer-split", help="one decoder layer of every measured shape timed and split by kernel "
                        "kind (GPU), next to the shape compute model's price (--analyse, CPU)")
    __import__("bench.layer_split", fromlist=["add_arguments"]).add_arguments(ls)
    ls.set_defaults(func=lambda a: __import__("bench.layer_split", fromlist=["main"]).main(a))
    u = sub.add_parser("unused-params", help="parameters used on some ranks only: DDP, Lins and DeepSpeed (CPU)")
    u.add_argument("--out", help="where the JSON goes (default bench/results/unused_params)")
    u.set_defaults(func=_unused_params)
    return parser


def main(argv=None) -> int:
    from lins_ds.plan import PlanError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PlanError as e:
        print(f"python -m bench {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
