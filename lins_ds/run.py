"""Run a script you cannot edit with Lins active: ``import lins_ds`` first, then the script as __main__.

    torchrun --nproc_per_node 8 -m lins_ds.run train.py --deepspeed ds_configs/lins.json ...
    deepspeed --module lins_ds.run train.py --deepspeed ds_configs/lins.json ...
    accelerate launch -m lins_ds.run train.py ...
    python -m lins_ds.run -m some.package.module ARGS      (a module instead of a file)

When the script finishes, the process group it left open is destroyed, as torch asks every process to.
"""

from __future__ import annotations

import os
import runpy
import sys

import lins_ds  # noqa: F401  (installs the deepspeed / accelerate hooks before the script runs)

USAGE = "usage: python -m lins_ds.run SCRIPT.py [ARGS...] | -m MODULE [ARGS...]"


def _launcher_options(argv: list) -> tuple:
    """DeepSpeed's launcher puts ``--local_rank=N`` before the script (``python -m lins_ds.run --local_rank=0
    train.py ...``); split such leading options off, to hand them to the script as the launcher would."""
    lead = []
    while argv and argv[0].startswith("--local_rank"):
        lead.append(argv.pop(0))
        if lead[-1] == "--local_rank" and argv:
            lead.append(argv.pop(0))
    return lead, argv


def _release_process_group() -> None:
    """Destroy the default process group a finished script left open. torch asks every process to end with
    ``destroy_process_group()``; scripts rarely do, and a gloo group left to interpreter exit can abort the
    process after its work is done (pytorch/pytorch#179291), which torchrun reports as the job failing."""
    import torch.distributed as dist

    engine = sys.modules.get("lins_ds.integrations.engine")  # loaded once the script built a LinsEngine
    if engine is not None:
        engine.destroy_live_engines()  # first: their collectives still in flight finish on the group
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv=None) -> None:
    lead, argv = _launcher_options(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(USAGE)
    try:
        _run(argv, lead)
    except SystemExit as e:
        if e.code in (None, 0):  # sys.exit() from a script that finished
            _release_process_group()
        raise
    _release_process_group()  # not on an error: the script's own traceback stays the last word


def _run(argv: list, lead: list) -> None:
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(USAGE)
        sys.argv = [argv[1]] + lead + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [argv[0]] + lead + argv[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
