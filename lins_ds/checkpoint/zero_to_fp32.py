"""DeepSpeed's ``zero_to_fp32`` on a Lins checkpoint: the full fp32 weights, as DeepSpeed's own converter gives them.

``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (which DeepSpeed's
``convert_zero_checkpoint_to_fp32_state_dict`` and ``load_state_dict_from_zero_checkpoint`` call) reads a Lins
checkpoint through ``lins_ds.checkpoint.consolidate``; any other directory goes to DeepSpeed's code unchanged. A Lins
save also writes ``zero_to_fp32.py`` beside its tags, as DeepSpeed does: ``python zero_to_fp32.py . out`` there.
"""

from __future__ import annotations

import os

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


def write_script(save_dir: str) -> None:
    """``zero_to_fp32.py`` in ``save_dir``, unless one is there (rank 0, at a save)."""
    path = os.path.join(save_dir, "zero_to_fp32.py")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(SCRIPT)
        os.chmod(path, 0o755)
