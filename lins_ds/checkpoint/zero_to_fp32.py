"""DeepSpeed's ``zero_to_fp32`` on a Lins checkpoint: the full fp32 weights, as DeepSpeed's own converter gives them.

``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (which DeepSpeed's
``convert_zero_checkpoint_to_fp32_state_dict`` and ``load_state_dict_from_zero_checkpoint`` call) reads a Lins
checkpoint through ``lins_ds.checkpoint.consolidate``; any other directory goes to DeepSpeed's code unchanged. A Lins
save also writes ``zero_to_fp32.py`` beside its tags, as DeepSpeed does: ``python zero_to_fp32.py . out`` there.

``python -m deepspeed.utils.zero_to_fp32 CKPT OUT`` (or a copy of DeepSpeed's file) runs DeepSpeed's code as the
program, a module of its own that the patch above does not reach: on a Lins checkpoint it looks for ZeRO's
``*_model_states.pt`` in the tag directory and raises FileNotFoundError. There, and only when the directory holds a
Lins checkpoint, the error is replaced by one naming what it looked for and the command that converts it.
"""

from __future__ import annotations

import os
import shlex
import sys

import torch

SCRIPT = '''#!/usr/bin/env python
"""Written by lins_ds beside its checkpoints, as DeepSpeed writes its own: the same arguments and output.
    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [--tag TAG] [--max_shard_size 5GB]"""
import argparse

import lins_ds  # noqa: F401  (DeepSpeed's converter then reads Lins checkpoints)
from deepspeed.utils import zero_to_fp32

p = argparse.ArgumentParser()
p.add_argument("checkpoint_dir")
p.add_argument("output_dir")
p.add_argument("--max_shard_size", default="5GB")
p.add_argument("--safe_serialization", action="store_true")
p.add_argument("-t", "--tag", default=None)
p.add_argument("--exclude_frozen_parameters", action="store_true")
p.add_argument("-d", "--debug", action="store_true")
a = p.parse_args()
zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(a.checkpoint_dir, a.output_dir, max_shard_size=a.max_shard_size,
                                                         safe_serialization=a.safe_serialization, tag=a.tag,
                                                         exclude_frozen_parameters=a.exclude_frozen_parameters)
'''


def lins_checkpoint(checkpoint_dir: str, tag=None):
    """The tag directory of the Lins checkpoint ``checkpoint_dir`` names, or None (not a Lins checkpoint)."""
    from .consolidate import checkpoint_path
    from .formats import LinsCheckpointError

    try:
        return checkpoint_path(checkpoint_dir, tag)
    except LinsCheckpointError:
        return None


def install() -> None:
    if _runs_deepspeed_script() and not getattr(sys.excepthook, "_lins", False):
        sys.excepthook = _explaining_hook(sys.excepthook)
    from deepspeed.utils import zero_to_fp32 as z

    real = z.get_fp32_state_dict_from_zero_checkpoint
    if getattr(real, "_lins", False):
        return

    def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                                 lazy_mode=False):
        path = lins_checkpoint(checkpoint_dir, tag)
        if path is None:
            return real(checkpoint_dir, tag, exclude_frozen_parameters, lazy_mode=lazy_mode)
        from .consolidate import full_state_dict

        return full_state_dict(path, torch.float32, exclude_frozen=exclude_frozen_parameters)

    get_fp32_state_dict_from_zero_checkpoint.__doc__ = real.__doc__
    get_fp32_state_dict_from_zero_checkpoint._lins = True
    z.get_fp32_state_dict_from_zero_checkpoint = get_fp32_state_dict_from_zero_checkpoint


def _runs_deepspeed_script():
    """Whether this process runs DeepSpeed's zero_to_fp32 as its program: "module" for ``python -m
    deepspeed.utils.zero_to_fp32`` (seen in the interpreter's own arguments: runpy has not yet set ``sys.argv``),
    "file" for a file of that name that is not the one a Lins save writes (which imports lins_ds and so reads Lins
    checkpoints), else None."""
    args = list(getattr(sys, "orig_argv", None) or [])[1:]
    while args and args[0].startswith("-") and args[0] != "-":
        arg = args.pop(0)
        if arg in ("-m", "-c"):
            return "module" if arg == "-m" and args[:1] == ["deepspeed.utils.zero_to_fp32"] else None
        if arg.startswith("-m") or arg.startswith("-c"):
            return "module" if arg == "-mdeepspeed.utils.zero_to_fp32" else None
        if arg in ("-W", "-X") and args:
            args.pop(0)
    script = args[0] if args else ""
    return "file" if os.path.basename(script) == "zero_to_fp32.py" and not _is_ours(script) else None


def _is_ours(script: str) -> bool:
    """``script`` is the zero_to_fp32.py a Lins save writes."""
    try:
        with open(script, encoding="utf-8") as f:
            return f.read() == SCRIPT
    except (OSError, UnicodeDecodeError):
        return False


def explain(error: BaseException, argv: list):
    """The message for ``error``, raised by DeepSpeed's zero_to_fp32 run as a program with arguments ``argv``, where
    its checkpoint directory holds a Lins checkpoint; None otherwise."""
    import argparse

    if not isinstance(error, (FileNotFoundError, ValueError)):
        return None
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("checkpoint_dir")
    p.add_argument("output_dir")
    p.add_argument("-t", "--tag", default=None)
    try:
        args, _ = p.parse_known_args(argv)
    except SystemExit:
        return None
    path = lins_checkpoint(args.checkpoint_dir, args.tag)
    if path is None:
        return None
    script = os.path.join(os.path.dirname(os.path.normpath(path)), "zero_to_fp32.py")
    consolidate = f"lins-ds consolidate {shlex.quote(args.checkpoint_dir)} {shlex.quote(args.output_dir)}" + \
        (f" --tag {shlex.quote(args.tag)}" if args.tag else "")
    commands = ([f"python {shlex.quote(script)} {shlex.join(argv)}"] if _is_ours(script) else []) + [consolidate]
    return (f"deepspeed.utils.zero_to_fp32: {type(error).__name__}: {error}\n"
            f"{path} is a Lins checkpoint (meta.json, shard-*.safetensors), not a DeepSpeed ZeRO one: DeepSpeed's "
            f"zero_to_fp32, run as a program, looks for {os.path.join(path, '*_model_states.pt')} and "
            "*_optim_states.pt, which a Lins save does not write. Convert it with "
            + ("the zero_to_fp32.py its save wrote beside its tags (the same arguments and output), or " if
               len(commands) == 2 else "") + "lins-ds consolidate (Hugging Face safetensors):\n"
            + "\n".join(f"    {c}" for c in commands))


def _explaining_hook(real):
    def excepthook(kind, value, tb):
        try:
            message = explain(value, sys.argv[1:])
        except Exception:  # noqa: BLE001 - the explanation must never hide the error itself
            message = None
        if message is None:
            return real(kind, value, tb)
        print(message, file=sys.stderr, flush=True)

    excepthook._lins = True
    return excepthook


def write_script(save_dir: str) -> None:
    """``zero_to_fp32.py`` in ``save_dir``, unless one is there (rank 0, at a save)."""
    path = os.path.join(save_dir, "zero_to_fp32.py")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(SCRIPT)
        os.chmod(path, 0o755)
