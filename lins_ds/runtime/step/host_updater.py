"""The update of the offloaded units' masters (docs/design.md §13): the worker that runs them on the host, one unit
after another in forward order (``HostUpdater``), what it updates of each unit (``HostSlice``), and what a unit holds
while its update runs (``HostTicket``). The gradients come down and the updated parameters go up through the offload
tier's storage seam (``storage.Tier``)."""
from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Optional

import torch

from ... import comm
from .host_grads import HostGrads
from .host_memory import SWITCH_INTERVAL_S, PinnedHost, intra_op_threads
from .host_optimizer import HostOptimizer, update_piece
from .storage import Copied, Tier

__all__ = ["HostSlice", "HostTicket", "HostUpdater"]


class HostSlice:
    """One offloaded piece of an ``OSRange``: its gradient in the tier (down at the step; where the unit's G lives on
    the host, a view into its accumulator), its parameter-dtype copy (up)."""

    def __init__(self, master, tier: Tier, grads_on_host: bool):
        self.master = master  # a MasterSlice whose param lives on the host
        n, dtype = master.param.numel(), master.range.unit.dtype
        unit = master.range.unit
        self.on_host = grads_on_host
        self.grad = master.range.grads() if self.on_host else tier.allocate(n, unit.accum_dtype)
        # the parameter-dtype copy that goes up: none for fp32 parameters (the master goes up) or for a unit whose P
        # is on the host (the master is cast straight into it)
        self.up = None if dtype == torch.float32 or unit.host_params is not None else tier.allocate(n, dtype)


class HostTicket:
    """One unit's host update of one step, what the unit holds while UPDATING (not the updater): the worker marks it
    done, with the event of the upload it launched; the unit's next use waits on it. Written by the worker only
    before ``done`` is set, read by the training thread only after."""

    def __init__(self, updater: "HostUpdater", unit_name: str):
        self._updater, self.unit_name = updater, unit_name
        self._done = threading.Event()
        self._upload: Optional[Copied] = None  # the upload the worker launched

    def finish(self, upload: Optional[Copied]) -> None:
        """The worker: this unit's update is written and its upload (``upload``: what the device waits on; None,
        nothing to wait for) launched."""
        self._upload = upload
        self._done.set()

    def abandon(self) -> None:
        """The worker failed: whoever waits stops waiting (the error is raised on every rank at the step)."""
        self._done.set()

    def ready(self) -> bool:
        return self._done.is_set()

    def wait_done(self, timeout: float) -> bool:
        """Block up to ``timeout`` s for the worker; whether it is done with this unit."""
        return self._done.wait(timeout)

    def wait(self) -> None:
        """Block until the update is on the device, ordered before the current stream's next work (a failed update
        returns at once: every rank raises it at the next step boundary, ``HostUpdater.error``)."""
        self._updater.wait_for(self)
        if self._upload is not None and not self._updater.failed():
            self._upload.wait()
            self._upload = None


class HostUpdater:
    """Runs the offloaded units' updates on a worker thread, in forward order; each unit's next use waits for its
    own (``Unit.begin_host_update`` with the unit's ``HostTicket``)."""

    def __init__(self, host_optimizer: HostOptimizer, slices_by_unit: list, device: torch.device,
                 grads: Optional[HostGrads] = None, tier: Optional[Tier] = None):
        """``grads``: the host G accumulators, where the plan keeps the units' gradients on the host (read in place).
        ``tier``: where the gradients come down to and the updated parameters go up from (None: ``PinnedHost``)."""
        self.opt, self.device, self._grads = host_optimizer, device, grads
        self.tier = tier or PinnedHost(device)
        held = set(grads.units()) if grads is not None else set()
        self.by_unit = [(unit, [HostSlice(m, self.tier, unit in held) for m in masters])
                        for unit, masters in slices_by_unit]
        self._ticket_of: dict = {}  # unit -> its ticket of the last step
        self._lane = self.tier.lane()  # the step's gradients down, then the updated parameters up
        self._down = self.tier.lane()  # the gradients down, unit by unit inside the last backward (``final``)
        self._slices_of = dict(self.by_unit)
        self.coef = self.tier.allocate(1, torch.float32)
        # the fp32 gradient of the piece being updated: one buffer, reused (a fresh 128 MiB per piece costs its
        # page faults every time)
        self._scratch = torch.empty(max((s.grad.numel() for _, ss in self.by_unit for s in ss), default=0),
                                    dtype=torch.float32)
        self._thread: Optional[threading.Thread] = None
        self._tickets: list = []  # this step's, one per unit, in forward order
        self._error: Optional[BaseException] = None
        self.last_update_s = 0.0  # the worker's wall time in the last step (host updates and copies)
        self.last_spent_s: dict = {}  # ... of it waiting for the gradients, updating, launching the uploads
        self.waited_s = 0.0  # how long the main thread has blocked on host updates, in total (exposed host work)
        self.ahead_hyperparameters: Optional[list] = None  # what the updates inside the last backward took
        self._t0, self._backward_end = 0.0, None  # the worker's start; inside the last backward, that backward's end
        self._in_backward = False  # the last worker started inside the window's last backward
        self._ready_at: dict = {}  # unit name -> (its gradient final, ready for the worker), s after ``_t0``
        self.last_timeline: dict = {}  # the worker's last step, unit by unit (``timeline``)
        self.updated = [0, 0.0]  # elements updated and seconds spent updating them, every finished worker so far

    def units(self) -> list:
        return [u for u, _ in self.by_unit]

    def elements(self) -> int:
        """Elements the worker updates a step (this rank's offloaded OS chunks)."""
        return sum(s.master.param.numel() for _, slices in self.by_unit for s in slices)

    def rate_key(self) -> dict:
        """What the worker's update rate depends on besides the host (``profiler.host_rate.key``'s optimizer part)."""
        grad = next((s.grad.dtype for _, slices in self.by_unit for s in slices), None)
        return {"optimizer": self.opt.name, "threads": self.opt.threads, "grad_dtype": str(grad),
                "in_backward": self._in_backward}

    def nbytes(self) -> int:
        """Host bytes of the offloaded state: masters, their optimizer state, the gradient and parameter copies."""
        n = 0
        for _, slices in self.by_unit:
            for s in slices:
                m = s.master.param
                n += m.nbytes + (0 if s.on_host else s.grad.nbytes) + (s.up.nbytes if s.up is not None else 0)
                n += sum(v.nbytes for v in self.opt.opt.state.get(m, {}).values() if torch.is_tensor(v) and v.dim())
        return n

    def download(self, coef: torch.Tensor) -> list:
        """Launch every host slice's gradient and the clip coefficient down; one ``Copied`` per unit."""
        self._lane.follow()  # the coefficient and the gradients were written on the current stream
        events = []
        with self._lane.issuing():  # an accumulator no backward of the window allocated is made on the lane too
            coef_ready = self._lane.download([(self.coef, coef.reshape(1))], keep=(coef,))
            for unit, slices in self.by_unit:
                if slices and slices[0].on_host:  # its gradient is on the host already: final once drained
                    if not self._grads.drained():
                        raise RuntimeError(f"lins: the host update of unit {unit.name} would read its gradient "
                                           "before the host has added every micro-batch's (HostGrads.drain() first)")
                    events.append(coef_ready)
                    continue
                # the accumulator is freed after the step; its memory is reused only once the copy is done
                events.append(self._lane.download([(s.grad, s.master.range.grads()) for s in slices],
                                                  keep=(unit.g_acc,)))
        return events

    def start(self, events: list) -> None:
        """Begin the host updates (after ``download``); each unit enters UPDATING until the worker finishes it."""
        self._tickets = [HostTicket(self, u.name) for u, _ in self.by_unit]
        self._ticket_of = {u: t for (u, _), t in zip(self.by_unit, self._tickets)}
        self._error, self.ahead_hyperparameters = None, None
        hyper = self.opt.hyperparameters()
        for (unit, _), ticket in zip(self.by_unit, self._tickets):
            unit.begin_host_update(ticket)
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._interval, SWITCH_INTERVAL_S))
        self._t0, self._backward_end, self._ready_at, self._in_backward = time.perf_counter(), None, {}, False
        self._thread = threading.Thread(target=self._run, args=(events, hyper), name="lins-host-update", daemon=True)
        self._thread.start()

    # --- updates inside the window's last backward (no clipping, no loss scale: the coefficient is known) ---------
    def start_ahead(self, coef: float) -> None:
        """At the start of the window's last backward: the worker starts, its units to come as their gradients are
        final (``final``), each updated with ``coef`` (the averaging factor: no clipping, no loss scale) and the
        engine optimizer's hyperparameters now (``ahead_hyperparameters``: ``step()`` checks they did not change)."""
        self._tickets = [HostTicket(self, u.name) for u, _ in self.by_unit]  # the last step's are done (joined)
        self._error = None
        self.ahead_hyperparameters = self.opt.hyperparameters()
        self._arrivals, self._delivered = queue.Queue(), 0
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._interval, SWITCH_INTERVAL_S))
        self._t0, self._backward_end, self._ready_at, self._in_backward = time.perf_counter(), None, {}, True
        self._thread = threading.Thread(target=self._work, args=(self._ahead(coef), self.ahead_hyperparameters),
                                        name="lins-host-update", daemon=True)
        self._thread.start()

    def final(self, unit) -> None:
        """(Training thread, inside the last backward) ``unit``'s gradient is final: down on a lane of its own (where
        it is on the device) and to the worker; a unit not offloaded here is not its."""
        slices = self._slices_of.get(unit)
        if slices is None:
            return
        self._delivered += 1
        at = time.perf_counter()
        if slices and slices[0].on_host:  # the host adds its last micro-batch: the worker waits for that
            self._arrivals.put((unit, slices, None, at))
            return
        self._down.follow()  # written on the current stream
        with self._down.issuing():
            self._arrivals.put((unit, slices, self._down.download(
                [(s.grad, s.master.range.grads()) for s in slices], keep=(unit.g_acc,)), at))

    def begin_ahead(self) -> None:
        """The backward ended (every unit at rest, every unit given to ``final``): each unit UPDATING with its ticket,
        which the next window's first gradient of the unit waits for (``wait_unit``; inside this backward it waited
        for the last step's, done)."""
        self._backward_end = time.perf_counter()
        self._ticket_of = {u: t for (u, _), t in zip(self.by_unit, self._tickets)}
        for (unit, _), ticket in zip(self.by_unit, self._tickets):
            unit.begin_host_update(ticket)

    def _ahead(self, coef: float):
        """The worker's units as their gradients become final (``final``): of those that came and are ready (down, or
        added up by the host), the one the next forward needs first (the backward makes them final last unit first,
        and the worker falls behind it). Where none that came is ready, it waits for the first that came: the copies
        down and the host's sums finish in the order the units came. (Waiting for the next forward's unit instead
        left the worker idle while the host added up the units that came before it.)"""
        tickets = dict(zip(self.units(), self._tickets))
        order = {u: i for i, u in enumerate(self.units())}  # forward order
        came: list = []
        for _ in self.by_unit:
            if not came:
                came.append(self._arrivals.get())
            while not self._arrivals.empty():
                came.append(self._arrivals.get_nowait())
            if any(item is None for item in came):  # join() before every unit came: the backward broke off
                raise RuntimeError("the window's last backward ended before every offloaded unit's gradient was final")
            ready = [it for it in came if self._is_ready(it)] or [self._wait_ready(came[0])]
            item = min(ready, key=lambda it: order[it[0]])
            came.remove(item)
            self._wait_ready(item)  # ready: returns at once (a failed host sum raises)
            self._ready_at[item[0].name] = (item[3] - self._t0, time.perf_counter() - self._t0)
            yield item[1], tickets[item[0]], coef

    def _is_ready(self, item) -> bool:
        """Whether the gradient of an arrival (``final``'s (unit, slices, copied, at)) is there to update from."""
        unit, _, copied, _ = item
        return self._grads.is_final(unit) if copied is None else copied.done()

    def _wait_ready(self, item):
        """Block until the gradient of an arrival is there (raises where the host's sum of it failed); the arrival."""
        unit, _, copied, _ = item
        if copied is None:
            self._grads.wait_final(unit)
            if self._grads.error():
                raise RuntimeError(self._grads.error())
        else:
            copied.synchronize()
        return item

    def _run(self, events: list, hyper: list) -> None:
        """The worker after ``start``: the units in forward order, each once its gradient (and the coefficient) came
        down."""
        def units():
            for (unit, slices), ev, ticket in zip(self.by_unit, events, self._tickets):
                ev.synchronize()
                self._ready_at[unit.name] = (None, time.perf_counter() - self._t0)
                yield slices, ticket, float(self.coef[0])

        self._work(units(), hyper)

    def _work(self, units, hyper: list) -> None:
        """Update each (slices, ticket, coefficient) ``units`` yields, once its gradient is final (the generator blocks
        until then), and launch its upload; the time spent, by what the worker waited on, in ``last_spent_s``."""
        t0 = time.perf_counter()
        spent = dict.fromkeys(("download", "update", "upload"), 0.0)  # the worker's time by what it waited on
        rows, elems = [], 0  # unit by unit, s after ``_t0``: final, ready, updated; the elements updated
        try:
            # on the optimizer's threads (host_memory.host_threads): a team one core short of this rank's cores, so
            # that the training thread beside it never holds up a parallel region
            with self._lane.worker(), torch.no_grad(), intra_op_threads(self.opt.threads):
                t = time.perf_counter()
                for slices, ticket, coef in units:
                    t, spent["download"] = time.perf_counter(), spent["download"] + time.perf_counter() - t
                    for s in slices:
                        self._update(s, coef, hyper)
                        elems += s.master.param.numel()
                    t, spent["update"] = time.perf_counter(), spent["update"] + time.perf_counter() - t
                    ticket.finish(self._upload(slices))
                    spent["upload"] += time.perf_counter() - t
                    rows.append((ticket.unit_name, *self._ready_at.get(ticket.unit_name, (None, None)), t - self._t0))
                    t = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - raised on every rank at the next step boundary (error())
            self._error = e
            for ticket in self._tickets:
                ticket.abandon()
        self.last_update_s, self.last_spent_s = time.perf_counter() - t0, spent
        self.last_timeline = timeline(rows, self._backward_end, self._t0)
        self.updated = [self.updated[0] + elems, self.updated[1] + spent["update"]]
        sys.setswitchinterval(self._interval)

    def _update(self, s: HostSlice, coef: float, hyper: list) -> None:
        update_piece(self.opt, s.master.param, s.grad, s.up, self._scratch, coef, hyper)

    def _upload(self, slices: list) -> Copied:
        """Launch the updated slices' copy up; what marks it done."""
        return self._lane.upload([(s.master.range.params(), s.up if s.up is not None else s.master.param.data)
                                  for s in slices])

    def wait_for(self, ticket: HostTicket) -> None:
        """Block until the worker is done with ``ticket`` (counted as exposed host time); a worker that died outside
        its own handler is an error, as a failed update is."""
        if ticket.ready():
            return
        t0 = time.perf_counter()
        while not ticket.wait_done(1.0):
            if self._thread is None or not self._thread.is_alive():
                if not ticket.ready():
                    self._error = self._error or RuntimeError(f"the host update thread ended before updating unit "
                                                              f"{ticket.unit_name}")
                    break
        self.waited_s += time.perf_counter() - t0

    def wait_unit(self, unit) -> None:
        """Block until the last step's update of ``unit`` (if any) is done (its host accumulator free again)."""
        ticket = self._ticket_of.get(unit)
        if ticket is not None:
            ticket.wait()

    def join(self) -> None:
        """The worker done; one started inside a backward that broke off (not every unit given to ``final``) is told
        so, and fails (its units keep their values; every rank raises it at the next boundary)."""
        if self._thread is not None and self.ahead_hyperparameters is not None and self._delivered < len(self.by_unit):
            self._delivered = len(self.by_unit)
            self._arrivals.put(None)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def failed(self) -> bool:
        return self._error is not None

    def clear_error(self) -> None:
        """A checkpoint load replaces what the failed update left: training may go on."""
        self._error = None

    def error(self) -> str:
        """Why the last host update failed on this rank ('' if it did not): its units kept their old values, and the
        caller makes every rank raise it (``HostOffload.settle``)."""
        if self._error is None:
            return ""
        return f"lins: the host optimizer's update failed on rank {comm.rank()}: {type(self._error).__name__}: " \
               f"{self._error}"


def timeline(rows: list, backward_end: Optional[float], t0: float) -> dict:
    """The worker's last step unit by unit, in the order it updated them, in ms from its start (the window's last
    backward's start where it updated inside it; else ``step()``): when the unit's gradient was final (inside the
    backward), when it was there to update from, when its update was done; and when that backward ended (None: after
    the step, or the worker was done first). What ``bench/train.py`` records to show where a step's host time went."""
    def ms(s):
        return None if s is None else round(1e3 * s, 1)
    return {"backward_end_ms": ms(None if backward_end is None else backward_end - t0),
            "units": [[name, ms(final), ms(ready), ms(done)] for name, final, ready, done in rows]}
