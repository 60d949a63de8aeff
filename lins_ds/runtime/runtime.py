"""LinsRuntime: a model's units, process groups and hooks under one plan; the only door into them for the
engine, the optimizer, the checkpoints and users (docs/design.md §4).

Each step of training has one method here and one caller:

    backward starts   begin_backward()     LinsOptimizer.backward_prologue (DeepSpeed calls it per backward)
    backward ends     end_backward()       LinsOptimizer.backward_epilogue
    boundary          finish_gradients()   LinsOptimizer.step: the window's gradients final
    update            (the optimizer, on os_ranges())
    P-sync            sync_parameters()    LinsOptimizer.step (and a checkpoint load, a re-layout)

The forward is the executor's hooks'. ``Progress`` says where training is; only these methods change it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from .. import comm
from ..plan import Plan
from ..plan.layout import is_first_replica
from ..plan.offload import grads_may_leave, hides_behind_forward, params_may_leave
from .startup import init_replay
from .startup.assign import assign_units, build_unit
from .step.executor import Executor, Phase, Progress
from .startup.materialize import Materializer, is_deferred
from .step.offload import HOST_PIECE, HostGrads, HostParams
from .step.unit import ParamState


class LinsRuntime:
    def __init__(self, module: torch.nn.Module, plan: Plan, param_groups: list, accum_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, unit_modules=None, overlap_param_sync: bool = True,
                 device: Optional[torch.device] = None, check_collectives: bool = False,
                 ends_window: Callable[[], bool] = lambda: True, init: str = "eager", forward_only: bool = False):
        """``ends_window()``, asked once as each backward starts: does this backward end an accumulation
        window (the engine knows: its micro-step count, ``no_sync``). ``forward_only``: an engine without an
        optimizer, whose units hold every parameter (frozen ones too) and take no gradient."""
        self.module, self.overlap_param_sync, self._ends_window = module, overlap_param_sync, ends_window
        self._accum_dtype, self._reduce_dtype, self._unit_modules = accum_dtype, reduce_dtype, unit_modules
        self._check_collectives = check_collectives
        self._checks = 0
        self.forward_only = forward_only
        self._group_of = {}
        for gi, group in enumerate(param_groups):
            for p in group["params"]:
                if p.requires_grad or forward_only:  # else frozen parameters stay whole on every rank, outside units
                    self._group_of.setdefault(p, gi)
        # a model built without values (lins_ds.init, the meta device) gets them unit by unit, and the rest whole
        mat = Materializer(module, device, init=init) if is_deferred(module) else None
        self._build(plan, mat, device)
        if mat is not None:
            _materialise_outside_units(module, mat, device)
            init_replay.release()
            # the units' parameters replaced the meta ones: a re-layout finds them by the new objects
            self._group_of = {s.param: s.group for u in self.units for s in u.slots}

    def _build(self, plan: Plan, mat: Optional[Materializer], device: Optional[torch.device]) -> None:
        """Groups first (every rank creates them, in one order), then the units (local: no collective)."""
        self.plan, self.topo, self.layout = plan, plan.topology, plan.layout
        self.groups = comm.Groups(self.topo, self.layout, check_order=self._check_collectives)
        root_params, layer_entries = assign_units(self.module, self._group_of, self._unit_modules)

        def build(name, mods, params, is_root=False):
            return build_unit(name, mods, params, self._group_of, self.topo, self.layout, self.groups,
                              self._accum_dtype, self._reduce_dtype, mat, device, is_root)

        # the plan's last offload_units units with P on the host go there as each is built: the whole model's P is
        # never on the device at once (docs/design.md §13)
        n_units = (1 if root_params else 0) + len(layer_entries)
        first_host_p = _first_offloaded(plan, n_units) if plan.offload_params else n_units
        self.host_params = None

        def placed(unit):
            if len(self.units) >= first_host_p:
                self.host_params = self.host_params or HostParams(unit.device)
                unit.place_params(self.host_params)
            self.units.append(unit)
            return unit

        self.units = []  # read-only: root first, then the layers
        self.reads_pending = False  # some unit's parameters are not yet current for a reader (``before_user_read``)
        root = placed(build("root", [], root_params, is_root=True)) if root_params else None
        for name, mods, params in layer_entries:
            placed(build(name, mods, params))
        layers = self.units[1:] if root is not None else self.units
        self.device = self.units[0].device if self.units else (device or torch.device("cpu"))
        self.progress = Progress()
        self._executor = Executor(self.module, root, layers, self._reduce_dtype, self.progress,
                                  gradients=not self.forward_only)
        self.os_replicas = self.topo.world_size // self.layout.os.size
        self.host_grads = None
        self._slot_of = {s.param: (u, s) for u in self.units for s in u.slots}
        self._outside = [p for p in self.module.parameters() if p not in self._slot_of]
        self._place(plan)
        # one replica of every OS chunk writes it to a checkpoint: the ranks whose replica digits are 0
        self.is_checkpoint_writer = is_first_replica(self.topo, self.layout, self.groups.rank)

    def replan(self, plan: Plan) -> None:
        """``plan`` differs from this one only where the units stay (checkpointing depth, which units keep their
        OS on the host): the same units, groups and hooks; the optimizer moves what changed place."""
        if plan.layout != self.layout or plan.topology != self.topo:
            raise ValueError(f"replan: {plan.layout} on {plan.topology} is another layout; use relayout")
        self.plan = plan
        self._place(plan)

    def _place(self, plan: Plan) -> None:
        """The plan's last ``offload_units`` units keep their OS on the host (forward order: root first), with
        ``offload_grads`` their G accumulators too (``HostGrads``), with ``offload_params`` their P chunks
        (``HostParams``); every other unit's G and P on the device."""
        self.host_units = self.units[_first_offloaded(plan, len(self.units)):]
        grads = self.host_units if plan.offload_grads else []
        params = self.host_units if plan.offload_params else []
        if grads and not grads_may_leave(self.layout, self.topo.world_size):
            raise ValueError(f"lins: plan keeps gradients on the host, which {self.layout} on {self.topo.world_size} "
                             "ranks does not allow (a replica AllReduce follows its ReduceScatter)")
        if params and not params_may_leave(self.layout):
            raise ValueError(f"lins: plan keeps parameters on the host, which {self.layout} does not allow (s_p != "
                             "s_os: a P-sync follows the update)")
        if params and self.host_params is None:
            self.host_params = HostParams(self.device)
        for unit in self.units:
            unit.place_params(self.host_params if unit in params else None)
        self._place_grads(grads)

    def _place_grads(self, grads: list) -> None:
        if self.host_grads is not None and self.host_grads.units() == grads:
            return  # the same units keep their host accumulators
        if self.host_grads is not None:
            self.host_grads.close()
            self.host_grads = None
        self.host_grads = HostGrads(grads, self._accum_dtype, self.device) if grads else None
        for unit in self.units:
            unit.place_grads(self.host_grads if unit in grads else None)

    def relayout(self, plan: Plan) -> None:
        """Drop this plan's units, groups and hooks and build ``plan``'s on the same module (every rank calls
        it; the values come from the caller: ``lins_ds.runtime.switch.relayout.run`` stages and writes them)."""
        self._teardown()
        self._build(plan, None, self.device)

    def _teardown(self) -> None:
        """What a plan holds, gone: hooks, groups, and every unit's buffers (parameters keep their shape, no
        storage). Issues no collective; safe on a half-built runtime."""
        if getattr(self, "_executor", None) is not None:
            self.wait()
            self._executor.remove_hooks()
            self._executor = None
        if not self.groups.destroyed:
            self.groups.destroy()
        for unit in self.units:
            unit.free()
        if self.host_grads is not None:
            self.host_grads.close()
        self.units, self.host_units, self.host_grads, self.host_params = [], [], None, None

    @property
    def destroyed(self) -> bool:
        return self.groups.destroyed

    def layer_modules(self) -> list:
        """Each layer unit's modules, in order (what activation checkpointing applies to)."""
        return [u.modules for u in self._executor.layers]

    def unit_sizes(self) -> list:
        """(padded numel, is_root) per unit, as ``lins_ds.plan.cost.schedule`` takes them."""
        return [(u.spec.padded, u.is_root) for u in self.units]

    # --- the steps of training, one caller each (module docstring) ----------------------------
    def begin_backward(self) -> None:
        self.progress.phase, self.progress.ends_window = Phase.BACKWARD, self._ends_window()
        self.progress.window_done = False
        if self.host_grads is not None:
            self.host_grads.ends_window = self.progress.ends_window
        self._executor.begin_backward()

    def end_backward(self) -> None:
        """Reduce what is left, in order; at a window's end the replica AllReduces are all in flight."""
        self._executor.end_backward()
        self.progress.phase = Phase.FORWARD
        if self.progress.ends_window:  # as under ZeRO-1, .grad is None now: the window's gradient, averaged over
            self.progress.window_done = True  # the ranks, is what ``full_grad`` (safe_get_full_grad) assembles
            for unit in self.units:
                unit.detach_grads()

    def finish_gradients(self) -> None:
        """The boundary: every G chunk all-reduced over its replicas (launched during the last backward where
        possible) and waited for, and no P-sync left in flight (the update writes the P storage)."""
        self.progress.phase = Phase.BOUNDARY
        self._executor.finish_window()
        for unit in self.units:
            unit.wait_param_sync()

    @torch.no_grad()
    def sync_parameters(self, host=None, downloads: Optional[list] = None) -> None:
        """After the update: gather each P chunk from the OS chunks of its P-sync group (asynchronously
        when overlapping; each unit's next use waits for its own gather). ``host`` (a HostUpdater, with the
        ``downloads`` it launched) starts the offloaded units' host updates; where no P-sync follows them and
        overlap is on, they outlive this call and each unit's next use waits for its own (docs/design.md §13);
        else they are waited for here, in unit order, each unit's P-sync launched after its update."""
        held = [u.name for u in self.units if u.held]
        if held:
            raise RuntimeError(f"lins: engine.step() inside deepspeed.zero.GatheredParameters (units {held[:3]} are "
                               "held gathered): leave the context before the step, which rewrites the parameters")
        self.release_all()  # gathered copies are stale now
        if host is not None:
            host.start(downloads)
        lazy = self.overlap_param_sync and hides_behind_forward(self.layout)
        for unit in self.units:
            if unit.param_state is ParamState.UPDATING:
                if lazy:
                    continue
                unit.finish_host_update()
            unit.wait_param_sync()
            unit.start_param_sync(async_op=self.overlap_param_sync)
        self.progress.phase = Phase.FORWARD
        self.progress.window_done = False
        self.reads_pending = any(u.param_state in (ParamState.SYNCING, ParamState.UPDATING) for u in self.units)

    # --- what user code reads (docs/design.md §4: "What user code sees") --------------------------------
    @contextlib.contextmanager
    def running(self):
        """The engine itself runs (forward, backward, step): parameter reads inside are its own."""
        self.progress.busy += 1
        try:
            yield
        finally:
            self.progress.busy -= 1

    def params_current(self) -> None:
        """Every parameter this rank holds current for a reader on this stream: each P-sync in flight waited for, each
        host update still running finished. Issues no collective (a host update outlives ``step()`` only where no
        P-sync follows it), so one rank alone may call it."""
        for unit in self.units:
            unit.wait_param_sync()
        self.reads_pending = False

    def before_user_read(self) -> None:
        """Called where user code reads parameters (a module's ``parameters()``, ``named_parameters()``,
        ``state_dict()``): outside the engine's own forward, backward and step, the updates of the last step are
        made visible first. Inside them nothing waits: each unit's use waits for its own (the overlap is kept)."""
        if self.reads_pending and not self.progress.busy and self.progress.phase is Phase.FORWARD:
            self.params_current()

    def drop_gradients(self) -> None:
        """``zero_grad``: the gradients accumulated so far are dropped, as DeepSpeed drops them (every rank at the same
        point; reductions in flight complete first, none is issued). After ``step()`` there is nothing to drop."""
        if self.progress.phase is Phase.BACKWARD:
            raise RuntimeError("lins: zero_grad() inside a backward")
        self._executor.complete_reductions()
        self.zero_gradients()

    def outside_units(self) -> list:
        """The model's parameters no unit holds (frozen ones), as they were at build."""
        return list(self._outside)

    def hold_params(self, params) -> None:
        """The units holding ``params`` gathered and kept so (every rank, the same params: units in unit order)."""
        for unit in self._units_of(params):
            unit.hold()

    def unhold_params(self, params) -> None:
        for unit in self._units_of(params):
            unit.unhold()

    def _units_of(self, params) -> list:
        mine = {self._slot_of[p][0] for p in params if p in self._slot_of}
        return [u for u in self.units if u in mine]

    def slot_of(self, param) -> tuple:
        """(unit, slot) holding trainable parameter ``param``; KeyError for one outside every unit (frozen)."""
        return self._slot_of[param]

    def zero_gradients(self) -> None:
        self.progress.window_done = False
        if self.host_grads is not None:
            self.host_grads.reset()
        for unit in self.units:
            unit.reset_grads()

    def attach_grads(self) -> None:
        """Every .grad back on its accumulator view, or None (the optimizer's zero_grad)."""
        for unit in self.units:
            unit.attach_grads()

    def check_collectives(self) -> None:
        """With ``lins.check_collectives``: every rank issued the same collectives, in the same order on each
        group, since the last check (called by every rank at each optimizer step); else nothing."""
        if self.groups.issued is not None:
            self._checks += 1
            comm.check_order(self.groups, f"optimizer step {self._checks}")

    # --- what the optimizer and the checkpoints see ----------------------------------------------
    def os_ranges(self, group: int) -> list:
        """This rank's part of param group ``group`` in each unit's OS chunk (``OSRange``), root first; an
        offloaded unit's in pieces of at most ``HOST_PIECE`` elements (host tensors the worker updates one by one)."""
        out = []
        for u in self.units:
            r = u.os_range(group)
            if r is not None:
                out += r.pieces(HOST_PIECE) if u in self.host_units else [r]
        return out

    def os_grads(self) -> list:
        """Each unit's accumulated gradient of this rank's OS chunk (padding included, which stays zero), on the
        device: the units whose G lives on the host are not among them (``host_grad_square_sum``)."""
        return [u.os_grad() for u in self.units if u.host_grads is None]

    def host_grad_square_sum(self) -> float:
        """The squared L2 norm of this rank's host G accumulators for the window (0.0 with none; NaN where the host
        failed, ``host_grad_error``); at the step."""
        return self.host_grads.square_sum() if self.host_grads is not None else 0.0

    def host_grad_error(self) -> str:
        return self.host_grads.error() if self.host_grads is not None else ""

    def param_groups_by_name(self) -> dict:
        """Trainable parameter name -> optimizer param group index."""
        return {s.name: s.group for u in self.units for s in u.slots}

    # --- parameters ----------------------------------------------------------------------------
    def gather_all(self) -> None:
        """Every unit's full parameters current (``state_dict``, evaluation outside forward)."""
        for unit in self.units:
            unit.wait_gather()

    def release_all(self) -> None:
        for unit in self.units:
            unit.release()

    def settle(self) -> None:
        """Every unit's P chunk current (a host update finished, a P-sync completed) and every collective done:
        what a re-layout or a checkpoint reads. The host update's errors are the optimizer's to agree first."""
        for unit in self.units:
            unit.wait_param_sync()
        self.wait()

    def host_param_bytes(self) -> int:
        """Host bytes of the P chunks the plan keeps on the host (0 without)."""
        return sum(u.p_shard.nbytes for u in self.units if u.host_params is not None)

    def wait(self) -> None:
        """Wait for every collective still in flight (P-sync, prefetch, ReduceScatter, AllReduce); issues
        none. After it the parameters, P chunks and OS chunks may be read and written directly."""
        self._executor.complete_in_flight()

    def destroy(self) -> None:
        """Idempotent; issues no collective (it runs from ``atexit`` and ``__del__`` too)."""
        if self.groups.destroyed:
            return
        self.wait()
        self._executor.remove_hooks()
        self.groups.destroy()
        if self.host_grads is not None:
            self.host_grads.close()
        if any(u.releases for u in self.units):  # the module keeps only P chunks (or host copies): refuse to run it
            self.module.register_forward_pre_hook(_sharded_after_destroy)


def _first_offloaded(plan: Plan, n_units: int) -> int:
    """Index of the first of the plan's offloaded units: the last ``offload_units`` in forward order (root first)."""
    return n_units - min(plan.offload_units, n_units)


def _materialise_outside_units(module: torch.nn.Module, mat: Materializer, device: torch.device) -> None:
    """Frozen parameters (whole on every rank) and buffers of a deferred model, on the device."""
    for p in list(module.parameters()):
        if p.is_meta:
            mat.materialise_whole(p)
    mat.materialise_buffers()
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[name] = b.to(device)


def _sharded_after_destroy(module, args):
    raise RuntimeError("lins: this model's parameters stay sharded across ranks after engine.destroy(); "
                       "load them from a checkpoint (or engine.module.state_dict() taken before destroy) "
                       "to use the model again")
