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
    """The context a model must be built in: ``lins_ds.init`` for Lins (no rank holds the model whole), for ZeRO-3 and
    ZeRO++ ``deepspeed.zero.Init`` as transformers enters it (``zero3_build``; then ``hf_initialise``), for MiCS
    ``deepspeed.zero.MiCS_Init`` (its weights torch's defaults, see ``hf_initialise``), else ``device`` (built there
    directly: fast, and the same values for a seed)."""
    import lins_ds
    from lins_ds.runtime.config import lins_block

    if lins_block(ds_config) is not None:
        return lins_ds.init(config=ds_config)
    if zero_stage(ds_config) == 3:
        if is_mics(ds_config):
            import deepspeed

            return deepspeed.zero.MiCS_Init(config_dict_or_path=ds_config)
        return zero3_build(ds_config)
    return device if device is not None else contextlib.nullcontext()


_HF_DS_CONFIG = []  # transformers holds its DeepSpeed config by a weak reference: kept alive here


@contextlib.contextmanager
def zero3_build(ds_config: dict):
    """What transformers' ``from_config`` does under ZeRO-3, for any way the bench builds a model: ZeRO-3 declared to
    transformers (``HfDeepSpeedConfig``, kept alive for the process, as HF's docs ask of a script without the
    Trainer: ``bench.train`` builds one model per process), weight initialisation off while the parameters are
    partitioned as they are made (``no_init_weights``, ``zero.Init``; arange's fp32 kept for RoPE's frequencies), and
    ``hf_initialise`` after. Built inside a bare ``zero.Init``, Hugging Face's initialisation saw empty shards and the
    weights kept torch's defaults (the embedding's standard deviation 1, not ``initializer_range``): the ZeRO-3
    baselines started from a loss of ~1885 where Lins started from ln(vocab) (ALST on one H100, issue 60)."""
    import deepspeed
    from transformers.initialization import no_init_weights
    from transformers.integrations import HfDeepSpeedConfig

    try:  # RoPE's inv_freq made by arange stays fp32 inside zero.Init (its dtype is the config's bf16 there)
        from transformers.modeling_utils import prevent_arange_dtype_change
    except ImportError:  # a transformers without it builds as it always did
        prevent_arange_dtype_change = contextlib.nullcontext
    _HF_DS_CONFIG[:] = [HfDeepSpeedConfig(ds_config)]
    with no_init_weights(), prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=ds_config):
        yield


def hf_initialise(model, ds_config: dict) -> None:
    """A model built in ``zero3_build`` initialised as transformers does under ZeRO-3: each module's parameters
    gathered, Hugging Face's ``_init_weights`` on rank 0, the result partitioned again; modules transformers has
    initialised already (``from_config`` does it itself once ZeRO-3 is declared) are left alone. Not MiCS: on
    DeepSpeed 0.19.6 (the last release with MiCS) the gathered write left rank 0's embedding shard unwritten (NaN),
    so MiCS keeps torch's default initialisation; the bench compares its speed, not its losses."""
    if zero_stage(ds_config) != 3 or is_mics(ds_config):
        return
    from transformers.integrations.deepspeed import initialize_weights_zero3

    initialize_weights_zero3(model)
    model.tie_weights()


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
