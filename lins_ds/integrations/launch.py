"""What the engine hands the rest of lins_ds, read from DeepSpeed once (issue 62): the lins block checked against the
launch, the launch's facts for the planner (``LaunchFacts``), the settings every rank must share, the allocator set up
and capped, and the runtime built for the first plan. Only ``integrations/`` reads the engine; everything past these
functions gets records and plans."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .. import comm, dtypes
from ..plan import Plan
from ..plan.layout import needs_unsorted_groups
from ..runtime.config import LinsConfigError, lins_block, parse_lins_config
from ..runtime.memory import memory_guard
from ..runtime.runtime import LinsRuntime
from ..runtime.startup.facts import LaunchFacts
from ..runtime.startup.materialize import agree, is_deferred
from . import zero_api


def validate(config: dict, stage: int, world_size: int, local_world_size: int):
    """Everything that can be wrong with the lins block, checked on every rank before any group exists (pure:
    the launch is given). An engine without an optimizer is a forward-only one (``_configure_forward_only``)."""
    cfg = parse_lins_config(lins_block(config))
    if stage != 0:
        raise LinsConfigError(f"zero_optimization.stage: {stage} with lins enabled; Lins replaces ZeRO, "
                              "keep \"zero_optimization\": {\"stage\": 0}")
    topo = cfg.topology(world_size, local_world_size)
    if not cfg.solve and not comm.SUPPORTS_UNSORTED_GROUPS and needs_unsorted_groups(topo, cfg.layout(topo)):
        raise LinsConfigError(
            f"lins.plan: {cfg.layout(topo)} needs process groups in an order other than global-rank order, "
            f"which needs torch >= 2.13 (new_group(sort_ranks=False)); this is torch {torch.__version__}")
    return cfg, topo


def begin(config: dict, config_class, world_size: int) -> tuple:
    """First thing in the engine, on every rank: the allocator set up (before DeepSpeed moves the model to the
    device), the lins block validated, and DeepSpeed told not to build its CPU optimizer or offload anything itself
    (Lins places the state: ``deepspeed.initialize`` already gave it a config without them,
    ``config.translate_zero_offload``). (config, topology)."""
    memory_guard.setup_allocator()
    cfg, topo = validate(config, config_class.zero_optimization_stage, world_size, comm.local_world_size())
    config_class.zero_config.offload_optimizer = None
    config_class.zero_config.offload_param = None
    return cfg, topo


def prepare_model(kwargs: dict, cfg) -> bool:
    """Before DeepSpeed's engine sees the model: ``from_pretrained`` decided its load on each rank alone, so one way
    for all (``materialize.agree``); a model built without values is placed by the runtime, unit by unit (DeepSpeed
    must not move it). Whether it is such a model (then there is nothing to broadcast either)."""
    model = kwargs.get("model")
    if model is None:
        return False
    agree(model, cfg.init)
    deferred = is_deferred(model)
    if deferred:
        kwargs["dont_change_device"] = True
    return deferred


def _dtypes(engine) -> tuple:
    """(parameter dtype name, gradient accumulation dtype, gradient reduce dtype)."""
    param = "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"
    accum = engine._config.grad_accum_dtype or param  # DeepSpeed: None = the model's dtype
    try:
        accum = dtypes.canonical(accum)
    except ValueError as e:
        raise LinsConfigError(f"data_types.grad_accum_dtype: {e}") from None
    return param, dtypes.TORCH[accum], dtypes.TORCH[engine.lins_config.grad_reduce_dtype or param]


def gemm_dtype(engine, param_dtype: str) -> torch.dtype:
    """The dtype the model's GEMMs run in: DeepSpeed's ``torch_autocast`` dtype where it is on (its parameters may
    stay fp32), else the parameters'."""
    if getattr(engine, "torch_autocast_enabled", lambda: False)():
        return engine.torch_autocast_dtype()
    return dtypes.TORCH[param_dtype]


def facts(engine, optimizer) -> LaunchFacts:
    """What DeepSpeed knows of this launch, for the planner (which never reads the engine)."""
    param, accum, reduce = _dtypes(engine)
    return LaunchFacts(engine.module, optimizer, engine.train_micro_batch_size_per_gpu(),
                       engine.gradient_accumulation_steps(), param, accum, reduce, gemm_dtype(engine, param),
                       torch.device(engine.device), engine.lins_topology, float(engine.gradient_clipping() or 0.0))


def settings(engine) -> dict:
    """What every rank must train with, by the config key a user would fix."""
    param, accum, reduce = _dtypes(engine)
    return {"train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "bf16/fp16 (the parameter dtype)": param, "data_types.grad_accum_dtype": str(accum),
            "lins.grad_reduce_dtype": str(reduce), "gradient_clipping": engine.gradient_clipping()}


def cap_allocator(engine) -> str:
    """The allocator set up and held to lins.gpu_memory_gb less the reserve; the summary's line about it."""
    note = memory_guard.setup_allocator()
    cfg = engine.lins_config
    memory_guard.cap_allocator(cfg.gpu_memory_gb, torch.device(engine.device), cfg.reserved_gb)
    return note


def build_runtime(engine, plan: Plan, param_groups: list, check_collectives: bool = False,
                  forward_only: bool = False) -> LinsRuntime:
    """The runtime of ``plan`` (its ``apply`` at start-up), with DeepSpeed's ZeRO-3 view of the parameters shown
    through it: after this and every later ``apply``."""
    cfg = engine.lins_config
    _, accum, reduce = _dtypes(engine)
    own = cfg.activation_checkpointing is None  # a count the model set itself keeps the model's units
    decides = not forward_only and (cfg.solve or not own)  # Lins decides where it solves or the config sets it
    return LinsRuntime(engine.module, plan, param_groups, accum, reduce, cfg.unit_modules, cfg.overlap_param_sync,
                       device=torch.device(engine.device), check_collectives=check_collectives,
                       ends_window=engine._reduces_this_backward, init=cfg.init, forward_only=forward_only,
                       checkpointing=own if decides else None)


def show_zero_view(engine) -> None:
    """DeepSpeed's ZeRO-3 view of the parameters, set now and after every ``apply`` of the engine's runtime (held by a
    weak reference: the runtime does not keep the engine alive)."""
    ref = weakref.ref(engine)

    def view() -> None:
        target: Optional[object] = ref()
        if target is not None:
            zero_api.attach(target)

    engine.lins.show_through(view)
