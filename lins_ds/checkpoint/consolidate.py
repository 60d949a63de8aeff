"""Full weights from a Lins checkpoint, offline on one CPU process, as Hugging Face safetensors."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from .. import dtypes
from .formats import LINS, LinsCheckpointError, identify, locate, save_file, verify_digest
from .layout_free import digests_of
from .load import ShardReader, _read, read_meta



def full_state_dict(path: str, dtype: torch.dtype, exclude_frozen: bool = False) -> dict:
    """Every parameter (aliases of tied weights once) and persistent buffer, whole, in ``dtype``; frozen parameters
    left out with ``exclude_frozen``, or where the save left them out (``exclude_frozen_parameters``)."""
    meta = read_meta(path, "consolidate")
    digests = digests_of(meta)
    reader = ShardReader(path, meta["index"], digests, "consolidate")
    frozen = _read(lambda p: (verify_digest(p, digests, "consolidate", "frozen.safetensors"), load_file(p))[1],
                   os.path.join(path, "frozen.safetensors"))
    exclude_frozen = exclude_frozen or meta.get("frozen_excluded", False)
    out = {}
    for name, info in meta["params"].items():
        if info["trainable"]:
            t = torch.empty(torch.Size(info["shape"]).numel())
            reader.fill(t, name, 0, t.numel(), "master")
            out[name] = t.view(info["shape"]).to(dtype)
        elif exclude_frozen:
            continue
        elif name in frozen:
            out[name] = frozen[name].to(dtype)
        else:
            raise LinsCheckpointError(f"consolidate: {path} lacks frozen parameter {name}")
    for name, t in frozen.items():
        if name not in meta["params"]:
            out.setdefault(name, t)  # buffers keep their own dtype
    return out


def write_safetensors(state: dict, out_dir: str, max_shard_bytes: int = 5 * 2**30) -> list:
    """model.safetensors, or model-0000i-of-0000n.safetensors plus model.safetensors.index.json."""
    os.makedirs(out_dir, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t.contiguous()
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return names


def checkpoint_path(ckpt_dir: str, tag=None) -> str:
    """The tag directory: CKPT_DIR may be the save directory (its ``latest``, or ``--tag``) or a tag
    directory itself (``.../global_step3``, with or without ``--tag global_step3``)."""
    if not os.path.isdir(ckpt_dir):
        raise LinsCheckpointError(f"consolidate: {ckpt_dir} is not a directory")
    here = identify(ckpt_dir)
    found = here if here is not None and tag in (None, os.path.basename(os.path.normpath(ckpt_dir))) else \
        locate(ckpt_dir, tag)
    if found is None:
        raise LinsCheckpointError(f"consolidate: {ckpt_dir} has no 'latest' file and is no checkpoint itself; pass "
                                  "the checkpoint's tag directory (e.g. .../global_step100) or --tag")
    if found.kind != LINS:
        raise LinsCheckpointError(f"consolidate: {found.path} is {found.describe()}; DeepSpeed's zero_to_fp32.py "
                                  "(saved beside it) writes its full weights, or load it into a Lins engine")
    return found.path


def consolidate(ckpt_dir: str, out_dir: str, tag=None, dtype: str = "fp32", max_shard_bytes: int = 5 * 2**30) -> str:
    if dtype not in dtypes.TORCH:
        raise LinsCheckpointError(f"consolidate --dtype: {dtype!r} is not one of {', '.join(dtypes.TORCH)}")
    path = checkpoint_path(ckpt_dir, tag)
    if os.path.abspath(out_dir) == os.path.abspath(path):
        raise LinsCheckpointError("consolidate: OUT_DIR must differ from the checkpoint directory")
    config, cfg = os.path.join(path, "config.json"), None
    if os.path.lexists(config):  # read_meta has it listed with its digest: checked before anything is written
        digests = digests_of(read_meta(path, "consolidate"))
        cfg = _read(lambda p: (verify_digest(p, digests, "consolidate", "config.json"), _json(p))[1], config)
    state = full_state_dict(path, dtypes.TORCH[dtype])
    write_safetensors(state, out_dir, max_shard_bytes)
    if cfg is not None:
        cfg["torch_dtype"] = dtypes.HF_NAMES[dtype]
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
    return out_dir


def _json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)
