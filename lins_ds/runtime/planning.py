"""``"plan": "solve"`` at engine start-up: describe the model and training to the planner and solve.

The timing table is, by ``lins.profile``: ``"measure"`` — the cached measured table for this launch,
or a quick measurement (every rank takes part, every rank gets rank 0's table); ``"synthetic"`` —
the built-in cluster ``lins.cluster``; or a profile JSON file. The summary names its source.
"""

from __future__ import annotations

import os

import psutil
import torch

from ..plan import (MemorySpec, ProfileTable, Topology, TrainingSpec, candidates, get_cluster,
                    load_model, solve)
from ..plan import cost, report
from ..plan.model import from_hf_config
from ..plan.layout import needs_unsorted_groups
from . import comm
from .config import LinsConfig, LinsConfigError


def local_world_size() -> int:
    """GPUs per node as the launcher says (torchrun, deepspeed and accelerate set LOCAL_WORLD_SIZE)."""
    for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(var):
            return int(os.environ[var])
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def _model_spec(module: torch.nn.Module, cfg: LinsConfig):
    if cfg.model:
        return load_model(cfg.model)
    hf = getattr(module, "config", None)
    if hf is not None and hasattr(hf, "to_dict"):
        return from_hf_config(hf.to_dict(), type(module).__name__)
    raise LinsConfigError("lins.plan: \"solve\" needs to know the model's shape: set lins.model to a built-in "
                          "name or a config.json path, use a Hugging Face model, or give a fixed plan")


def _memory_gb(cfg: LinsConfig, device: torch.device) -> float:
    if cfg.gpu_memory_gb is not None:
        return cfg.gpu_memory_gb
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return psutil.virtual_memory().total / 2**30 / max(1, local_world_size())


def _seq_len(module: torch.nn.Module, cfg: LinsConfig) -> int:
    if cfg.seq_len:
        return cfg.seq_len
    hf = getattr(module, "config", None)
    n = getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", None)
    if not n:
        raise LinsConfigError("lins.seq_len: needed with \"plan\": \"solve\" when the model does not say it")
    return int(n)


def solve_plan(engine, cfg: LinsConfig, topo: Topology, param_dtype: str, accum_dtype: torch.dtype):
    module = engine.module
    model = _model_spec(module, cfg)
    ckpt = cfg.activation_checkpointing
    if ckpt is None and not hasattr(module, "gradient_checkpointing_enable"):
        ckpt = False  # we can only switch checkpointing on for models that offer it
    accum = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[accum_dtype]
    train = TrainingSpec(_seq_len(module, cfg), engine.train_micro_batch_size_per_gpu(),
                         engine.gradient_accumulation_steps(), param_dtype, accum, cfg.grad_reduce_dtype,
                         activation_checkpointing=ckpt)
    cluster = get_cluster(cfg.cluster)
    meshes = cost.required_meshes(topo, candidates(topo))
    device = next(module.parameters()).device
    if cfg.profile == "synthetic":
        table = cluster.table(meshes)
    elif cfg.profile == "measure":
        from ..profile import obtain

        largest = max(model.unit_params()) * train.param_bytes
        table = obtain(topo, meshes, device, quick=True, max_bytes=largest, cache_dir=cfg.profile_cache,
                       log=lambda msg: print(msg, flush=True) if torch.distributed.get_rank() == 0 else None)
    else:
        table = ProfileTable.load(cfg.profile)
    reserved = cfg.reserved_gb if cfg.reserved_gb is not None else (2.0 if device.type == "cuda" else 0.0)
    layouts = candidates(topo)
    if not comm.SUPPORTS_UNSORTED_GROUPS:  # older torch: only layouts whose groups are in rank order
        layouts = [lay for lay in layouts if not needs_unsorted_groups(topo, lay)]
    sol = solve(model, topo, train, MemorySpec(_memory_gb(cfg, device), reserved), table,
                cluster.compute(), layouts=layouts, objective=cfg.objective)
    plan = sol.plan
    return plan, report.to_table(sol)
