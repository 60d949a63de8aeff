"""Run a script you cannot edit with Lins active: ``import lins_ds`` first, then the script as __main__.

    torchrun --nproc_per_node 8 -m lins_ds.run train.py --deepspeed ds_configs/lins.json ...
    deepspeed --module lins_ds.run train.py --deepspeed ds_configs/lins.json ...
    accelerate launch -m lins_ds.run train.py ...
    python -m lins_ds.run -m some.package.module ARGS      (a module instead of a file)
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


def main(argv=None) -> None:
    lead, argv = _launcher_options(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(USAGE)
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
