"""LinsEngine: DeepSpeed's engine with ZeRO replaced by a Lins plan (docs/design.md §6), a thin adapter.

Inherited unchanged: forward/backward/step, gradient accumulation bookkeeping, LR schedulers, monitors, timers.
Replaced: the optimizer (``LinsOptimizer`` over this rank's OS chunks), gradient reduction (``allreduce_gradients``),
clipping (done by LinsOptimizer on the true global norm). The engine decides nothing: it reads the launch once
(``launch``), hands DeepSpeed's events to the planner (``self.lins_planner``: the first plan, a training batch, a step
ended), which applies each plan it decides to the runtime (``self.lins``, a LinsRuntime: ``apply`` is the whole
switch). The DeepSpeed internals this class touches are listed in ``ds_compat.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref

import torch
from deepspeed import comm as dist
from deepspeed.runtime.engine import DeepSpeedEngine

from ..runtime.switch.planner import Planner
from . import checkpointing, ds_compat, launch, zero_api
from .optimizer import LinsOptimizer, check_elementwise

ds_compat.check()
validate = launch.validate  # the lins block checked against a launch (tests and tools call it from here)


class LinsEngine(DeepSpeedEngine):
    def __init__(self, *args, config=None, config_class=None, optimizer=None, **kwargs):
        t0 = time.perf_counter()
        cfg, topo = launch.begin(config, config_class, dist.get_world_size())
        object.__setattr__(self, "lins_config", cfg)
        object.__setattr__(self, "lins_topology", topo)
        object.__setattr__(self, "lins", None)  # the runtime: what executes the plan
        object.__setattr__(self, "lins_planner", None)  # what decides every plan (runtime/switch/planner.py)
        object.__setattr__(self, "_lins_deferred", launch.prepare_model(kwargs, cfg))
        super().__init__(*args, config=config, config_class=config_class, optimizer=optimizer, **kwargs)
        if self.lins is None:  # no optimizer: a reference, frozen or inference model
            self._configure_forward_only()
        ds_compat.check_engine_attributes(self)
        self.module.register_state_dict_pre_hook(self._gather_for_state_dict)
        self.module._register_state_dict_hook(self._copy_out_state_dict)
        _LIVE.add(self)
        self.lins_planner.started(self.lins, time.perf_counter() - t0)

    # what the planner decided, as the engine has always shown it (tests, bench/train.py, users' scripts)
    _lins_solve = property(lambda self: self.lins_planner.context if self.lins_planner is not None else None)
    lins_tuner = property(lambda self: self.lins_planner.tuner if self.lins_planner is not None else None)
    lins_tune_report = property(lambda self: self.lins_planner.tune_report if self.lins_planner is not None else None)

    # --- optimizer and plan --------------------------------------------------------------------
    def _configure_optimizer(self, client_optimizer, model_parameters):
        if client_optimizer is None:
            basic = self._configure_basic_optimizer(model_parameters)
        elif isinstance(client_optimizer, torch.optim.Optimizer):
            basic = client_optimizer
        else:
            basic = client_optimizer(model_parameters)
        allocator = launch.cap_allocator(self)
        basic.param_groups[:] = [pg for pg in basic.param_groups if len(pg["params"]) != 0]
        self._check_for_duplicates(basic)
        check_elementwise(basic, self.lins_config.elementwise_optimizer)  # the same verdict on every rank
        self.basic_optimizer = basic
        object.__setattr__(self, "lins_planner", Planner(launch.facts(self, basic), self.lins_config))
        plan, check = self.lins_planner.first(launch.settings(self),
                                              ("\n" + allocator if allocator else "") + ds_compat.clipping_note(self))
        self.lins = launch.build_runtime(self, plan, basic.param_groups, check)
        self.optimizer = LinsOptimizer(basic, self.lins, clip=self.gradient_clipping(), fp16=self.fp16_enabled(),
                                       static_loss_scale=self.loss_scale(),
                                       dynamic_loss_scale=self.dynamic_loss_scale(),
                                       dynamic_loss_args=self.dynamic_loss_scale_args())
        ds_compat.finish_optimizer_setup(self)
        launch.show_zero_view(self)
        self.lins_planner.start_trials(self.lins)

    def _configure_bf16_optimizer(self, optimizer):
        """No optimizer, no bf16 wrapper (and its fp32 copies): a forward-only engine; else DeepSpeed's (never reached
        with one: Lins builds its own optimizer)."""
        return None if optimizer is None else super()._configure_bf16_optimizer(optimizer)

    def _configure_forward_only(self) -> None:
        """An engine without an optimizer (TRL's reference models, frozen or inference models): forward only, every
        parameter in the units of a plan whose P dimension places it (sharded where memory asks); no G, no OS."""
        launch.cap_allocator(self)
        object.__setattr__(self, "lins_planner", Planner(launch.facts(self, None), self.lins_config))
        plan = self.lins_planner.forward_only(launch.settings(self))
        self.lins = launch.build_runtime(self, plan, [{"params": list(self.module.parameters())}], forward_only=True)
        launch.show_zero_view(self)

    def relayout(self, plan):
        """Move training onto ``plan`` in memory, at an accumulation boundary (after ``step()``); every rank calls it.
        A ``RelayoutReport`` (time, extra device peak, host staging); on ``RelayoutError`` every rank is back on the
        running plan (``LinsRuntime.apply``)."""
        return self.lins.apply(plan)

    def step(self, lr_kwargs=None):
        """DeepSpeed's step; then the planner's turn (the memory guard after the second step, the tuner's trials)."""
        before = self.global_steps
        with self._running():
            super().step(lr_kwargs=lr_kwargs)
        if self.lins_planner is not None and self.optimizer is not None:
            self.lins_planner.after_step(before, self.global_steps, self.lins)

    def _broadcast_model(self):
        """DeepSpeed makes every rank start from rank 0's parameters. A model built without values (lins_ds.init,
        the meta device) gets the same values on every rank by construction (seeded per module, or read from one
        checkpoint): there is nothing to broadcast."""
        if not self._lins_deferred:
            super()._broadcast_model()

    def forward(self, *args, **kwargs):
        if self.lins is not None and self.lins.destroyed:
            raise RuntimeError("lins: engine.destroy() was called; build a new engine to train again")
        if self.lins_planner is not None and self.module.training and torch.is_grad_enabled():
            window_start = self.micro_steps % self.gradient_accumulation_steps() == 0
            self.lins_planner.on_batch(args, kwargs, window_start, self.global_steps, self.lins)
        with self._running():
            out = super().forward(*args, **kwargs)
        if self.lins is not None and torch.is_grad_enabled():
            ds_compat.hook_hidden_outputs(self, out)
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
        """DeepSpeed's signature and return value; every rank calls it (``checkpointing.save_checkpoint``)."""
        return checkpointing.save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's signature and return value ``(path, client_state)`` (``checkpointing.load_checkpoint``)."""
        return checkpointing.load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                                             load_lr_scheduler_states, load_module_only, custom_load_fn)

    def destroy(self):
        """DeepSpeed's destroy plus: wait for Lins' in-flight collectives and destroy its process groups.
        Runs at interpreter exit too (scripts rarely call it), before teardown can abort gloo threads."""
        lins = self.__dict__.get("lins")
        if lins is not None:
            lins.destroy()
            zero_api.detach(self)
        super().destroy()


_LIVE = weakref.WeakSet()  # every LinsEngine built in this process and still referenced


def destroy_live_engines() -> None:
    """``destroy()`` every LinsEngine still alive (idempotent, no collective): at interpreter exit, and from
    ``lins_ds.run`` before it destroys the process group the script left open."""
    for engine in list(_LIVE):
        engine.destroy()


atexit.register(destroy_live_engines)
