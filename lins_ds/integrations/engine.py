"""LinsEngine: DeepSpeed's engine with ZeRO replaced by a Lins plan (docs/design.md §6).

Inherited unchanged: forward/backward/step, gradient accumulation bookkeeping, LR schedulers,
monitors, timers. Replaced: the optimizer (LinsOptimizer over this rank's OS chunks), gradient
reduction (``allreduce_gradients``), clipping (done by LinsOptimizer on the true global norm).
Everything Lins does to the model goes through ``self.lins`` (a LinsRuntime); the DeepSpeed internals
this class touches are listed in ``ds_compat.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref

import torch
from deepspeed import comm as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.utils import register_output_backward_hooks

from .. import comm, dtypes
from ..checkpoint.load import load
from ..checkpoint.save import save
from ..plan.layout import needs_unsorted_groups
from ..runtime.memory import memory_guard
from ..runtime.step.executor import grad_tensors
from ..runtime.config import LinsConfigError, lins_block, parse_lins_config
from ..runtime.startup.facts import LaunchFacts
from ..runtime.startup.materialize import agree, is_deferred
from ..runtime.step.optimizer import LinsOptimizer, check_elementwise
from ..runtime.startup.planning import announce, misaligned_note
from ..runtime.runtime import LinsRuntime
from ..runtime.startup.seq_len import batch_length
from ..runtime.switch.planner import Planner
from . import ds_compat, zero_api

ds_compat.check()


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


class LinsEngine(DeepSpeedEngine):
    def __init__(self, *args, config=None, config_class=None, optimizer=None, **kwargs):
        t0 = time.perf_counter()
        memory_guard.setup_allocator()  # before DeepSpeed moves the model to the device
        cfg, topo = validate(config, config_class.zero_optimization_stage, dist.get_world_size(),
                             comm.local_world_size())
        object.__setattr__(self, "lins_config", cfg)
        object.__setattr__(self, "lins_topology", topo)
        object.__setattr__(self, "lins", None)
        object.__setattr__(self, "lins_planner", None)  # what decides every plan (runtime/switch/planner.py)
        # DeepSpeed must not build its CPU optimizer or offload anything itself: Lins places the state (its plan;
        # deepspeed.initialize already gave it a config without them, config.translate_zero_offload)
        config_class.zero_config.offload_optimizer = None
        config_class.zero_config.offload_param = None
        if kwargs.get("model") is not None:  # from_pretrained decided its load on each rank alone: one way for all
            agree(kwargs["model"], cfg.init)
        if kwargs.get("model") is not None and is_deferred(kwargs["model"]):
            kwargs["dont_change_device"] = True  # built without values: the runtime places it, unit by unit
        super().__init__(*args, config=config, config_class=config_class, optimizer=optimizer, **kwargs)
        if self.lins is None:  # no optimizer: a reference, frozen or inference model
            self._configure_forward_only()
        ds_compat.check_engine_attributes(self)
        self.module.register_state_dict_pre_hook(self._gather_for_state_dict)
        self.module._register_state_dict_hook(self._copy_out_state_dict)
        _LIVE.add(self)
        memory_guard.report_startup(self.lins, self._lins_solve, time.perf_counter() - t0)

    # what the planner decided, as the engine has always shown it (tests, bench/train.py, users' scripts)
    _lins_solve = property(lambda self: self.lins_planner.context if self.lins_planner is not None else None)
    lins_tuner = property(lambda self: self.lins_planner.tuner if self.lins_planner is not None else None)
    lins_tune_report = property(lambda self: self.lins_planner.tune_report if self.lins_planner is not None else None)

    def _facts(self, optimizer) -> LaunchFacts:
        """What DeepSpeed knows of this launch, for the planner (which never reads the engine)."""
        param, accum, reduce = self._lins_dtypes()
        return LaunchFacts(self.module, optimizer, self.train_micro_batch_size_per_gpu(),
                           self.gradient_accumulation_steps(), param, accum, reduce, gemm_dtype(self, param),
                           torch.device(self.device), self.lins_topology)

    def _lins_dtypes(self) -> tuple:
        """(parameter dtype name, gradient accumulation dtype, gradient reduce dtype)."""
        param = "fp16" if self.fp16_enabled() else "bf16" if self.bfloat16_enabled() else "fp32"
        accum = self._config.grad_accum_dtype or param  # DeepSpeed: None = the model's dtype
        try:
            accum = dtypes.canonical(accum)
        except ValueError as e:
            raise LinsConfigError(f"data_types.grad_accum_dtype: {e}") from None
        return param, dtypes.TORCH[accum], dtypes.TORCH[self.lins_config.grad_reduce_dtype or param]

    # --- optimizer and plan --------------------------------------------------------------------
    def _configure_optimizer(self, client_optimizer, model_parameters):
        if client_optimizer is None:
            basic = self._configure_basic_optimizer(model_parameters)
        elif isinstance(client_optimizer, torch.optim.Optimizer):
            basic = client_optimizer
        else:
            basic = client_optimizer(model_parameters)
        allocator = self._cap_allocator()
        basic.param_groups[:] = [pg for pg in basic.param_groups if len(pg["params"]) != 0]
        self._check_for_duplicates(basic)
        check_elementwise(basic, self.lins_config.elementwise_optimizer)  # the same verdict on every rank
        self.basic_optimizer = basic
        facts = self._facts(basic)
        object.__setattr__(self, "lins_planner", Planner(facts, self.lins_config))
        plan, summary, check = self.lins_planner.first(
            self._settings(), self.lins_config.check_collectives or comm.check_requested())
        notes = ("\n" + allocator if allocator else "") + ds_compat.clipping_note(self)
        announce(summary + notes + misaligned_note(self.module, facts.gemm_dtype))
        accum_dtype, reduce_dtype = facts.accum_dtype, facts.reduce_dtype
        self.lins = LinsRuntime(self.module, plan, basic.param_groups, accum_dtype, reduce_dtype,
                                self.lins_config.unit_modules, self.lins_config.overlap_param_sync,
                                device=torch.device(self.device), check_collectives=check,
                                ends_window=self._reduces_this_backward, init=self.lins_config.init,
                                checkpointing=self._checkpointing())
        self.optimizer = LinsOptimizer(basic, self.lins, clip=self.gradient_clipping(), fp16=self.fp16_enabled(),
                                       static_loss_scale=self.loss_scale(),
                                       dynamic_loss_scale=self.dynamic_loss_scale(),
                                       dynamic_loss_args=self.dynamic_loss_scale_args(),
                                       host_optimizer=self.lins_planner.host_kind)
        ds_compat.finish_optimizer_setup(self)
        self._lins_attach()
        self.lins_planner.start_trials(self.relayout, self.lins.plan)

    def _configure_bf16_optimizer(self, optimizer):
        """No optimizer, no bf16 wrapper (and its fp32 copies): a forward-only engine; else DeepSpeed's (never reached
        with one: Lins builds its own optimizer)."""
        return None if optimizer is None else super()._configure_bf16_optimizer(optimizer)

    def _configure_forward_only(self) -> None:
        """An engine without an optimizer (TRL's reference models, frozen or inference models): forward only, every
        parameter in the units of a plan whose P dimension places it (sharded where memory asks); no G, no OS."""
        self._cap_allocator()
        facts = self._facts(None)
        object.__setattr__(self, "lins_planner", Planner(facts, self.lins_config))
        plan = self.lins_planner.forward_only(self._settings())
        accum_dtype, reduce_dtype = facts.accum_dtype, facts.reduce_dtype
        every = [p for p in self.module.parameters()]
        self.lins = LinsRuntime(self.module, plan, [{"params": every}], accum_dtype, reduce_dtype,
                                self.lins_config.unit_modules, self.lins_config.overlap_param_sync,
                                device=torch.device(self.device), forward_only=True, init=self.lins_config.init)
        self._lins_attach()

    def _settings(self) -> dict:
        """What every rank must train with, by the config key a user would fix."""
        param, accum, reduce = self._lins_dtypes()
        return {"train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu(),
                "gradient_accumulation_steps": self.gradient_accumulation_steps(),
                "bf16/fp16 (the parameter dtype)": param, "data_types.grad_accum_dtype": str(accum),
                "lins.grad_reduce_dtype": str(reduce), "gradient_clipping": self.gradient_clipping()}

    def _cap_allocator(self) -> str:
        """The allocator set up and held to lins.gpu_memory_gb less the reserve; the summary's line about it."""
        note = memory_guard.setup_allocator()
        memory_guard.cap_allocator(self.lins_config.gpu_memory_gb, torch.device(self.device), self.lins_config.reserved_gb)
        return note

    def _lins_attach(self) -> None:
        """What code outside the engine sees of the plan: DeepSpeed's parameter API (``zero_api``), and, where
        parameters are partitioned, generation that keeps every rank in step (transformers' ``generate`` then runs
        with ``synced_gpus``, as under ZeRO-3: a rank that finished keeps joining the others' gathers)."""
        zero_api.attach(self)
        partitioned = self.lins.partitions_params() and dist.get_world_size() > 1
        for m in self.module.modules():  # every one: a PEFT model's generate runs the wrapped model's, whose own
            if partitioned:              # flag transformers reads (as the LayerDrop of its speech encoders)
                m._is_fsdp_managed_module = True  # transformers' test for synced_gpus (ds_compat lists it)
            elif m.__dict__.get("_is_fsdp_managed_module"):
                del m._is_fsdp_managed_module

    def _checkpointing(self):
        """Where Lins decides activation checkpointing (a solved plan, or lins.activation_checkpointing set): whether
        a count the model set itself keeps the model's units; else None (the runtime leaves the modules alone)."""
        own = self.lins_config.activation_checkpointing is None
        return own if self.lins_config.solve or not own else None

    def relayout(self, plan):
        """Move training onto ``plan`` in memory, at an accumulation boundary (after ``step()``); every rank
        calls it. Returns a ``RelayoutReport`` (time, extra device peak, host staging); on ``RelayoutError``
        every rank is back on the running plan."""
        if self.micro_steps % self.gradient_accumulation_steps():
            raise LinsConfigError("relayout: only at an accumulation boundary (after engine.step()), micro-step "
                                  f"{self.micro_steps} is inside a window of {self.gradient_accumulation_steps()}")
        try:
            return self.lins.apply(plan)
        finally:
            self._lins_attach()

    def step(self, lr_kwargs=None):
        """DeepSpeed's step; after the second optimizer step, the memory guard compares the measured peak with
        the plan's prediction (docs/design.md §8): the first window runs its forward and backward before the
        optimizer's state exists, so its peak is below every later one's."""
        before = self.global_steps
        with self._running():
            super().step(lr_kwargs=lr_kwargs)
        if self.lins_planner is not None and self.optimizer is not None:
            self.lins_planner.after_step(before, self.global_steps, self.lins)

    def _broadcast_model(self):
        """DeepSpeed makes every rank start from rank 0's parameters. A model built without values (lins_ds.init,
        the meta device) gets the same values on every rank by construction (seeded per module, or read from one
        checkpoint): there is nothing to broadcast."""
        if not is_deferred(self.module):
            super()._broadcast_model()

    def forward(self, *args, **kwargs):
        if self.lins is not None and self.lins.destroyed:
            raise RuntimeError("lins: engine.destroy() was called; build a new engine to train again")
        planner = self.lins_planner
        if planner is not None and planner.lengths is not None and self.module.training and torch.is_grad_enabled():
            window_start = self.micro_steps % self.gradient_accumulation_steps() == 0
            planner.on_batch(batch_length(args, kwargs, self.train_micro_batch_size_per_gpu()), window_start,
                             self.global_steps, self.lins.plan, self.relayout, self.lins.set_host_optimizer)
        with self._running():
            out = super().forward(*args, **kwargs)
        if self.lins is not None and torch.is_grad_enabled():
            _hook_hidden_outputs(self, out)
        return out

    def backward(self, loss, *args, **kwargs):
        """DeepSpeed's backward, begun by a hook on ``loss``: DeepSpeed's output hook calls the optimizer's
        ``backward_prologue`` once per forward, so a second ``engine.backward`` over the same forward
        (``retain_graph=True`` on the first) would run without it: the root unit released, the window's reductions
        already done. Begun as autograd reaches ``loss`` (not before: DeepSpeed may refuse the call first), every
        backward is one to the runtime, and the gradients of all of them are summed (docs/design.md §4)."""
        with self._running():
            begin = None
            if isinstance(self.optimizer, LinsOptimizer) and torch.is_tensor(loss) and loss.requires_grad:
                begin = loss.register_hook(self._begin_backward)
            try:
                return super().backward(loss, *args, **kwargs)
            finally:
                if begin is not None:
                    begin.remove()

    def _begin_backward(self, grad):
        self.optimizer.backward_prologue()  # after DeepSpeed's output hook's, where that fires: no gradient yet, a no-op
        return grad

    def _running(self):
        """The engine runs: parameter reads inside are its own (docs/design.md §4, "What user code sees")."""
        return self.lins.running() if self.lins is not None else contextlib.nullcontext()

    def zero_grad(self):
        """DeepSpeed's ``zero_grad`` drops the gradients accumulated so far; Lins keeps them in its accumulators, so
        those are dropped (inside an accumulation window; after ``step()`` nothing is left to drop). Frozen and other
        parameters outside the plan's units lose their ``.grad`` as under DeepSpeed."""
        if self.lins is not None and not self.lins.destroyed:
            self.lins.drop_gradients()
        for p in self.lins.outside_units() if self.lins is not None else self.module.parameters():
            p.grad = None

    # --- gradient flow ------------------------------------------------------------------------
    def _reduces_this_backward(self) -> bool:
        """Whether this backward ends an accumulation window (its replica AllReduce starts during it)."""
        return self.is_gradient_accumulation_boundary() and not self.inside_no_sync_ctxt

    def get_global_grad_norm(self) -> float:
        """The last step's global gradient norm (kept on the device until asked for)."""
        norm = self._global_grad_norm
        return norm.item() if torch.is_tensor(norm) else norm

    def allreduce_gradients(self, bucket_size=None):
        """Nothing: Lins reduces inside the backward, completes it in the optimizer's ``backward_epilogue``
        (which DeepSpeed calls right after this, inside ``no_sync`` too) and makes the window final in the
        optimizer's ``step`` (docs/design.md §4)."""

    def clip_fp32_gradients(self):
        """No-op: LinsOptimizer clips on the global norm of the sharded gradients."""

    # --- full state dict on every rank ------------------------------------------------------------
    def _gather_for_state_dict(self, module, prefix, keep_vars):
        """The runtime's own hook has gathered every unit (``Executor._before_state_dict``: where the plan partitions P,
        once every rank of the P group is there, else ``ArrivalError`` on each within ``LINS_ARRIVE_TIMEOUT_S``). After
        ``destroy()`` that hook is gone: the gather then says that the sharded parameters are."""
        if self.lins is not None and self.lins.destroyed:
            self.lins.gather_all()

    def _copy_out_state_dict(self, module, state_dict, prefix, local_metadata):
        if self.lins is None or not self.lins.releases_params():  # views of buffers a release frees
            return state_dict
        for k, v in state_dict.items():
            if isinstance(v, torch.Tensor):
                state_dict[k] = v.detach().clone()
        self.lins.release_all()
        return state_dict

    # --- checkpoints (layout-independent; see lins_ds.checkpoint) -----------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False):
        """DeepSpeed's signature and return value; every rank must call it. Each rank of one OS replica
        writes its own chunk; the tag directory appears only once complete, then ``latest``."""
        self._require_optimizer("save_checkpoint")
        comm.all_ranks_arrive(comm.Arrival.SAVE, "call it on every rank (each writes its own part: accelerate's "
                              "save_state and the Trainer do); for the weights alone on one rank, take "
                              "engine.module.state_dict() on every rank and write it on that one")
        return save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's signature and return value ``(path, client_state)``; loads into this engine's plan
        and world size whatever plan and world size wrote the checkpoint."""
        self._require_optimizer("load_checkpoint")
        comm.all_ranks_arrive(comm.Arrival.LOAD, "call it on every rank (each reads its own part)")
        if custom_load_fn is not None:
            raise LinsConfigError("load_checkpoint: custom_load_fn is not supported by LinsEngine")
        return load(self, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                    load_module_only, trust_pickle=self.lins_config.checkpoint_pickle)

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise LinsConfigError(f"lins: {what} of an engine without an optimizer (forward only); its parameters are "
                                  "engine.module.state_dict() (every rank), or load them into the model before "
                                  "deepspeed.initialize")

    def destroy(self):
        """DeepSpeed's destroy plus: wait for Lins' in-flight collectives and destroy its process groups.
        Runs at interpreter exit too (scripts rarely call it), before teardown can abort gloo threads."""
        lins = self.__dict__.get("lins")
        if lins is not None:
            lins.destroy()
            zero_api.detach(self)
        super().destroy()


def gemm_dtype(engine, param_dtype: str) -> torch.dtype:
    """The dtype the model's GEMMs run in: DeepSpeed's ``torch_autocast`` dtype where it is on (its parameters may
    stay fp32), else the parameters'."""
    if getattr(engine, "torch_autocast_enabled", lambda: False)():
        return engine.torch_autocast_dtype()
    return dtypes.TORCH[param_dtype]


def _visible_to_deepspeed(out) -> bool:
    """Whether DeepSpeed's forward found a tensor to hook in ``out``: it walks tensors, tuples, lists and dicts
    only (``deepspeed.runtime.utils.OutputBackwardHookManager``)."""
    if isinstance(out, torch.Tensor):
        return out.grad_fn is not None
    if isinstance(out, (tuple, list)):
        return any(_visible_to_deepspeed(v) for v in out)
    if isinstance(out, dict):
        return any(_visible_to_deepspeed(v) for v in out.values())
    return False


def _hook_hidden_outputs(engine: "LinsEngine", out) -> None:
    """A forward that returns its loss inside another object (a ``SimpleNamespace``, a plain dataclass): DeepSpeed
    hooks none of it, so no backward would tell the optimizer it starts (``backward_prologue``) and no gradient
    would be averaged over the accumulation steps. The same hooks go on the tensors inside it."""
    if _visible_to_deepspeed(out):
        return
    hidden = [t for t in grad_tensors(out) if t.grad_fn is not None]
    if hidden:
        register_output_backward_hooks(hidden, preprocess_once_fn=engine._backward_prologue,
                                       preprocess_per_tensor_fn=engine._backward_prologue_per_tensor)


_LIVE = weakref.WeakSet()  # every LinsEngine built in this process and still referenced


def destroy_live_engines() -> None:
    """``destroy()`` every LinsEngine still alive (idempotent, no collective): at interpreter exit, and from
    ``lins_ds.run`` before it destroys the process group the script left open."""
    for engine in list(_LIVE):
        engine.destroy()


atexit.register(destroy_live_engines)
