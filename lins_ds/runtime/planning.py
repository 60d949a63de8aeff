"""The plan at engine start-up: fixed in the config, or solved (docs/design.md §7), then agreed by all ranks.

With ``"plan": "solve"`` the timing table is, by ``lins.profile``: ``"measure"`` — the cached measured
table for this launch, or a quick measurement (every rank takes part, every rank gets rank 0's table);
``"synthetic"`` — the built-in cluster ``lins.cluster``; or a profile JSON file. The summary names its source.
"""

from __future__ import annotations

import psutil
import torch
from deepspeed.utils import logger

from .. import comm, dtypes
from ..plan import (MemorySpec, Plan, ProfileTable, Topology, TrainingSpec, candidates, get_cluster, load_model,
                    solve)
from ..plan import cost, report
from ..plan.layout import needs_unsorted_groups
from ..plan.model import from_hf_config
from .config import LinsConfig, LinsConfigError


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
    return psutil.virtual_memory().total / 2**30 / max(1, comm.local_world_size())


def _seq_len(module: torch.nn.Module, cfg: LinsConfig) -> int:
    if cfg.seq_len:
        return cfg.seq_len
    hf = getattr(module, "config", None)
    n = getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", None)
    if not n:
        raise LinsConfigError("lins.seq_len: needed with \"plan\": \"solve\" when the model does not say it")
    return int(n)


def _timing_table(cfg: LinsConfig, topo: Topology, model, train: TrainingSpec, device) -> ProfileTable:
    meshes = cost.required_meshes(topo, candidates(topo))
    if cfg.profile == "synthetic":
        return get_cluster(cfg.cluster).table(meshes)
    if cfg.profile == "measure":
        from ..profiler import obtain

        largest = max(model.unit_params()) * train.param_bytes
        return obtain(topo, meshes, device, quick=True, max_bytes=largest, cache_dir=cfg.profile_cache,
                      log=lambda msg: print(msg, flush=True) if comm.rank() == 0 else None)
    return ProfileTable.load(cfg.profile)


def solve_plan(engine, cfg: LinsConfig, topo: Topology, param_dtype: str, accum_dtype: torch.dtype) -> tuple:
    """(plan, summary) of the fastest plan that fits, for this engine's model, batch and dtypes."""
    module = engine.module
    model = _model_spec(module, cfg)
    ckpt = cfg.activation_checkpointing
    if ckpt is None and not hasattr(module, "gradient_checkpointing_enable"):
        ckpt = False  # we can only switch checkpointing on for models that offer it
    train = TrainingSpec(_seq_len(module, cfg), engine.train_micro_batch_size_per_gpu(),
                         engine.gradient_accumulation_steps(), param_dtype, dtypes.name_of(accum_dtype),
                         cfg.grad_reduce_dtype, activation_checkpointing=ckpt)
    device = next(module.parameters()).device
    table = _timing_table(cfg, topo, model, train, device)
    reserved = cfg.reserved_gb if cfg.reserved_gb is not None else (2.0 if device.type == "cuda" else 0.0)
    layouts = candidates(topo)
    if not comm.SUPPORTS_UNSORTED_GROUPS:  # older torch: only layouts whose groups are in rank order
        layouts = [lay for lay in layouts if not needs_unsorted_groups(topo, lay)]
    sol = solve(model, topo, train, MemorySpec(_memory_gb(cfg, device), reserved), table,
                get_cluster(cfg.cluster).compute(), layouts=layouts, objective=cfg.objective)
    return sol.plan, report.to_table(sol)


def make_plan(engine, cfg: LinsConfig, topo: Topology, param_dtype: str, accum_dtype: torch.dtype) -> tuple:
    """(plan, summary): solved, or the fixed layout of the config."""
    if cfg.solve:
        return solve_plan(engine, cfg, topo, param_dtype, accum_dtype)
    layout = cfg.layout(topo)
    plan = Plan(topo, layout, bool(cfg.activation_checkpointing), param_dtype, dtypes.name_of(accum_dtype),
                model=type(engine.module).__name__, profile_source="fixed in config")
    return plan, f"Lins plan (fixed in config) on {topo.nodes} node(s) x {topo.gpus_per_node}: {layout}"


def agree_on_plan(plan: Plan) -> None:
    """Every rank must execute the same plan: compare digests, fail on every rank if they differ."""
    digests = comm.all_gather_object(plan.digest())
    if len(set(digests)) != 1:
        raise LinsConfigError(f"lins: ranks computed different plans (digests {digests}); "
                              "check that every rank sees the same config, model and profile")


def announce(summary: str) -> None:
    if comm.rank() == 0:
        logger.info("\n" + summary)
        print(summary, flush=True)
