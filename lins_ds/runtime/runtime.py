"""LinsRuntime: everything of one plan — a model's units, process groups and hooks, this rank's master slices
(``Masters``) and the host side of offload (``HostOffload``) — and the only door into them for the engine, the
optimizer adapter, the checkpoints and users (docs/design.md §4). ``apply(plan)`` is the one way a plan takes effect:
at start-up, and at an accumulation boundary for a re-sized, re-laid or tuned plan (§14).

Each step of training has one method here and one caller:

    backward starts   begin_backward()     LinsOptimizer.backward_prologue (DeepSpeed calls it per backward)
    backward ends     end_backward()       LinsOptimizer.backward_epilogue
    boundary          finish_gradients()   LinsOptimizer.step: the window's gradients final (and check_host())
    norm              grad_norm()          LinsOptimizer.step
    update + P-sync   update(coef)         LinsOptimizer.step: host updates started, device masters updated, P-synced

The forward is the executor's hooks'. ``Progress`` says where training is; only these methods change it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Optional

import torch

from .. import comm
from ..plan import Layout, Plan, Topology
from ..plan.layout import is_first_replica
from ..plan.offload import hides_behind_forward, refusal
from ..plan.tune import label
from .errors import RelayoutError
from .full_values import FullValues
from .startup import init_replay
from .startup.assign import assign_units, build_unit
from .step import recompute, staging, tiling
from .step.executor import Executor, Phase, Progress
from .startup.materialize import Materializer, is_deferred
from .step.masters import Masters
from .step.offload import HostOffload
from .step.unit import OSRange, ParamState, Slot


class Zero3Param(NamedTuple):
    """One trainable parameter as ZeRO-3's API on it shows it (``LinsRuntime.zero3_params``)."""

    param: torch.nn.Parameter
    shape: torch.Size  # in the model, also while released
    numel: int
    released: bool  # whether its unit releases it outside a use (P sharded, or on the host)


@dataclass
class RelayoutReport:
    seconds: float
    extra_peak_gb: float  # the device's peak during the move above what the old or the new plan holds (0 on CPUs)
    staged_gb: float  # host memory the staging took on this rank


def runs_differently(a: Plan, b: Plan) -> bool:
    """Whether two plans execute differently (not only in what they predict)."""
    def key(p):
        return (p.topology, p.layout, p.activation_checkpointing_units, p.placement, p.host_optimizer, p.mlp_tiles,
                p.logits_tiles, p.activation_offload_units)
    return key(a) != key(b)


class LinsRuntime(FullValues):
    def __init__(self, module: torch.nn.Module, plan: Plan, param_groups: list, accum_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, unit_modules=None, overlap_param_sync: bool = True,
                 device: Optional[torch.device] = None, check_collectives: bool = False,
                 ends_window: Callable[[], bool] = lambda: True, init: str = "eager", forward_only: bool = False,
                 checkpointing: Optional[bool] = None):
        """``ends_window()``, asked once as each backward starts: does this backward end an accumulation
        window (the engine knows: its micro-step count, ``no_sync``). ``forward_only``: an engine without an
        optimizer, whose units hold every parameter (frozen ones too) and take no gradient. ``checkpointing``: where
        Lins decides activation checkpointing (a solved plan, or lins.activation_checkpointing set), whether a count
        the model set itself keeps the model's own units (``recompute.apply``'s ``keep_own``); None: the modules are
        left as the model has them. Every plan applied then sets its checkpointing on the layer modules."""
        self._module, self._overlap_param_sync, self._ends_window = module, overlap_param_sync, ends_window
        self._accum_dtype, self._reduce_dtype, self._unit_modules = accum_dtype, reduce_dtype, unit_modules
        self._check_collectives = check_collectives
        self._checkpointing = checkpointing
        self._act_offload = None  # the checkpointed layers' inputs on the host (its pool outlives a plan without)
        self._checks = 0
        self._forward_only = forward_only
        self._group_of = {}
        for gi, group in enumerate(param_groups):
            for p in group["params"]:
                if p.requires_grad or forward_only:  # else frozen parameters stay whole on every rank, outside units
                    self._group_of.setdefault(p, gi)
        self._plan: Optional[Plan] = None
        self._masters: Optional[Masters] = None  # this rank's master slices, once an optimizer is attached
        self._basic = None
        self._views: list = []  # what shows the running plan to code outside (``show_through``)
        # a model built without values (lins_ds.init, the meta device) gets them unit by unit, and the rest whole
        self._start = (Materializer(module, device, init=init) if is_deferred(module) else None, device)
        self.apply(plan)

    # --- what others read of the running plan: read-only, since only ``apply`` changes it --------------------------
    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def topo(self) -> Topology:
        return self._topo

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def device(self) -> torch.device:
        """Where the units' buffers live (the first unit's device; the constructor's where no unit was built)."""
        return self._device

    @property
    def is_checkpoint_writer(self) -> bool:
        """Whether this rank writes its OS chunks to a checkpoint (the first replica of each)."""
        return self._is_checkpoint_writer

    @property
    def forward_only(self) -> bool:
        return self._forward_only

    def _first(self, plan: Plan) -> None:
        """Start-up: the first plan built, a deferred model's values made as its units are."""
        mat, device = self._start
        self._build(plan, mat, device)
        if mat is not None:
            _materialise_outside_units(self._module, mat, device)
            init_replay.release()
            # the units' parameters replaced the meta ones: a re-layout finds them by the new objects
            self._group_of = {s.param: s.group for u in self._units for s in u.slots}
        self._start = None
        self._set_recompute(plan)

    def _set_recompute(self, plan: Plan) -> None:
        """What the plan recomputes in the backward: its activation checkpointing on the layer modules, where Lins
        decides it (``checkpointing``), with the first ``activation_offload_units`` checkpointed layers' inputs held on
        the host (where the model checkpoints by itself, its own units), and its sequence tiling of the model's MLPs
        and logits (``step/tiling.py``; taken off where the plan has none)."""
        k, offloaded = plan.activation_checkpointing_units, plan.activation_offload_units
        if self._checkpointing is not None or offloaded or self._act_offload is not None:
            keep_own = self._checkpointing if self._checkpointing is not None else True
            layers = self.layer_modules()
            first = recompute.checkpointed(layers, k, keep_own)[:offloaded]
            in_use = recompute.apply(layers, k, keep_own=keep_own, offload_layers=first, offload=self._act_offload)
            self._act_offload = in_use or self._act_offload
            if in_use is None and self._act_offload is not None:
                self._act_offload.trim()  # no plan of this length holds inputs there now
        if plan.mlp_tiles > 1 or plan.logits_tiles > 1:
            tiling.apply_tiling(self._module, plan.mlp_tiles, plan.logits_tiles)
        else:
            tiling.remove_tiling(self._module)

    def _build(self, plan: Plan, mat: Optional[Materializer], device: Optional[torch.device]) -> None:
        """Groups first (every rank creates them, in one order), then the units (local: no collective)."""
        self._plan, self._topo, self._layout = plan, plan.topology, plan.layout
        self._groups = comm.Groups(self._topo, self._layout, check_order=self._check_collectives)
        root_params, layer_entries = assign_units(self._module, self._group_of, self._unit_modules)
        self._host = HostOffload(device, self._accum_dtype)

        def build(name, mods, params, is_root=False):
            return build_unit(name, mods, params, self._group_of, self._topo, self._layout, self._groups,
                              self._accum_dtype, self._reduce_dtype, mat, device, is_root)

        # the plan's offloaded units with P off the device go there as each is built: the whole model's P is never
        # on the device at once (docs/design.md §13)
        n_units, place = (1 if root_params else 0) + len(layer_entries), plan.placement
        first_host_p = place.first(n_units) if place.offloads("p") else n_units

        def placed(unit):
            if len(self._units) >= first_host_p:
                unit.place_params(self._host.params_pool(unit.device, place.p))
            self._units.append(unit)
            return unit

        self._units = []  # root first, then the layers
        self._reads_pending = False  # some unit's parameters are not yet current for a reader (``before_user_read``)
        root = placed(build("root", [], root_params, is_root=True)) if root_params else None
        for name, mods, params in layer_entries:
            placed(build(name, mods, params))
        layers = self._units[1:] if root is not None else self._units
        self._device = self._units[0].device if self._units else (device or torch.device("cpu"))
        self._host.device = self._device
        self._progress = Progress()
        self._executor = Executor(self._module, root, layers, self._reduce_dtype, self._progress,
                                  gradients=not self._forward_only, on_final=lambda unit: self._host.final(unit),
                                  before_forward=lambda: self.refuse_ahead("a forward"))
        self._os_replicas = self._topo.world_size // self._layout.os.size
        self._slot_of = {s.param: (u, s) for u in self._units for s in u.slots}
        self._outside = [p for p in self._module.parameters() if p not in self._slot_of]
        self._place(plan)
        # one replica of every OS chunk writes it to a checkpoint: the ranks whose replica digits are 0
        self._is_checkpoint_writer = is_first_replica(self._topo, self._layout, self._groups.rank)

    def _place(self, plan: Plan) -> None:
        """The plan's ``placement``: its last ``n_units`` units (forward order: root first) keep their OS in the tier it
        names, and their G accumulators (``HostGrads``) and P chunks (``HostParams``) where it names a tier for them,
        each in that tier's storage (``HostOffload.tier``); every other unit's G and P on the device."""
        self._plan, place = plan, plan.placement
        self._host_units = self._units[place.first(len(self._units)):]
        grads = self._host_units if place.offloads("g") else []
        params = self._host_units if place.offloads("p") else []
        why = refusal(place, self._layout, self._topo.world_size)
        if why:
            raise ValueError(f"lins: {why}")
        for unit in self._units:
            unit.place_params(self._host.params_pool(self._device, place.p) if unit in params else None)
        host_grads = self._host.place_grads(grads, place.g)
        for unit in self._units:
            unit.place_grads(host_grads.slot(unit) if unit in grads else None)

    # --- the optimizer's state: this rank's master slices (docs/design.md §3 step 4) ----------------------------
    def attach_optimizer(self, basic) -> None:
        """``basic`` (the client's element-wise optimizer) now steps this rank's master slices of every unit's OS
        chunk; the plan's ``host_optimizer`` ("torch" or "deepspeed") updates those it keeps on the host."""
        self._basic = basic
        self._make_masters()

    def _make_masters(self) -> None:
        self._masters = Masters(self._basic, self._units, self._host_units, self._os_tier())
        self._place_updater()

    def _os_tier(self):
        """The storage of the tier the plan keeps its offloaded units' OS in (None: every OS on the device)."""
        place = self._plan.placement
        return self._host.tier(place.os, self._device) if place.offloads("os") else None

    def _place_updater(self) -> None:
        on_host = self._masters.on_host() if self._masters else []
        self._host.place_updater(self._basic, self._plan.host_optimizer, on_host, self._plan.placement.os)

    def master_slices(self) -> list:
        """This rank's master slices (``MasterSlice``: ``param``, ``range`` with ``by_parameter()``, ``on_host``,
        ``write_back()``), group-major, units in order: what a checkpoint saves and loads."""
        return list(self._masters.slices) if self._masters is not None else []

    def join_host(self, replacing: bool = False) -> None:
        """This rank's host updates done (no collective): what a read of the host masters needs. ``replacing``: a
        checkpoint load is about to replace the masters: updates begun inside a last backward that no step took are
        abandoned (``abandon_ahead``) rather than refused."""
        if replacing:
            self.abandon_ahead()
        self.refuse_ahead("reading or writing a parameter's master or optimizer state")
        self._host.join()

    def abandon_ahead(self) -> None:
        """Updates begun inside a last backward that no step will take (a checkpoint load replaces the masters; the
        engine is destroyed): the worker ended and every unit it held at rest, without a P-sync (whatever comes
        next rewrites the P chunks or drops them). Nothing where none began."""
        if not self._host.ahead:
            return
        self._host.abandon()
        for unit in self._host_units:
            if unit.param_state is ParamState.UPDATING:
                unit.finish_host_update()

    def forget_host_failure(self) -> None:
        """A checkpoint load replaces what a failed host update left: training may go on."""
        self._host.forget()

    # --- the one way a plan takes effect (docs/design.md §14) ---------------------------------------------------
    def apply(self, plan: Plan) -> Optional[RelayoutReport]:
        """Make ``plan`` the running plan: the whole switch, the same at start-up and later. At start-up: build it. Later
        every rank calls it at an accumulation boundary (after ``step()``; inside a window it refuses, before any
        collective): a plan that runs the same (only its predictions differ) replaces the old at once; under the
        same layout only the units whose OS, G or P change place move, one at a time; another layout is staged,
        rebuilt and filled (``step/staging.py``). Either way the plan's activation checkpointing is set on the modules
        and its sequence tiling (``_set_recompute``), its host optimizer updates the units it keeps on the host, and the views of the plan
        shown to code outside (``show_through``: DeepSpeed's ZeRO-3 API) are set again. A failure on any rank is every
        rank's: each goes back to the running plan, its state intact, and raises ``RelayoutError``."""
        if self._plan is None:
            self._first(plan)
            return None
        if self._progress.pending:
            raise RelayoutError("relayout: only at an accumulation boundary (after engine.step()): this window holds "
                                "gradients of a backward that no step has applied yet")
        if plan.topology != self._topo:
            raise RelayoutError(f"relayout: plan for {plan.topology}, this run is {self._topo}")
        try:
            return self._relayout(plan)
        finally:
            self._show()

    def show_through(self, view: Callable[[], None]) -> None:
        """``view()`` shows the running plan to code outside the runtime (``integrations.zero_api``: DeepSpeed's ZeRO-3
        attributes on each parameter, which depend on whether its unit releases it): called now and after every
        ``apply``, its failures included (the units may be new objects either way)."""
        self._views.append(view)
        view()

    def _show(self) -> None:
        for view in self._views:
            view()

    def zero3_params(self) -> Iterator[Zero3Param]:
        """Each trainable parameter, units in order (root first) and each unit's in its buffer's order, with what
        ZeRO-3's attributes say of it (``integrations.zero_api``): its shape and numel in the model, and whether its
        unit releases it (outside a use an empty tensor, as ZeRO-3's partitioned parameters are)."""
        for unit in self._units:
            for slot in unit.slots:
                yield Zero3Param(slot.param, slot.shape, slot.numel, unit.releases)

    def show_zero3_status(self, available, not_available) -> None:
        """From now on each parameter of a unit that releases its parameters says ``available`` in ``ds_status`` while
        gathered and ``not_available`` while released; a unit that keeps its parameters writes none (they are always
        available). The values are DeepSpeed's ``ZeroParamStatus``, handed in: the runtime does not import DeepSpeed."""
        for unit in self._units:
            unit.show_status((available, not_available) if unit.releases else None)

    def _relayout(self, plan: Plan) -> RelayoutReport:
        digests = comm.all_gather_object(plan.digest())
        if len(set(digests)) != 1:
            raise RelayoutError(f"relayout: ranks were given different plans (digests {digests})")
        if not runs_differently(plan, self._plan):
            self._plan = plan  # this plan's predictions, the same execution: nothing moves
            return RelayoutReport(0.0, 0.0, 0.0)
        t0, dev = time.perf_counter(), self._device
        base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        self.check_host()
        self.settle()
        old = self._plan
        if plan.layout == old.layout:
            self._switch(self._move, plan, old)
            return _report(dev, t0, base, 0)
        new_state, old_state = staging.stage(self._units, self._masters, self._topo, self._groups.rank, self._device,
                                             [plan.layout, old.layout])
        self._switch(lambda p: self._rebuild(p, new_state if p is plan else old_state), plan, old)
        self.sync_parameters()
        self.wait()
        return _report(dev, t0, base, staging.nbytes(new_state, old_state))

    def _switch(self, build: Callable, plan: Plan, old: Plan) -> None:
        """``build(plan)`` on every rank; where it failed on any, ``build(old)`` on every rank and ``RelayoutError``."""
        error = comm.agree(_try(lambda: build(plan)))
        if error is None:
            return
        again = comm.agree(_try(lambda: build(old)))
        if again is not None:
            raise RuntimeError(f"relayout: could not go back to the running plan either ({again}); this rank's "
                               "state may be lost: resume from the last checkpoint") from None
        if plan.layout != old.layout:
            self.sync_parameters()
        raise RelayoutError(f"relayout to {_describe(plan)} failed on a rank ({error}); back on {_describe(old)}")

    def _move(self, plan: Plan) -> None:
        """The same layout: units, groups and hooks stay; the units whose OS changes place move with their state (to
        the host first, then to the device, one unit at a time), their G and P with them."""
        self._place(plan)
        self._set_recompute(plan)
        if self._masters is not None:
            self._host.place_updater(self._basic, plan.host_optimizer, [])  # its pinned copies go with the slices moved
            self._masters.place(self._units, self._host_units, self._os_tier())
            self._place_updater()

    def _rebuild(self, plan: Plan, staged: "staging.Staged") -> None:
        """Another layout: the optimizer's state dropped first (the staging holds it), so that the device never
        holds two plans'; this plan's units, groups and hooks torn down; ``plan``'s built and filled."""
        if self._masters is not None:
            self._masters.release()
        self._teardown()
        self._build(plan, None, self._device)
        self._set_recompute(plan)
        if self._basic is not None:
            self._make_masters()
            staging.fill(self._units, self._masters, staged)

    def _teardown(self) -> None:
        """What a plan holds, gone: hooks, groups, the host side, and every unit's buffers (parameters keep their
        shape, no storage). Issues no collective; safe on a half-built runtime."""
        if getattr(self, "_executor", None) is not None:
            self.wait()
            self._executor.remove_hooks()
            self._executor = None
        if not self._groups.destroyed:
            self._groups.destroy()
        self._host.close()  # its worker writes P chunks: done before they are freed
        for unit in self._units:
            unit.free()
        self._units, self._host_units, self._masters = [], [], None

    @property
    def destroyed(self) -> bool:
        return self._groups.destroyed

    def activation_offload_stats(self):
        """What activation offload holds and has done (``activation_offload.OffloadStats``); None where the plan
        offloads no layer's inputs."""
        return self._act_offload.stats() if self._plan.activation_offload_units and self._act_offload else None

    def partitions_params(self) -> bool:
        """Whether some unit's parameters are split over ranks (a full read gathers: every rank must take part)."""
        return any(u.releases and u.sharded_p for u in self._units)

    def releases_params(self) -> bool:
        """Whether some unit's full parameters exist only while gathered for use (P sharded, or on the host)."""
        return any(u.releases for u in self._units)

    def layer_modules(self) -> list:
        """Each layer unit's modules, in order (what activation checkpointing applies to)."""
        return [u.modules for u in self._executor.layers]

    def unit_sizes(self) -> list:
        """(padded numel, is_root) per unit, as ``lins_ds.plan.cost.schedule`` takes them."""
        return [(u.spec.padded, u.is_root) for u in self._units]

    # --- the steps of training, one caller each (module docstring) ----------------------------
    def begin_backward(self, ahead_coef: Optional[float] = None) -> None:
        """``ahead_coef``: the coefficient the step will scale every gradient by, where it is known before the backward
        (no clipping, no loss scale: ``LinsOptimizer.ahead_coef``). Then, where the plan says so
        (``host_update_in_backward``), the window's last backward starts the offloaded units' host updates as their
        gradients become final (docs/design.md §13), the last step's settled first on every rank."""
        again = self._progress.phase is Phase.BACKWARD  # DeepSpeed's hook, then the engine's: one backward
        if not again:
            self.refuse_ahead("another backward")
        ends = self._ends_window()
        if (not again and ends and ahead_coef is not None and self._plan.host_update_in_backward
                and self._host_units):
            self._host.settle()
            for unit in self._host_units:  # one the window's forwards did not use may still hold the last step's
                unit.wait_param_sync()     # update (no collective: such layouts have no P-sync group, or none left)
            self._host.begin_ahead(ahead_coef)
        self._progress.phase, self._progress.ends_window = Phase.BACKWARD, ends
        self._progress.window_done = False
        self._progress.pending = True
        if self._host.grads is not None:
            self._host.grads.ends_window = self._progress.ends_window
        self._executor.begin_backward()
        if self._plan.activation_offload_units:  # the last offloaded layer's inputs come up beside the head's backward
            self._act_offload.prefetch_newest()

    def end_backward(self) -> None:
        """Reduce what is left, in order; at a window's end the replica AllReduces are all in flight (and the host
        updates begun inside it each hold their unit)."""
        self._executor.end_backward()
        self._host.backward_ended()
        self._progress.phase = Phase.FORWARD
        if self._progress.ends_window:  # as under ZeRO-1, .grad is None now: the window's gradient, averaged over
            self._progress.window_done = True  # the ranks, is what ``full_grad`` (safe_get_full_grad) assembles
            for unit in self._units:
                unit.detach_grads()

    def refuse_ahead(self, what: str) -> None:
        """Raise where host updates began inside the window's last backward and no ``step()`` has taken them: ``what``
        would see (or change) masters that already hold this step's update."""
        if self._host.ahead:
            raise RuntimeError(
                f"lins: {what} between the window's last backward and engine.step(): with gradient_clipping 0 the "
                "offloaded units' host updates start inside that backward (lins.host_update_in_backward), so their "
                "parameters already take this step's update. Call engine.step() first, or set "
                "\"lins\": {\"host_update_in_backward\": false} in the DeepSpeed config")

    def finish_gradients(self) -> None:
        """The boundary: every G chunk all-reduced over its replicas (launched during the last backward where
        possible) and waited for, and no P-sync left in flight (the update writes the P storage)."""
        self._progress.phase = Phase.BOUNDARY
        self._executor.finish_window()
        for unit in self._units:
            if not (self._host.ahead and unit.param_state is ParamState.UPDATING):  # this step's: the forward waits
                unit.wait_param_sync()

    def check_host(self, step: bool = False) -> None:
        """The last host update finished on every rank, or every rank raises the failing rank's error (a failure on one
        rank alone would leave the others waiting in a collective). Every rank calls it at the same point: the step,
        a save, a re-layout. Nothing (no collective) where the plan offloads nothing: the same on every rank. At the
        step (``step``) after updates began inside its last backward, nothing: that backward settled the last ones."""
        if step and self._host.ahead:
            return
        self.refuse_ahead("a checkpoint save or load, or a re-plan,")
        if self._host_units:
            self._host.settle()

    def grad_norm(self, inv_scale: float) -> torch.Tensor:
        """Global L2 norm of the true (unscaled, averaged) gradient, on the device; each element once."""
        host = self._host.grads is not None  # then a second element: the ranks whose host gradient work failed
        sq = torch.zeros(2 if host else 1, dtype=torch.float32, device=self._device)
        for g in self.os_grads():  # accumulated in fp32 without an fp32 copy of the chunk
            sq[0] += torch.linalg.vector_norm(g, 2, dtype=torch.float32).square()
        if host:  # G on the host: its norm taken there as the gradients came down (docs/design.md §13)
            sq[0] += self._host.grad_square_sum()
            sq[1] = 1.0 if self._host.grad_error() else 0.0
        comm.all_reduce(self._groups, "world", sq, tag="grad-norm")  # every OS chunk is held by world/s_os replicas
        if host and sq[1].item():  # a host failure on any rank raises on every rank, after the collective
            raise RuntimeError(self._host.grad_error() or "lins: adding gradients on the host failed on another rank")
        return (sq[0] / self._os_replicas).sqrt() * inv_scale

    @torch.no_grad()
    def update(self, coef: torch.Tensor) -> None:
        """The step after the norm (every rank): the host updates start once their gradients are final (drain, then
        download, then each unit UPDATING: ``HostOffload``'s protocol), the device masters update, the parameters
        follow (P-sync), the gradients are dropped. ``coef`` scales each gradient (loss scale, averaging, clipping)."""
        self._refuse_held()  # before the host side moves: a user's error leaves it as it was
        host = self._host if self._host_units else None  # the plan's: the same on every rank
        begin = None
        if host is not None and host.ahead:  # begun inside the last backward: this step's, if nothing changed since
            host.take()
        elif host is not None:
            host.drain_grads()
            host.start_updates(coef)  # the host units' gradients leave first
            begin = host.begin
        self._masters.update(coef)
        self._sync(begin)
        self.zero_gradients()

    def _refuse_held(self) -> None:
        held = [u.name for u in self._units if u.held]
        if held:
            raise RuntimeError(f"lins: engine.step() inside deepspeed.zero.GatheredParameters (units {held[:3]} are "
                               "held gathered): leave the context before the step, which rewrites the parameters")

    def sync_parameters(self) -> None:
        """Gather each P chunk from the OS chunks of its P-sync group (a checkpoint load, a re-layout: the masters were
        written directly); asynchronously when overlapping, each unit's next use waiting for its own gather."""
        self._refuse_held()
        self._sync(None)

    @torch.no_grad()
    def _sync(self, begin_host: Optional[Callable]) -> None:
        """After the update (the caller refused held units): each P chunk from the OS chunks of its P-sync group.
        ``begin_host`` starts the offloaded units' host updates; where no P-sync follows them and overlap is on, they
        outlive this call and each unit's next use waits for its own (docs/design.md §13); else they are waited for
        here, in unit order, each unit's P-sync launched after its update."""
        self.release_all()  # gathered copies are stale now
        if begin_host is not None:
            begin_host()
        lazy = self._overlap_param_sync and hides_behind_forward(self._layout)
        for unit in self._units:
            if unit.param_state is ParamState.UPDATING:
                if lazy:
                    continue
                unit.finish_host_update()
            unit.wait_param_sync()
            unit.start_param_sync(async_op=self._overlap_param_sync)
        self._progress.phase = Phase.FORWARD
        self._progress.window_done = False
        self._reads_pending = any(u.param_state in (ParamState.SYNCING, ParamState.UPDATING) for u in self._units)

    # --- what user code reads (docs/design.md §4: "What user code sees") --------------------------------
    @contextlib.contextmanager
    def running(self):
        """The engine itself runs (forward, backward, step): parameter reads inside are its own."""
        self._progress.busy += 1
        try:
            yield
        finally:
            self._progress.busy -= 1

    def params_current(self) -> None:
        """Every parameter this rank holds current for a reader on this stream: each P-sync in flight waited for, each
        host update still running finished. Issues no collective (a host update outlives ``step()`` only where no
        P-sync follows it), so one rank alone may call it."""
        for unit in self._units:
            unit.wait_param_sync()
        self._reads_pending = False

    def before_user_read(self) -> None:
        """Called where user code reads parameters (a module's ``parameters()``, ``named_parameters()``,
        ``state_dict()``): outside the engine's own forward, backward and step, the updates of the last step are
        made visible first. Inside them nothing waits: each unit's use waits for its own (the overlap is kept)."""
        if not self._progress.busy:
            self.refuse_ahead("reading the model's parameters")
        if self._reads_pending and not self._progress.busy and self._progress.phase is Phase.FORWARD:
            self.params_current()

    def drop_gradients(self, params=None) -> None:
        """``zero_grad``: the gradients accumulated so far are dropped, as DeepSpeed drops them (every rank at the same
        point; reductions in flight complete first, none is issued, so one rank alone may call it). ``params``: only
        theirs (a submodule's ``zero_grad``), else every gradient. After ``step()`` there is nothing to drop."""
        if self._progress.phase is Phase.BACKWARD:
            raise RuntimeError("lins: zero_grad() inside a backward")
        self.refuse_ahead("zero_grad() (dropping the window's gradients)")
        if self._forward_only or not self._progress.pending:  # DeepSpeed's own, after every step: nothing to drop, and
            return  # nothing to wait for (the step's host updates and P-syncs go on behind the next forward)
        self._executor.complete_reductions()
        mine = None if params is None else [p for p in params if p in self._slot_of]
        if mine is None or len(set(mine)) == len(self._slot_of):
            self.zero_gradients()
            return
        if not mine:
            return
        self.host_grads_final()  # every push of the window added in before a part of it is dropped
        for p in mine:
            unit, slot = self._slot_of[p]
            unit.drop_grad(slot)
        self.host_grads_written()

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
        return [u for u in self._units if u in mine]

    def zero_gradients(self) -> None:
        self._progress.window_done, self._progress.pending = False, False
        if self._host.grads is not None:
            self._host.grads.reset()
        for unit in self._units:
            unit.reset_grads()

    def attach_grads(self) -> None:
        """Every .grad back on its accumulator view, or None (the optimizer's zero_grad)."""
        for unit in self._units:
            unit.attach_grads()

    def window_done(self) -> bool:
        """Whether the backward that ends an accumulation window is done and ``step()`` has not yet run (the window's
        full gradient is readable: ``safe_get_full_grad``)."""
        return self._progress.window_done

    def sum_over_world(self, t: torch.Tensor, tag: str) -> None:
        """``t`` summed over every rank, in place (every rank calls it: ZeRO's full-value helpers)."""
        comm.all_reduce(self._groups, "world", t, tag=tag)

    def check_collectives(self) -> None:
        """With ``lins.check_collectives``: every rank issued the same collectives, in the same order on each
        group, since the last check (called by every rank at each optimizer step); else nothing."""
        if self._groups.issued is not None:
            self._checks += 1
            comm.check_order(self._groups, f"optimizer step {self._checks}")

    # --- what the optimizer and the checkpoints see ----------------------------------------------
    def os_grads(self) -> list:
        """Each unit's accumulated gradient of this rank's OS chunk (padding included, which stays zero), on the
        device: the units whose G lives on the host are not among them (``HostOffload.grad_square_sum``)."""
        return [u.os_grad() for u in self._units if u.host_grads is None]

    def host_grads_final(self) -> None:
        """Every push of the window added into the host G accumulators (``zero_api``'s full gradient reads them)."""
        self._host.grad_square_sum()

    def host_grads_written(self) -> None:
        """A host G accumulator was written from outside (``safe_set_full_grad``): its norm is taken again."""
        if self._host.grads is not None:
            self._host.grads.forget_norms()

    # --- one parameter's place in its unit, for the full-value verbs (``full_values.py``) ----------------------------
    def _slot(self, param) -> Slot:
        """Where trainable ``param`` lies in its unit's buffer (name, offset, numel, shape, param group)."""
        return self._slot_of[param][1]

    def _master_slices_of(self, param) -> list:
        """The master slices of ``param``'s unit on this rank (none before an optimizer is attached)."""
        unit = self._slot_of[param][0]
        return self._masters.of_unit(unit) if self._masters is not None else []

    def _grad_range_of(self, param) -> Optional[OSRange]:
        """The part of ``param``'s param group inside this rank's OS chunk of its unit (its gradient and the parameter
        names it covers), or None."""
        unit, slot = self._slot_of[param]
        return unit.os_range(slot.group)

    def _write_param(self, param, flat: torch.Tensor) -> None:
        """The part of ``param``'s values this rank holds in P, from ``flat`` (the whole parameter)."""
        unit, slot = self._slot_of[param]
        unit.write_param(slot, flat)

    def _write_grad(self, param, flat: torch.Tensor) -> None:
        """The part of ``param``'s gradient this rank's G accumulator holds, from ``flat`` (the accumulator's scale)."""
        unit, slot = self._slot_of[param]
        unit.write_grad(slot, flat)

    def param_groups_by_name(self) -> dict:
        """Trainable parameter name -> optimizer param group index."""
        return {s.name: s.group for u in self._units for s in u.slots}

    # --- parameters ----------------------------------------------------------------------------
    def gather_all(self) -> None:
        """Every unit's full parameters current (``state_dict``, evaluation outside forward)."""
        for unit in self._units:
            unit.wait_gather()

    def release_all(self) -> None:
        for unit in self._units:
            unit.release()

    def settle(self) -> None:
        """Every unit's P chunk current (a host update finished, a P-sync completed) and every collective done:
        what a re-layout or a checkpoint reads. Host update errors are agreed first, by ``check_host``."""
        for unit in self._units:
            unit.wait_param_sync()
        self.wait()

    def host_gb(self) -> float:
        """Host memory the plan's offloaded state holds on this rank (0 without offload): masters, their optimizer
        state, gradient and parameter copies. The host updates in flight are waited for only while an update has yet
        to make its optimizer state (the first): a later step's are not (the memory guard asks during training,
        where a wait would expose a whole host update)."""
        if self._host.updater is None:  # no offload, or this rank's share of the host units is only padding
            return 0.0
        if self._masters is not None and not self._masters.host_state_made():
            self._host.join()
        params = sum(u.p_shard.nbytes for u in self._units if u.host_params is not None)
        return (self._host.nbytes() + params) / 2**30

    def host_stats(self) -> Optional[dict]:
        """The host side's counters (``HostOffload.stats``), None where the plan offloads nothing."""
        return self._host.stats() if self._host.updater is not None else None

    def wait(self) -> None:
        """Wait for every collective still in flight (P-sync, prefetch, ReduceScatter, AllReduce); issues
        none. After it the parameters, P chunks and OS chunks may be read and written directly."""
        self._executor.complete_in_flight()

    def destroy(self) -> None:
        """Idempotent; issues no collective (it runs from ``atexit`` and ``__del__`` too)."""
        if self._groups.destroyed:
            return
        self.abandon_ahead()  # a unit still UPDATING from inside a last backward: its P-sync would be a collective
        self.wait()
        self._executor.remove_hooks()
        self._groups.destroy()
        self._host.close(wait=False)
        if any(u.releases for u in self._units):  # the module keeps only P chunks (or host copies): refuse to run it
            self._module.register_forward_pre_hook(_sharded_after_destroy)


def _describe(plan: Plan) -> str:
    return label(plan.layout, plan.activation_checkpointing_units, plan.num_layers, plan.placement)


def _report(dev, t0: float, base: int, host_bytes: int) -> RelayoutReport:
    # the peak above what the old or the new plan holds at rest: what the move itself costs
    peak = ((torch.cuda.max_memory_allocated(dev) - max(base, torch.cuda.memory_allocated(dev))) / 2**30
            if dev.type == "cuda" else 0.0)
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the move's freed blocks back to the device: the new plan starts unfragmented
    return RelayoutReport(time.perf_counter() - t0, peak, host_bytes / 2**30)


def _try(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - agreed by the caller: every rank goes back together
        return f"{type(e).__name__}: {e}"


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
