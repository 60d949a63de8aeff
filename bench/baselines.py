"""Helpers that let one training script (``bench/train.py``) run Lins and every DeepSpeed baseline."""

from __future__ import annotations

import contextlib
import os

from lins_ds.comm import set_virtual_node


def zero_stage(ds_config: dict) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def is_mics(ds_config: dict) -> bool:
    return int((ds_config.get("zero_optimization") or {}).get("mics_shard_size", -1)) > 0


def model_init_context(ds_config: dict, device=None):
    """The context a model must be built in: ``lins_ds.init`` for Lins (no rank holds the model whole),
    ``deepspeed.zero.MiCS_Init`` for MiCS, ``deepspeed.zero.Init`` for ZeRO-3 and ZeRO++, else ``device``
    (built there directly: fast, and the same values for a seed)."""
    import deepspeed

    import lins_ds
    from lins_ds.runtime.config import lins_block

    if lins_block(ds_config) is not None:
        return lins_ds.init(config=ds_config)
    if zero_stage(ds_config) == 3:
        if is_mics(ds_config):
            return deepspeed.zero.MiCS_Init(config_dict_or_path=ds_config)
        return deepspeed.zero.Init(config_dict_or_path=ds_config)
    return device if device is not None else contextlib.nullcontext()


def emulate_nodes(ds_config: dict, gpus_per_node: int) -> dict:
    """Make one host act as nodes of ``gpus_per_node`` GPUs: the virtual node's NCCL_HOSTID, and every
    node-sized setting of the config — ``lins.gpus_per_node``, ZeRO++ ``zero_hpz_partition_size``,
    MiCS ``mics_shard_size`` — set to it."""
    set_virtual_node(gpus_per_node)
    cfg = dict(ds_config)
    if isinstance(cfg.get("lins"), dict):
        cfg["lins"] = {**cfg["lins"], "gpus_per_node": gpus_per_node}
    zero = dict(cfg.get("zero_optimization") or {})
    if zero.get("zero_hpz_partition_size", 1) > 1:
        zero["zero_hpz_partition_size"] = gpus_per_node
    if zero.get("mics_shard_size", -1) > 0:
        zero["mics_shard_size"] = gpus_per_node
        if int(os.environ.get("WORLD_SIZE", gpus_per_node)) <= gpus_per_node:
            zero["mics_hierarchical_params_gather"] = False  # DeepSpeed refuses it within one node
    if zero:
        cfg["zero_optimization"] = zero
    return cfg
