"""The gradients of the units whose G lives on the host (docs/design.md §13): their accumulators in the offload tier
(``HostGrads``, part of the runtime's ``HostOffload``), the thread that adds each micro-batch's gradient into them,
and what one unit holds of them (``HostGradSlot``). Every buffer and copy goes through the tier (``storage.Tier``)."""
from __future__ import annotations

import queue
import threading
import time
from typing import Optional

import torch

from ... import comm
from .host_memory import HOST_PIECE, PinnedHost, host_threads, intra_op_threads, square_sum
from .storage import Tier

__all__ = ["HostGradSlot", "HostGrads"]


class HostGrads:
    """The G accumulators of the units whose gradients live on the host (the plan's ``placement.g``), in the
    offload tier (pinned host memory), and the thread that adds each micro-batch's gradient into them
    (docs/design.md §13).

    ``push`` (the training thread, as a unit's reduction completes in a backward) sends the unit's reduced chunk
    down on its lane (a copy stream): straight into the accumulator where it is the window's first and of its
    dtype, else into the unit's down buffer, which the thread adds (or copies, converting) into the accumulator. On
    the backward that ends the window the thread then takes the accumulator's squared norm, so that the step finds
    the global gradient norm without another pass over host memory. Only layouts without a replica AllReduce place
    G here (``lins_ds.plan.offload.grads_may_leave``): the chunk that comes down is final for this micro-batch."""

    def __init__(self, units: list, accum_dtype: torch.dtype, device: torch.device, protocol=None, wait_update=None,
                 tier: Optional[Tier] = None):
        """``protocol``: its ``HostOffload``'s (``offload.HostProtocol``): a push is one of its transitions (None,
        a HostGrads on its own: every push allowed, as in a fresh protocol). ``wait_update(unit)``: block until the
        last host update of ``unit`` is done with its accumulator (its ``HostOffload`` asks the update's ticket; None:
        nothing to wait for). ``tier``: where the accumulators live (None: ``PinnedHost``)."""
        self.device, self.accum_dtype = device, accum_dtype
        self.tier = tier or PinnedHost(device)
        self._advance = protocol.advance if protocol is not None else (lambda transition: None)
        self._wait_update = wait_update or (lambda unit: None)
        self._lane = self.tier.lane()  # the gradients' copies down
        self.acc = {u: self.tier.allocate(u.g_numel, accum_dtype).zero_() for u in units}
        self._down: dict = {}  # unit -> the buffer a micro-batch's gradient lands in before the thread adds it
        self._free = {u: threading.Event() for u in units}  # the thread is done with the unit's down buffer
        for ev in self._free.values():
            ev.set()
        self._count = dict.fromkeys(units, 0)  # micro-batches pushed in this window
        self._sq: dict = {}  # unit -> the window's squared norm, once the backward that ends it pushed the unit
        self._final = {u: threading.Event() for u in units}  # set once the window's last push of the unit is added
        self._scratch = torch.empty(min(HOST_PIECE, max((a.numel() for a in self.acc.values()), default=0)),
                                    dtype=torch.float32)
        self._queue: "queue.Queue" = queue.Queue()
        self.threads = host_threads(comm.local_world_size())  # its sums run beside the training thread's backward
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
        self._advance("push")
        first = self._count[unit] == 0
        if first:  # the last step's host update of this unit reads the accumulator: done with it first
            self._wait_update(unit)
            self._final[unit].clear()
        direct = first and src.dtype == self.accum_dtype
        if direct:
            dst = self.acc[unit]
        else:
            self._wait(self._free[unit].wait)
            if unit not in self._down:
                self._down[unit] = self.tier.allocate(src.numel(), src.dtype)
            dst = self._down[unit]
            self._free[unit].clear()
        self._lane.follow()  # src was written on the current stream
        ev = self._lane.download([(dst, src)], keep=(src,))
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
                    with intra_op_threads(self.threads):  # per item: torch's default for new threads stays its own
                        self._add(*item)
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread by square_sum()
                self._error = e
                for ev in self._final.values():  # whoever waits for a final accumulator stops waiting
                    ev.set()
            finally:
                if op is not None:  # it read the down buffer: the next push may write it
                    self._free[unit].set()
                self._queue.task_done()

    def _add(self, unit, ev, op: Optional[str], last: bool) -> None:
        """One pushed gradient into ``unit``'s accumulator (``op``: "copy", "add", or None where it came down
        straight into it), once its copy (``ev``, a ``storage.Copied``) is done; on the window's last backward, the
        accumulator's norm."""
        ev.synchronize()
        acc = self.acc[unit]
        with torch.no_grad():
            if op == "copy":
                acc.copy_(self._down[unit])
            elif op == "add":
                acc.add_(self._down[unit])
        if last:
            self._sq[unit] = square_sum(acc, self._scratch)
            self._final[unit].set()
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

    def wait_final(self, unit) -> None:
        """(A host thread) block until the window's last push of ``unit`` is added: its accumulator is final (an update
        inside the last backward reads it then). Returns at once where the thread failed (``error()`` says why)."""
        self._final[unit].wait()

    def is_final(self, unit) -> bool:
        """Whether ``wait_final(unit)`` would return at once."""
        return self._final[unit].is_set()

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

