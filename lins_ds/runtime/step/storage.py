"""The storage seam of offload (docs/design.md §13): the one way the runtime's offload code moves bytes between the
device and a slower tier that holds state off it. ``HostParams``, ``HostGrads`` and ``HostUpdater`` allocate their
tier's buffers and copy through it and never name a stream, an event or a kind of memory, so that a further tier
(NVMe, another card) is one class implementing ``Tier`` (plus its plan and pricing side), not an edit of each of them.

    Tier      allocate(n, dtype)       a buffer of n elements of dtype in the tier
              lane()                   a new ordered queue of copies, one per client: clients never wait on each
                                       other's copies
    Lane      follow()                 later copies start after the work the device's current stream queued so far
              upload(pairs, then)      tier -> device, asynchronous; ``then()`` queued after the copies
              download(pairs, keep)    device -> tier, asynchronous; ``keep``: device memory the copies still read
              issuing()                device work queued inside runs on the lane, in order with its copies
              worker()                 what a thread other than the training thread enters before it copies
              stream                   the device stream the copies run on (None: on the caller's thread, done at
                                       return)
    Copied    wait()                   the device's current stream ordered after the copies (and ``then``'s work)
              synchronize()            this thread blocks until the copies are done (a host thread about to read)

``StreamLane`` and ``SyncLane`` are the two lanes today's tier uses (``host_memory.PinnedHost``); a tier whose memory
the device's copy engines reach (another card's) can use ``StreamLane`` too.
"""
from __future__ import annotations

import abc
from contextlib import nullcontext
from typing import Callable, ContextManager, Optional, Sequence, Tuple

import torch

Pairs = Sequence[Tuple[torch.Tensor, torch.Tensor]]  # (destination, source), copied in this order


class Copied:
    """The point a lane's copies (and the device work queued after them, ``then``) reach: what a consumer waits on.
    A copy made synchronously is ``Copied`` with no event: both waits return at once."""

    __slots__ = ("event", "device", "work")

    def __init__(self, event: Optional[torch.cuda.Event] = None, device: Optional[torch.device] = None, work=None):
        self.event, self.device, self.work = event, device, work

    def wait(self) -> None:
        """The device's current stream ordered after the copies; ``then``'s work (a collective) waited for too."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        if self.work is not None:
            self.work.wait()

    def synchronize(self) -> None:
        """This thread blocks until the copies are done (the host is about to read what came down)."""
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        """Whether the copies are done (without blocking)."""
        return self.event is None or self.event.query()


DONE = Copied()  # copies made at the call (a synchronous lane) with nothing queued after them


class Lane(abc.ABC):
    """One ordered queue of copies between a tier and the device, owned by one client."""

    stream: Optional[torch.cuda.Stream] = None

    @abc.abstractmethod
    def follow(self) -> None:
        """Later copies start after the work the device's current stream queued so far (which wrote their source,
        or last used the memory of their destination)."""

    @abc.abstractmethod
    def issuing(self) -> ContextManager:
        """Device work queued inside (an allocation, a collective) runs on the lane, in order with its copies."""

    @abc.abstractmethod
    def upload(self, pairs: Pairs, then: Optional[Callable[[], object]] = None) -> Copied:
        """Tier -> device: each (device tensor, tier tensor) copied, then ``then()`` (device work that reads what came
        up) queued; the result marks both."""

    @abc.abstractmethod
    def download(self, pairs: Pairs, keep: Sequence[torch.Tensor] = ()) -> Copied:
        """Device -> tier: each (tier tensor, device tensor) copied; the device memory of ``keep`` (the sources, or
        what they view) is not reused until the copies are done, whenever its owner frees it."""

    @abc.abstractmethod
    def worker(self) -> ContextManager:
        """What a thread other than the training thread enters before it copies on this lane."""


class Tier(abc.ABC):
    """A place slower than the device's memory where offload keeps state, and the lanes to and from it."""

    device: torch.device  # the device whose state it holds

    @abc.abstractmethod
    def allocate(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``n`` elements of ``dtype`` in the tier (uninitialised)."""

    @abc.abstractmethod
    def lane(self) -> Lane:
        """A new lane of copies between this tier and its device."""


class StreamLane(Lane):
    """Copies on a CUDA stream of their own, non-blocking: they overlap the compute stream, which waits only where a
    consumer asks (``Copied.wait``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def follow(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def issuing(self) -> ContextManager:
        return torch.cuda.stream(self.stream)

    def upload(self, pairs: Pairs, then: Optional[Callable[[], object]] = None) -> Copied:
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            work = then() if then is not None else None
            return Copied(self._mark(), self.device, work)

    def download(self, pairs: Pairs, keep: Sequence[torch.Tensor] = ()) -> Copied:
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            for t in keep:
                t.record_stream(self.stream)
            return Copied(self._mark(), self.device)

    def worker(self) -> ContextManager:
        return torch.cuda.device(self.device)  # the thread's current device: where its events and copies are made

    def _mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


class SyncLane(Lane):
    """Plain copies, done when the call returns: a tier that is the device's own memory (a CPU device's host pool,
    which runs the same code paths as a GPU's)."""

    def follow(self) -> None:
        pass  # a copy runs after everything this thread did before it

    def issuing(self) -> ContextManager:
        return nullcontext()

    def upload(self, pairs: Pairs, then: Optional[Callable[[], object]] = None) -> Copied:
        for dst, src in pairs:
            dst.copy_(src)
        return Copied(work=then()) if then is not None else DONE

    def download(self, pairs: Pairs, keep: Sequence[torch.Tensor] = ()) -> Copied:
        for dst, src in pairs:
            dst.copy_(src)
        return DONE

    def worker(self) -> ContextManager:
        return nullcontext()
