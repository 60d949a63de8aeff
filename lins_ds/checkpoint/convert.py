"""``lins-ds convert CKPT OUT --to deepspeed-universal``: a Lins checkpoint as a DeepSpeed universal checkpoint,
which DeepSpeed ZeRO-1/2/3 load with ``"checkpoint": {"load_universal": true}`` (docs/design.md §9). Offline,
one process, one parameter in memory at a time."""

from __future__ import annotations

import os

import torch

from . import universal
from .consolidate import checkpoint_path
from .formats import LinsCheckpointError, load_pickle, verify_digest
from .layout_free import digests_of
from .load import ShardReader, _read, read_meta

def _parameters(path: str, meta: dict, reader: ShardReader):
    """(name, {"master", <element-wise state>: whole fp32}) of every trainable parameter, one at a time."""
    for name, info in meta["params"].items():
        if not info["trainable"]:
            continue
        shape = torch.Size(info["shape"])
        state = {}
        for what in ["master"] + list(meta["elementwise_state"]):
            t = torch.empty(shape.numel())
            if not reader.fill(t, name, 0, shape.numel(), what):
                raise LinsCheckpointError(f"convert: {path} lacks {what} of {name}")
            state[what] = t.view(shape)
        yield name, state


def to_universal(ckpt_dir: str, out_dir: str, tag=None, trust_pickle: bool = False) -> str:
    path = checkpoint_path(ckpt_dir, tag)
    meta = read_meta(path, "convert")
    unknown = set(meta["elementwise_state"]) - {"exp_avg", "exp_avg_sq"}
    if unknown:
        raise LinsCheckpointError(f"convert: {path} holds {meta['optimizer']} state {sorted(unknown)}; DeepSpeed's "
                                  "universal checkpoint carries Adam's (exp_avg, exp_avg_sq)")
    digests = digests_of(meta)
    reader = ShardReader(path, meta["index"], digests, "convert")
    step = reader.scalar(0, "step")
    extra = _read(lambda p: (verify_digest(p, digests, "convert", "extra.pt"), load_pickle(p, trust_pickle))[1],
                  os.path.join(path, "extra.pt"))
    ours = extra.get("deepspeed") or {}  # the run's DeepSpeed config and parallel degrees, as DeepSpeed saves them
    client_state = {**{k: ours[k] for k in ("ds_config", "checkpoint_parallel_dimensions") if k in ours},
                    **(extra["client_state"] or {})}
    counters = {k: meta[k] for k in ("global_steps", "global_samples", "skipped_steps")}
    os.makedirs(out_dir, exist_ok=True)
    return universal.write(_parameters(path, meta, reader), float(step) if step is not None else 0.0,
                           meta["param_groups"], counters, extra["lr_scheduler"], client_state,
                           meta["world_size"], out_dir, os.path.basename(os.path.normpath(path)))
