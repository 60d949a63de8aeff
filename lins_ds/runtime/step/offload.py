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
                 the master to the parameter dtype, copy it up on the copy stream; mark the unit's ticket
    next use     the unit's forward (or anything that reads its parameters) waits for its own ticket only
    boundary     settle           the worker joined, its error agreed: every rank raises the failing rank's message
                 (the next step, a save, a re-layout, a load)                                  any -> IDLE

On a CPU device the "host" is a separate tensor pool on the same memory and the copies are synchronous: the same
code paths run, which is what the CPU tests check.
"""
from __future__ import annotations

import enum
import queue
import sys
import threading
from contextlib import nullcontext
import time
from typing import Optional

import torch

from ... import comm
from ..errors import HostProtocolError
from .host_memory import HOST_PIECE, host_empty, square_sum
from .host_optimizer import HostOptimizer, update_piece

__all__ = ["HOST_PIECE", "HOST_TRANSITIONS", "HostGrads", "HostOffload", "HostParams", "HostPhase", "HostProtocol",
           "HostProtocolError", "HostTicket", "HostUpdater", "host_empty"]

SWITCH_INTERVAL_S = 5e-4  # while the worker runs: the training thread hands over the GIL within 0.5 ms, not 5


class HostPhase(enum.Enum):
    IDLE = "idle"  # no host update in flight; gradients may be arriving
    DRAINED = "drained"  # every pushed gradient added: the host accumulators are final until the update reads them
    DOWNLOADED = "downloaded"  # the clip coefficient and the device-held gradients are on their way down
    UPDATING = "updating"  # the worker runs (or ran) this step's updates; the next window's gradients may arrive


_I, _D, _L, _U = HostPhase.IDLE, HostPhase.DRAINED, HostPhase.DOWNLOADED, HostPhase.UPDATING
# transition -> {phase it may start from: phase it leaves}; anything else is a HostProtocolError
HOST_TRANSITIONS = {
    "push": {_I: _I, _U: _U},  # a gradient down (the backward); never between drain and the update's start
    "drain_grads": {_I: _D, _D: _D},
    "start_updates": {_D: _L},  # the update never starts before the gradients are final
    "begin": {_L: _U},
    "settle": {_I: _I, _D: _I, _L: _I, _U: _I},  # a step skipped (fp16 overflow) or broken off settles too
}


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


class HostGrads:
    """The G accumulators of the units whose gradients live on the host (the plan's ``offload_grads``), in pinned
    host memory, and the thread that adds each micro-batch's gradient into them (docs/design.md §13).

    ``push`` (the training thread, as a unit's reduction completes in a backward) sends the unit's reduced chunk
    down on a copy stream: straight into the accumulator where it is the window's first and of its dtype, else into
    the unit's down buffer, which the thread adds (or copies, converting) into the accumulator. On the backward that
    ends the window the thread then takes the accumulator's squared norm, so that the step finds the global
    gradient norm without another pass over host memory. Only layouts without a replica AllReduce place G here
    (``lins_ds.plan.offload.grads_may_leave``): the chunk that comes down is final for this micro-batch."""

    def __init__(self, units: list, accum_dtype: torch.dtype, device: torch.device,
                 protocol: Optional[HostProtocol] = None, wait_update=None):
        """``wait_update(unit)``: block until the last host update of ``unit`` is done with its accumulator (its
        ``HostOffload`` asks the update's ticket; None: nothing to wait for)."""
        self.device, self.accum_dtype = device, accum_dtype
        self.protocol = protocol or HostProtocol()  # its HostOffload's: a push is one of its transitions
        self._wait_update = wait_update or (lambda unit: None)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.acc = {u: host_empty(u.g_numel, accum_dtype, device).zero_() for u in units}
        self._down: dict = {}  # unit -> the buffer a micro-batch's gradient lands in before the thread adds it
        self._free = {u: threading.Event() for u in units}  # the thread is done with the unit's down buffer
        for ev in self._free.values():
            ev.set()
        self._count = dict.fromkeys(units, 0)  # micro-batches pushed in this window
        self._sq: dict = {}  # unit -> the window's squared norm, once the backward that ends it pushed the unit
        self._scratch = torch.empty(min(HOST_PIECE, max((a.numel() for a in self.acc.values()), default=0)),
                                    dtype=torch.float32)
        self._queue: "queue.Queue" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="lins-host-grads", daemon=True)
        self._thread.start()
        self.ends_window = True
        self.waited_s = 0.0  # how long the training thread has blocked on the host's gradient work, in total

    def units(self) -> list:
        return list(self.acc)

    def slot(self, unit) -> "HostGradSlot":
        """What ``unit`` holds of these accumulators (not this object): its own, and the way its gradient goes down."""
        return HostGradSlot(self, unit)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.acc.values()) + sum(t.nbytes for t in self._down.values())

    def push(self, unit, src: torch.Tensor) -> None:
        """``src``, this micro-batch's reduced gradient of ``unit`` (its G chunk, on the device), towards the unit's
        host accumulator. ``src`` may be freed by the caller at once (its memory is kept for the copy)."""
        self.protocol.advance("push")
        first = self._count[unit] == 0
        if first:  # the last step's host update of this unit reads the accumulator: done with it first
            self._wait_update(unit)
        direct = first and src.dtype == self.accum_dtype
        if direct:
            dst = self.acc[unit]
        else:
            self._wait(self._free[unit].wait)
            if unit not in self._down:
                self._down[unit] = host_empty(src.numel(), src.dtype, self.device)
            dst = self._down[unit]
            self._free[unit].clear()
        cs = self.copy_stream
        if cs is not None:
            cs.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(cs):
                dst.copy_(src, non_blocking=True)
                src.record_stream(cs)
                ev = torch.cuda.Event()
                ev.record(cs)
        else:
            dst.copy_(src)
            ev = None
        self._count[unit] += 1
        op = None if direct else ("copy" if first else "add")
        self._queue.put((unit, ev, op, self.ends_window))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # close()
                self._queue.task_done()
                return
            unit, _, op, _ = item
            try:
                if self._error is None:
                    self._add(*item)
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread by square_sum()
                self._error = e
            finally:
                if op is not None:  # it read the down buffer: the next push may write it
                    self._free[unit].set()
                self._queue.task_done()

    def _add(self, unit, ev, op: Optional[str], last: bool) -> None:
        """One pushed gradient into ``unit``'s accumulator (``op``: "copy", "add", or None where it came down
        straight into it), once its copy (``ev``) is done; on the window's last backward, the accumulator's norm."""
        if ev is not None:
            ev.synchronize()
        acc = self.acc[unit]
        with torch.no_grad():
            if op == "copy":
                acc.copy_(self._down[unit])
            elif op == "add":
                acc.add_(self._down[unit])
        if last:
            self._sq[unit] = square_sum(acc, self._scratch)
        else:
            self._sq.pop(unit, None)

    def square_sum(self) -> float:
        """At the step: every push of the window added up, and the squared norm of every host accumulator (a
        unit no backward of the window reached holds zeros). NaN if the thread failed (``error()`` says why: the
        caller raises on every rank after the norm's collective)."""
        self._wait(self._queue.join)
        if self._error is not None:
            return float("nan")
        total = 0.0
        for unit, acc in self.acc.items():
            if self._count[unit] == 0:
                self._wait_update(unit)
                acc.zero_()
                self._sq[unit] = 0.0
            elif unit not in self._sq:  # the window ended without a backward that said so (no_sync, then step)
                self._sq[unit] = square_sum(acc, self._scratch)
            total += self._sq[unit]
        return total

    def drain(self) -> None:
        """Every gradient pushed so far added into its accumulator: from here until the next backward pushes, the
        accumulators are final (what a host update reads). The step calls it before any host update starts."""
        self._wait(self._queue.join)

    def drained(self) -> bool:
        return self._queue.unfinished_tasks == 0

    def forget_norms(self) -> None:
        """An accumulator was written from outside (``safe_set_full_grad``): its norm is taken again at the step."""
        self._sq = {u: v for u, v in self._sq.items() if self._count[u] == 0}

    def _wait(self, block) -> None:
        t0 = time.perf_counter()
        block()
        self.waited_s += time.perf_counter() - t0

    def reset(self) -> None:
        """After the step: the next window starts (the accumulators keep their values for the host update)."""
        self._queue.join()
        self._count = dict.fromkeys(self.acc, 0)
        self._sq.clear()

    def error(self) -> str:
        """Why the thread failed ('' when it did not)."""
        return "" if self._error is None else f"lins: adding gradients on the host failed: {self._error!r}"

    def close(self) -> None:
        """The thread ends (idempotent); the buffers go with this object (a re-layout, or another placement, builds
        new ones)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._queue.join()


class HostGradSlot:
    """One unit's part of ``HostGrads``, what the unit holds while its G lives on the host: its accumulator, and
    ``push`` for each micro-batch's reduced chunk."""

    def __init__(self, grads: HostGrads, unit):
        self._grads, self._unit = grads, unit
        self.acc = grads.acc[unit]

    def push(self, src: torch.Tensor) -> None:
        self._grads.push(self._unit, src)


class HostParams:
    """The P chunks of the units whose parameters live on the host (the plan's ``offload_params``; only where s_p =
    s_os, so that the host optimizer writes the P chunk itself and no P-sync follows): pinned, and before each use
    uploaded on a stream of their own — then all-gathered over the P group where s_p > 1 — into the unit's full
    buffer (docs/design.md §13). The host optimizer writes a unit's P chunk only after the step's events, which
    follow every use of its last upload."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return host_empty(n, dtype, self.device)

    def upload(self, chunk: torch.Tensor, dst: Optional[torch.Tensor], then=None) -> "_Uploaded":
        """Launch the copy of the host ``chunk`` up, on this stream: into ``dst`` (the unit's full buffer, allocated
        by the caller), or into a device buffer of its own that ``then(src)`` (the unit's AllGather, where s_p > 1)
        reads on the same stream; a handle whose ``wait()`` orders the current stream after both. The collective
        is the caller's (``Unit``): this class only copies."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the full buffer's memory is free there
        with torch.cuda.stream(self.stream):
            work = None
            if dst is not None:
                dst.copy_(chunk, non_blocking=True)
            else:
                src = torch.empty(chunk.numel(), dtype=chunk.dtype, device=self.device)
                src.copy_(chunk, non_blocking=True)
                work = then(src)
            done = torch.cuda.Event()
            done.record(self.stream)
        return _Uploaded(done, work, self.device)


class _Uploaded:
    """An upload (and its gather) in flight: ``wait()`` orders the current stream after both."""

    def __init__(self, done, work, device):
        self.done, self.work, self.device = done, work, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.done)
        if self.work is not None:
            self.work.wait()


class HostSlice:
    """One offloaded piece of an ``OSRange``: its pinned gradient (down at the step; where the unit's G lives on the
    host, a view into its accumulator), its parameter-dtype copy (up)."""

    def __init__(self, master, device: torch.device, grads_on_host: bool):
        self.master = master  # a MasterSlice whose param lives on the host
        n, dtype = master.param.numel(), master.range.unit.dtype
        unit = master.range.unit
        self.on_host = grads_on_host
        self.grad = master.range.grads() if self.on_host else host_empty(n, unit.accum_dtype, device)
        # the parameter-dtype copy that goes up: none for fp32 parameters (the master goes up) or for a unit whose P
        # is on the host (the master is cast straight into it)
        self.up = None if dtype == torch.float32 or unit.host_params is not None else host_empty(n, dtype, device)


class HostTicket:
    """One unit's host update of one step, what the unit holds while UPDATING (not the updater): the worker marks it
    done, with the event of the upload it launched; the unit's next use waits on it. Written by the worker only
    before ``done`` is set, read by the training thread only after."""

    def __init__(self, updater: "HostUpdater", unit_name: str):
        self._updater, self.unit_name = updater, unit_name
        self._done = threading.Event()
        self._upload = None  # the CUDA event of the upload (None on a CPU device)

    def finish(self, upload) -> None:
        """The worker: this unit's update is written and its upload (``upload``, an event or None) launched."""
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
            torch.cuda.current_stream(self._updater.device).wait_event(self._upload)
            self._upload = None


class HostUpdater:
    """Runs the offloaded units' updates on a worker thread, in forward order; each unit's next use waits for its
    own (``Unit.begin_host_update`` with the unit's ``HostTicket``)."""

    def __init__(self, host_optimizer: HostOptimizer, slices_by_unit: list, device: torch.device,
                 grads: Optional[HostGrads] = None):
        """``grads``: the host G accumulators, where the plan keeps the units' gradients on the host (read in place)."""
        self.opt, self.device, self._grads = host_optimizer, device, grads
        held = set(grads.units()) if grads is not None else set()
        self.by_unit = [(unit, [HostSlice(m, device, unit in held) for m in masters])
                        for unit, masters in slices_by_unit]
        self._ticket_of: dict = {}  # unit -> its ticket of the last step
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.coef = host_empty(1, torch.float32, device)
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

    def units(self) -> list:
        return [u for u, _ in self.by_unit]

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
        """Launch every host slice's gradient and the clip coefficient down; one event per unit (None on CPU)."""
        events = []
        cs = self.copy_stream
        if cs is not None:
            cs.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(cs) if cs is not None else nullcontext():
            self.coef.copy_(coef.reshape(1), non_blocking=cs is not None)
            coef_ready = None
            if cs is not None:
                coef.record_stream(cs)
                coef_ready = torch.cuda.Event()
                coef_ready.record(cs)
            for unit, slices in self.by_unit:
                if slices and slices[0].on_host:  # its gradient is on the host already: final once drained
                    if not self._grads.drained():
                        raise RuntimeError(f"lins: the host update of unit {unit.name} would read its gradient "
                                           "before the host has added every micro-batch's (HostGrads.drain() first)")
                    events.append(coef_ready)
                    continue
                for s in slices:
                    s.grad.copy_(s.master.range.grads(), non_blocking=cs is not None)
                if cs is not None:
                    unit.g_acc.record_stream(cs)  # freed after the step; reused only once the copy is done
                    ev = torch.cuda.Event()
                    ev.record(cs)
                    events.append(ev)
                else:
                    events.append(None)
        return events

    def start(self, events: list) -> None:
        """Begin the host updates (after ``download``); each unit enters UPDATING until the worker finishes it."""
        self._tickets = [HostTicket(self, u.name) for u, _ in self.by_unit]
        self._ticket_of = {u: t for (u, _), t in zip(self.by_unit, self._tickets)}
        self._error = None
        hyper = self.opt.hyperparameters()
        for (unit, _), ticket in zip(self.by_unit, self._tickets):
            unit.begin_host_update(ticket)
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._interval, SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, args=(events, hyper), name="lins-host-update", daemon=True)
        self._thread.start()

    def _run(self, events: list, hyper: list) -> None:
        t0 = time.perf_counter()
        spent = dict.fromkeys(("download", "update", "upload"), 0.0)  # the worker's time by what it waited on
        try:
            ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()
            with ctx, torch.no_grad():
                for (unit, slices), ev, ticket in zip(self.by_unit, events, self._tickets):
                    t = time.perf_counter()
                    if ev is not None:
                        ev.synchronize()
                    coef = float(self.coef[0])
                    t, spent["download"] = time.perf_counter(), spent["download"] + time.perf_counter() - t
                    for s in slices:
                        self._update(s, coef, hyper)
                    t, spent["update"] = time.perf_counter(), spent["update"] + time.perf_counter() - t
                    ticket.finish(self._upload(slices))
                    spent["upload"] += time.perf_counter() - t
        except BaseException as e:  # noqa: BLE001 - raised on every rank at the next step boundary (error())
            self._error = e
            for ticket in self._tickets:
                ticket.abandon()
        self.last_update_s, self.last_spent_s = time.perf_counter() - t0, spent
        sys.setswitchinterval(self._interval)

    def _update(self, s: HostSlice, coef: float, hyper: list) -> None:
        update_piece(self.opt, s.master.param, s.grad, s.up, self._scratch, coef, hyper)

    def _upload(self, slices: list):
        """Launch the updated slices' copy up; the event that marks it done (None on a CPU device: synchronous)."""
        cs = self.copy_stream
        with torch.cuda.stream(cs) if cs is not None else nullcontext():
            for s in slices:
                s.master.range.params().copy_(s.up if s.up is not None else s.master.param.data,
                                              non_blocking=cs is not None)
            if cs is None:
                return None
            done = torch.cuda.Event()
            done.record(cs)
            return done

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


class HostOffload:
    """The host side of one plan (docs/design.md §13): the P pool, the G accumulators and their thread, the masters'
    update worker, driven through ``HostProtocol`` (the module docstring). ``LinsRuntime`` owns it and places units
    into it; a unit holds its part (a ``HostTicket`` while UPDATING, the pool its P chunk lives in, the accumulators its
    G goes to), never this object."""

    def __init__(self, device: torch.device, accum_dtype: torch.dtype):
        self.device, self.accum_dtype = device, accum_dtype
        self.protocol = HostProtocol()
        self.params: Optional[HostParams] = None  # made when a unit first keeps its P chunk on the host
        self.grads: Optional[HostGrads] = None
        self.updater: Optional[HostUpdater] = None
        self.optimizer_name = ""
        self._downloads: Optional[list] = None  # start_updates' events, for begin

    # --- placement (the runtime, per plan) ----------------------------------------------------------------------
    def params_pool(self, device: torch.device) -> HostParams:
        """The pool (and upload stream) of the P chunks kept on the host of ``device``."""
        if self.params is None:
            self.params = HostParams(device)
        return self.params

    def place_grads(self, units: list) -> Optional[HostGrads]:
        """The G accumulators of ``units`` on the host (none: no thread); the same units keep theirs."""
        if self.grads is not None and self.grads.units() == units:
            return self.grads
        if self.grads is not None:
            self.grads.close()
            self.grads = None
        if units:
            self.grads = HostGrads(units, self.accum_dtype, self.device, self.protocol, self._wait_update)
        return self.grads

    def _wait_update(self, unit) -> None:
        if self.updater is not None:
            self.updater.wait_unit(unit)

    def place_updater(self, basic, kind: str, slices_by_unit: list) -> None:
        """The worker over ``slices_by_unit`` ([(unit, its host master slices)]; none: no worker), its optimizer the
        engine's ``basic`` one's hyperparameters with a CPU implementation of ``kind`` ("torch" or "deepspeed")."""
        self.updater, self.optimizer_name = None, ""  # its pinned copies go with the slices that moved
        if not slices_by_unit:
            return
        masters = [s for _, slices in slices_by_unit for s in slices]
        by_group = [[s.param for s in masters if s.range.group == gi] for gi in range(len(basic.param_groups))]
        opt = HostOptimizer(basic, by_group, kind, self.device)
        self.updater, self.optimizer_name = HostUpdater(opt, slices_by_unit, self.device, self.grads), opt.name

    # --- the protocol (one step) ----------------------------------------------------------------------------------
    def drain_grads(self) -> None:
        """Every gradient pushed so far added into its host accumulator: final until the update reads it."""
        self.protocol.advance("drain_grads")
        if self.grads is not None:
            self.grads.drain()

    def start_updates(self, coef: torch.Tensor) -> None:
        """The clip coefficient, and the host units' gradients still on the device, down on the copy stream."""
        self.protocol.advance("start_updates")
        self._downloads = self.updater.download(coef) if self.updater is not None else None

    def begin(self) -> None:
        """Each host unit UPDATING, holding its ticket (at rest: the caller released what was gathered); the worker
        starts. Each unit's next use finishes its own update (``Unit.finish_host_update``)."""
        self.protocol.advance("begin")
        if self.updater is not None:
            self.updater.start(self._downloads)
        self._downloads = None

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
