"""LinsEngine: DeepSpeed's engine with ZeRO replaced by a Lins plan (DESIGN §6).

Inherited unchanged: forward/backward/step, gradient accumulation bookkeeping, LR schedulers,
monitors, timers. Replaced: the optimizer (LinsOptimizer over this rank's OS chunks), gradient
reduction (``allreduce_gradients``), clipping (done by LinsOptimizer on the true global norm).
"""

from __future__ import annotations

import atexit
import weakref

import torch
from deepspeed import comm as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import logger

from ..plan import Plan
from ..plan.layout import needs_unsorted_groups
from . import comm
from .config import LinsConfigError, lins_block, parse_lins_config
from .optimizer import LinsOptimizer
from .planning import local_world_size, solve_plan
from .runtime import LinsRuntime

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16",
                 "fp16": "fp16", "float16": "fp16", "half": "fp16"}


def validate(config: dict, config_class, has_client_optimizer: bool):
    """Everything that can be wrong with the lins block, checked on every rank before any group exists."""
    cfg = parse_lins_config(lins_block(config))
    stage = config_class.zero_optimization_stage
    if stage != 0:
        raise LinsConfigError(f"zero_optimization.stage: {stage} with lins enabled; Lins replaces ZeRO, "
                              "keep \"zero_optimization\": {\"stage\": 0}")
    if not has_client_optimizer and not config.get("optimizer"):
        raise LinsConfigError("lins: needs an optimizer (an \"optimizer\" block or a client optimizer)")
    topo = cfg.topology(dist.get_world_size(), local_world_size())
    if not cfg.solve and not comm.SUPPORTS_UNSORTED_GROUPS and needs_unsorted_groups(topo, cfg.layout(topo)):
        raise LinsConfigError(
            f"lins.plan: {cfg.layout(topo)} needs process groups in an order other than global-rank order, "
            f"which needs torch >= 2.13 (new_group(sort_ranks=False)); this is torch {torch.__version__}")
    return cfg, topo


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPE.items()}[dtype]


class LinsEngine(DeepSpeedEngine):
    def __init__(self, *args, config=None, config_class=None, optimizer=None, **kwargs):
        cfg, topo = validate(config, config_class, optimizer is not None)
        object.__setattr__(self, "lins_config", cfg)
        object.__setattr__(self, "lins_topology", topo)
        object.__setattr__(self, "lins", None)
        super().__init__(*args, config=config, config_class=config_class, optimizer=optimizer, **kwargs)
        self.module.register_state_dict_pre_hook(self._gather_for_state_dict)
        self.module._register_state_dict_hook(self._copy_out_state_dict)
        atexit.register(_destroy_at_exit, weakref.ref(self))

    # --- dtypes -----------------------------------------------------------------------------
    def _lins_dtypes(self):
        """(parameter dtype name, gradient accumulation dtype, gradient reduce dtype)."""
        param = "fp16" if self.fp16_enabled() else "bf16" if self.bfloat16_enabled() else "fp32"
        accum = str(self._config.grad_accum_dtype or param).lower().split(".")[-1]  # DeepSpeed: None = model dtype
        if accum not in DTYPE_ALIASES:
            raise LinsConfigError(f"data_types.grad_accum_dtype: {accum!r} is not one of fp32, bf16, fp16")
        reduce = self.lins_config.grad_reduce_dtype or param
        return param, DTYPE[DTYPE_ALIASES[accum]], DTYPE[reduce]

    # --- optimizer and plan --------------------------------------------------------------------
    def _configure_optimizer(self, client_optimizer, model_parameters):
        if client_optimizer is None:
            basic = self._configure_basic_optimizer(model_parameters)
        elif isinstance(client_optimizer, torch.optim.Optimizer):
            basic = client_optimizer
        else:
            basic = client_optimizer(model_parameters)
        basic.param_groups[:] = [pg for pg in basic.param_groups if len(pg["params"]) != 0]
        self._check_for_duplicates(basic)
        self.basic_optimizer = basic
        param_dtype, accum_dtype, reduce_dtype = self._lins_dtypes()
        plan = self._make_plan(param_dtype, accum_dtype)
        self.lins = LinsRuntime(self.module, plan, basic.param_groups, accum_dtype, reduce_dtype,
                                self.lins_config.unit_modules, self.lins_config.overlap_param_sync)
        self.optimizer = LinsOptimizer(basic, self.lins, clip=self.gradient_clipping(), fp16=self.fp16_enabled(),
                                       static_loss_scale=self.loss_scale(),
                                       dynamic_loss_scale=self.dynamic_loss_scale(),
                                       dynamic_loss_args=self.dynamic_loss_scale_args())
        self.compression_scheduler = self._configure_compression_scheduler()
        self.quantizer = self._configure_quantization()

    def _make_plan(self, param_dtype: str, accum_dtype: torch.dtype) -> Plan:
        cfg, topo = self.lins_config, self.lins_topology
        ckpt = cfg.activation_checkpointing
        if cfg.solve:
            plan, summary = solve_plan(self, cfg, topo, param_dtype, accum_dtype)
        else:
            layout = cfg.layout(topo)
            plan = Plan(topo, layout, bool(ckpt), param_dtype, _dtype_name(accum_dtype),
                        model=type(self.module).__name__, profile_source="fixed in config")
            summary = f"Lins plan (fixed in config) on {topo.nodes} node(s) x {topo.gpus_per_node}: {layout}"
        digests = comm.all_gather_object_world(plan.digest())
        if len(set(digests)) != 1:
            raise LinsConfigError(f"lins: ranks computed different plans (digests {digests}); "
                                  "check that every rank sees the same config, model and profile")
        if plan.activation_checkpointing and hasattr(self.module, "gradient_checkpointing_enable"):
            self.module.gradient_checkpointing_enable()
        if dist.get_rank() == 0:
            logger.info("\n" + summary)
            print(summary, flush=True)
        return plan

    def forward(self, *args, **kwargs):
        if self.lins is not None and self.lins.groups.destroyed:
            raise RuntimeError("lins: engine.destroy() was called; build a new engine to train again")
        return super().forward(*args, **kwargs)

    # --- gradient flow ------------------------------------------------------------------------
    def _backward_prologue(self):
        # the replica AllReduce of the boundary micro-batch starts during its backward
        self.lins.executor.boundary = self.is_gradient_accumulation_boundary() and not self.inside_no_sync_ctxt
        super()._backward_prologue()

    def get_global_grad_norm(self) -> float:
        """The last step's global gradient norm (kept on the device until asked for)."""
        norm = self._global_grad_norm
        return norm.item() if torch.is_tensor(norm) else norm

    def _backward_epilogue(self):
        self.lins.post_backward()
        super()._backward_epilogue()

    def allreduce_gradients(self, bucket_size=None):
        if self.is_gradient_accumulation_boundary():
            self.lins.reduce_at_boundary()

    def clip_fp32_gradients(self):
        """No-op: LinsOptimizer clips on the global norm of the sharded gradients."""

    # --- full state dict on every rank ------------------------------------------------------------
    def _gather_for_state_dict(self, module, prefix, keep_vars):
        if self.lins is not None:
            for unit in self.lins.units:
                self.lins.executor.gather(unit)

    def _copy_out_state_dict(self, module, state_dict, prefix, local_metadata):
        if self.lins is None or not self.lins.layout.p.size > 1:
            return state_dict
        for k, v in state_dict.items():
            if isinstance(v, torch.Tensor):
                state_dict[k] = v.detach().clone()
        self.lins.executor.release_all()
        return state_dict

    # --- checkpoints (layout-independent; see lins_ds.checkpoint) -----------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False):
        """DeepSpeed's signature and return value; every rank must call it. Each rank of one OS replica
        writes its own chunk; the tag directory appears only once complete, then ``latest``."""
        from ..checkpoint.save import save

        return save(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's signature and return value ``(path, client_state)``; loads into this engine's plan
        and world size whatever plan and world size wrote the checkpoint."""
        from ..checkpoint.load import load

        if custom_load_fn is not None:
            raise LinsConfigError("load_checkpoint: custom_load_fn is not supported by LinsEngine")
        return load(self, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                    load_module_only)

    def destroy(self):
        """DeepSpeed's destroy plus: wait for Lins' in-flight collectives and destroy its process groups.
        Runs at interpreter exit too (scripts rarely call it), before teardown can abort gloo threads."""
        lins = self.__dict__.get("lins")
        if lins is not None:
            lins.destroy()
        super().destroy()


def _destroy_at_exit(ref) -> None:
    engine = ref()
    if engine is not None:
        engine.destroy()
