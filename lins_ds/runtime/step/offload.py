"""The host side of offload (docs/design.md §13), one component per plan: ``HostOffload``, owned by ``LinsRuntime``.
It holds the host P pool (``HostParams``), the host G accumulators and their thread (``HostGrads``), and the worker
that updates the offloaded units' masters (``HostUpdater``), and it is driven through one protocol, asserted
(``HostPhase``, ``HOST_TRANSITIONS``):

    backward     each unit whose G lives on the host pushes its reduced chunk down (``HostGrads.push``): IDLE or
                 UPDATING (the last step's update of that unit is waited for first)
    step()       drain_grads      every push added: the host accumulators are final           IDLE -> DRAINED
                 start_updates    the clip coefficient and the device-held gradients go down  DRAINED -> DOWNLOADED
                 (the device units update as usual)
                 begin            each host unit UPDATING with its ticket; the worker starts  DOWNLOADED -> UPDATING
    worker       unit by unit in forward order: wait for the unit's gradient, scale it, step the host optimizer, cast
                 the master to the parameter dtype, copy it up on its lane; mark the unit's ticket
    next use     the unit's forward (or anything that reads its parameters) waits for its own ticket only
    boundary     settle           the worker joined, its error agreed: every rank raises the failing rank's message
                 (the next step, a save, a re-layout, a load)                                  any -> IDLE

Its parts live in modules of their own: ``host_grads`` (``HostGrads``, ``HostGradSlot``), ``host_params``
(``HostParams``), ``host_updater`` (``HostUpdater``, ``HostSlice``, ``HostTicket``). Each allocates and copies only
through the offload tier (``storage.Tier``: allocate, lanes of upload and download, their ``Copied`` events), which
``HostOffload`` makes for the device (``host_memory.PinnedHost``: pinned host memory and side CUDA streams on a GPU;
on a CPU device a separate tensor pool on the same memory, copied synchronously, so the CPU tests run the same code
paths).
"""
from __future__ import annotations

import enum
from typing import Callable, Mapping, Optional

import torch

from ... import comm
from ...plan.offload import HOST
from ..errors import HostProtocolError
from .host_grads import HostGrads
from .host_memory import PinnedHost
from .host_optimizer import HostOptimizer
from .host_params import HostParams
from .host_updater import HostUpdater
from .storage import Tier

__all__ = ["HOST_TRANSITIONS", "TIERS", "HostGrads", "HostOffload", "HostParams", "HostPhase", "HostProtocol",
           "HostProtocolError", "HostUpdater"]

# The storage of each tier a plan's ``Placement`` may name (``plan.offload.TIERS``; the device holds its own): the one
# map from a tier's name to the ``storage.Tier`` that implements it. A further tier is a class and a line here.
TIERS = {HOST: PinnedHost}


class HostPhase(enum.Enum):
    IDLE = "idle"  # no host update in flight; gradients may be arriving
    DRAINED = "drained"  # every pushed gradient added: the host accumulators are final until the update reads them
    DOWNLOADED = "downloaded"  # the clip coefficient and the device-held gradients are on their way down
    UPDATING = "updating"  # the worker runs (or ran) this step's updates; the next window's gradients may arrive
    AHEAD = "ahead"  # the updates began inside the window's last backward (no clipping); step() has not taken them


_I, _D, _L, _U, _A = HostPhase.IDLE, HostPhase.DRAINED, HostPhase.DOWNLOADED, HostPhase.UPDATING, HostPhase.AHEAD
# transition -> {phase it may start from: phase it leaves}; anything else is a HostProtocolError
HOST_TRANSITIONS = {
    "push": {_I: _I, _U: _U, _A: _A},  # a gradient down (the backward); never between drain and the update's start
    "ahead": {_I: _A},  # the window's last backward starts, the updates with it (after a settle)
    "take": {_A: _U},  # step(): the updates begun inside the backward are this step's (hyperparameters unchanged)
    "abandon": {_A: _I},  # ... or none's: a checkpoint load replaces what they wrote, or the engine is destroyed
    "drain_grads": {_I: _D, _D: _D},
    "start_updates": {_D: _L},  # the update never starts before the gradients are final
    "begin": {_L: _U},
    "settle": {_I: _I, _D: _I, _L: _I, _U: _I},  # a step skipped (fp16 overflow) or broken off settles too
}                                                # (never AHEAD: the runtime refuses what would, ``refuse_ahead``)


class HostProtocol:
    """The phase of one ``HostOffload``; each transition checks the phase it starts from (``HOST_TRANSITIONS``)."""

    def __init__(self):
        self.phase = HostPhase.IDLE

    def advance(self, transition: str) -> None:
        allowed = HOST_TRANSITIONS[transition]
        if self.phase not in allowed:
            raise HostProtocolError(f"lins: host offload: {transition} in phase {self.phase.value}, expected "
                                    f"{' or '.join(p.value for p in allowed)}")
        self.phase = allowed[self.phase]


class HostOffload:
    """The host side of one plan (docs/design.md §13): the P pool, the G accumulators and their thread, the masters'
    update worker, driven through ``HostProtocol`` (the module docstring). ``LinsRuntime`` owns it and places units
    into it; a unit holds its part (a ``HostTicket`` while UPDATING, the pool its P chunk lives in, the accumulators its
    G goes to), never this object."""

    def __init__(self, device: torch.device, accum_dtype: torch.dtype,
                 tiers: Mapping[str, Callable[[torch.device], Tier]] = TIERS):
        """``tiers``: the storage of each tier a plan's placement names (``TIERS``), made for each part in the tier
        the placement gives its state, as it is placed (the runtime sets ``device`` once its units are built)."""
        self.device, self.accum_dtype = device, accum_dtype
        self.tiers = tiers
        self.protocol = HostProtocol()
        self._param_pools: dict = {}  # tier -> the HostParams of the P chunks kept there, made at its first unit
        self.grads: Optional[HostGrads] = None
        self._grads_tier = ""
        self.updater: Optional[HostUpdater] = None
        self.optimizer_name = ""
        self._downloads: Optional[list] = None  # start_updates' events, for begin
        self._ended = False  # AHEAD: the last backward reached its end (``backward_ended``)

    # --- placement (the runtime, per plan) ----------------------------------------------------------------------
    def tier(self, name: str, device: Optional[torch.device] = None) -> Tier:
        """The storage of tier ``name`` (a ``Placement``'s tier of a state) for ``device`` (the runtime's)."""
        if name not in self.tiers:
            raise ValueError(f"lins: a plan places state on {name!r}, which has no storage here (tiers: "
                             f"{', '.join(self.tiers)})")
        return self.tiers[name](device if device is not None else self.device)

    def params_pool(self, device: torch.device, tier: str = HOST) -> HostParams:
        """The pool (and upload lane) of the P chunks kept in ``tier`` for ``device``."""
        if tier not in self._param_pools:
            self._param_pools[tier] = HostParams(device, self.tier(tier, device))
        return self._param_pools[tier]

    def place_grads(self, units: list, tier: str = HOST) -> Optional[HostGrads]:
        """The G accumulators of ``units`` in ``tier`` (none: no thread); the same units there keep theirs."""
        if self.grads is not None and self.grads.units() == units and self._grads_tier == tier:
            return self.grads
        if self.grads is not None:
            self.grads.close()
            self.grads = None
        if units:
            self.grads = HostGrads(units, self.accum_dtype, self.device, self.protocol, self._wait_update,
                                   self.tier(tier))
            self._grads_tier = tier
        return self.grads

    def _wait_update(self, unit) -> None:
        if self.updater is not None:
            self.updater.wait_unit(unit)

    def place_updater(self, basic, kind: str, slices_by_unit: list, tier: str = HOST) -> None:
        """The worker over ``slices_by_unit`` ([(unit, its host master slices)]; none: no worker), its optimizer the
        engine's ``basic`` one's hyperparameters with a CPU implementation of ``kind`` ("torch" or "deepspeed"), its
        gradients down and parameters up through ``tier`` (the OS's)."""
        self.updater, self.optimizer_name = None, ""  # its pinned copies go with the slices that moved
        if not slices_by_unit:
            return
        masters = [s for _, slices in slices_by_unit for s in slices]
        by_group = [[s.param for s in masters if s.range.group == gi] for gi in range(len(basic.param_groups))]
        opt = HostOptimizer(basic, by_group, kind, self.device)
        updater = HostUpdater(opt, slices_by_unit, self.device, self.grads, self.tier(tier))
        self.updater, self.optimizer_name = updater, opt.name

    # --- the protocol (one step) ----------------------------------------------------------------------------------
    def drain_grads(self) -> None:
        """Every gradient pushed so far added into its host accumulator: final until the update reads it."""
        self.protocol.advance("drain_grads")
        if self.grads is not None:
            self.grads.drain()

    def start_updates(self, coef: torch.Tensor) -> None:
        """The clip coefficient, and the host units' gradients still on the device, down on the updater's lane."""
        self.protocol.advance("start_updates")
        self._downloads = self.updater.download(coef) if self.updater is not None else None

    def begin(self) -> None:
        """Each host unit UPDATING, holding its ticket (at rest: the caller released what was gathered); the worker
        starts. Each unit's next use finishes its own update (``Unit.finish_host_update``)."""
        self.protocol.advance("begin")
        if self.updater is not None:
            self.updater.start(self._downloads)
        self._downloads = None

    # --- the updates inside the window's last backward (gradient_clipping 0, no loss scale) --------------------------
    def begin_ahead(self, coef: float) -> None:
        """The window's last backward starts (after ``settle``): the worker starts and takes each unit as its gradient
        becomes final (``final``), updated with ``coef``."""
        self.protocol.advance("ahead")
        self._ended = False  # backward_ended: the backward reached its end (every unit given to ``final``)
        if self.updater is not None:
            self.updater.start_ahead(coef)

    @property
    def ahead(self) -> bool:
        """Updates began inside the window's last backward and no ``step()`` has taken them yet."""
        return self.protocol.phase is HostPhase.AHEAD

    def final(self, unit) -> None:
        """``unit``'s gradient is final inside the last backward: its update starts where it is offloaded here."""
        if self.ahead and self.updater is not None:
            self.updater.final(unit)

    def backward_ended(self) -> None:
        """The last backward ended: each offloaded unit UPDATING (its next use waits for its own update)."""
        if self.ahead:
            self._ended = True
            if self.updater is not None:
                self.updater.begin_ahead()

    def take(self) -> None:
        """``step()``: the updates begun inside the backward are this step's. That backward must have ended (one that
        broke off left some units updated and others not), and the engine optimizer's hyperparameters must be those
        they took (an LR set between that backward and the step would reach only the device's units): otherwise every
        rank raises, naming what happened, before any update of the step; the phase stays AHEAD, which only a
        checkpoint load (``abandon``) leaves."""
        if not self.ahead:
            self.protocol.advance("take")  # refused (HostProtocolError), naming the phase
        error = None
        if not self._ended:
            error = ("lins: the window's last backward broke off after the offloaded units' host updates began inside "
                     "it (gradient_clipping 0, lins.host_update_in_backward): some units hold this step's update and "
                     "others do not; load a checkpoint to go on")
        elif self.updater is not None:
            now, then = self.updater.opt.hyperparameters(), self.updater.ahead_hyperparameters
            changed = [(g, k, then[g].get(k), v) for g, group in enumerate(now) for k, v in group.items()
                       if not _same(then[g].get(k), v)]
            if changed:
                g, k, old, new = changed[0]
                error = (f"lins: the optimizer's param_groups[{g}][{k!r}] changed from {old} to {new} between the "
                         "window's last backward and step(): with gradient_clipping 0 the offloaded units' host updates "
                         f"start inside that backward (lins.host_update_in_backward) and took {old}. Set it before the "
                         "backward, or set \"lins\": {\"host_update_in_backward\": false}; this step cannot be "
                         "completed (its offloaded units took the old value): load a checkpoint to go on")
        error = comm.agree(error)
        if error is not None:
            raise RuntimeError(error)
        self.protocol.advance("take")

    def abandon(self) -> None:
        """Updates begun inside a last backward that no step will take (a checkpoint load replaces what they wrote;
        the engine is destroyed): the worker ended (told so where the backward broke off); the caller puts the units
        it held at rest."""
        self.join()
        self.protocol.advance("abandon")

    def settle(self) -> None:
        """The worker joined, and its failure on any rank raised on every rank with the failing rank's message. Every
        rank calls it at the same point: a step boundary, a save, a re-layout. (A failure of the gradient sums is
        raised on every rank by the step's norm, ``grad_error``: it stops the step before any update, so a save of the
        last good state still goes through.)"""
        self.join()
        self.protocol.advance("settle")
        error = comm.agree((self.updater.error() if self.updater is not None else "") or None)
        if error is not None:
            raise RuntimeError(error)

    def join(self) -> None:
        """The worker done (this rank alone: what a read of the host masters needs)."""
        if self.updater is not None:
            self.updater.join()

    def forget(self) -> None:
        """A checkpoint load replaces what a failed update left: training may go on."""
        if self.updater is not None:
            self.updater.clear_error()

    # --- the step's gradient norm ----------------------------------------------------------------------------------
    def grad_square_sum(self) -> float:
        return self.grads.square_sum() if self.grads is not None else 0.0

    def grad_error(self) -> str:
        return self.grads.error() if self.grads is not None else ""

    # --- what it holds ---------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        return ((self.updater.nbytes() if self.updater is not None else 0)
                + (self.grads.nbytes() if self.grads is not None else 0))

    def stats(self) -> dict:
        """What the benchmarks report: the training thread's total wait on the host (updates and gradient sums), and
        the worker's last update (wall seconds, and by what it waited on)."""
        up, grads = self.updater, self.grads
        return {"waited_s": (up.waited_s if up is not None else 0.0) + (grads.waited_s if grads is not None else 0.0),
                "updates_waited_s": up.waited_s if up is not None else 0.0,
                "grads_waited_s": grads.waited_s if grads is not None else 0.0,
                "worker_s": up.last_update_s if up is not None else 0.0,
                "worker_spent_s": dict(up.last_spent_s) if up is not None else {},
                "worker_elems": up.elements() if up is not None else 0,
                "worker_updated": list(up.updated) if up is not None else [0, 0.0],
                "worker_timeline": dict(up.last_timeline) if up is not None else {},
                "update_key": up.rate_key() if up is not None else None,
                "host_optimizer": self.optimizer_name,
                "instance": f"{id(up)}:{id(grads)}"}  # new counters (from zero) where this changes

    def close(self, wait: bool = True) -> None:
        """The threads end (idempotent); the buffers go with this object. ``wait`` False (``destroy``, also at exit):
        the update worker, a daemon thread, is not waited for (it may be blocked behind a peer that died)."""
        if wait:
            self.join()
        if self.grads is not None:
            self.grads.close()
        self.grads, self.updater = None, None


def _same(a, b) -> bool:
    """Two hyperparameter values equal (a tensor LR compared by value)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    return a == b
