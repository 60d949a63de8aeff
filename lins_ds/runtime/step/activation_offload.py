"""Activation offload: the inputs a checkpointed layer keeps for its recompute, held in host memory between the
layer's forward and its backward (docs/design.md §8; issue 60).

A checkpointed layer keeps nothing of its forward but its inputs (seq x hidden per layer: at long sequences the
largest term a plan with every layer checkpointed has left). torch's checkpoint saves those inputs through autograd's
saved-tensor hooks — ``_NoopSaveInputs`` in the non-reentrant mode, ``ctx.save_for_backward`` in the reentrant one —
under whatever hooks are open around the checkpoint call, and saves everything inside the layer under its own. So a
``torch.autograd.graph.saved_tensors_hooks`` context around one layer's checkpoint call sees exactly that layer's
inputs, which is what transformers' ``activation_checkpointing_enable(offload=True)`` does with torch's ``save_on_cpu``.
``save_on_cpu`` brings each input back when the recompute asks for it, on the compute stream, so every upload stalls
the backward. Here each offloaded layer's inputs go down on a copy stream of their own as the layer's forward starts
(overlapping it), and come back one layer ahead: when layer i's recompute takes its inputs, the upload of the next
offloaded layer below it starts on the copy stream, overlapping layer i's recompute and backward; the compute stream
waits for an upload only where it uses it. ``ActivationOffload.prefetch_newest`` starts the topmost one, for an owner
that knows when the backward begins. A layer's input is freed on the device once its copy down is done
(``record_stream``): where a layer's forward is shorter than that copy (a small hidden size, a slow host link), the
inputs wait on the device for the copy stream to catch up, and the memory saved comes later in the forward. On a
device without streams (CPU) both copies are plain copies, so the CPU tests run the same code.

What is offloaded: a layer's floating-point inputs that require grad — the residual stream, a tensor of its own per
layer that nothing else holds once the next layer has run. Inputs that do not (attention masks, rotary tables, position
ids) are model-wide and held by the model for the whole step: a host copy of them would free nothing, so they stay as
they are. Layer 0's input does not require grad where the embedding is frozen and nothing enables input gradients
(transformers' checkpointing does): it then stays on the device. Where the layer's checkpoint function offloads
already (transformers' ``offload=True``: ``save_on_cpu`` inside it, nearer the checkpoint than this), that function
takes the inputs and this offload sees none of them.

Host memory (pinned on GPUs) comes from a pool of exact-size buffers (``host_memory.host_empty``) reused step after
step: torch's pinned caching allocator rounds every block up to a power of two, up to twice the seq x hidden bytes per
layer (a 300k-token Llama-8B layer input of 2.5 GB would hold 4 GiB). A buffer goes back to the pool when autograd
frees the layer's graph; one copy stream carries both directions, so a buffer reused while an upload may still read it
is written only after that upload (stream order), with no event to track. A new buffer larger than every idle one
frees the idle ones (they belonged to shorter sequences).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .host_memory import host_empty

PREFETCHED_LAYERS = 1  # offloaded layers whose inputs come up ahead of their recompute (the memory model adds them)


@dataclass(frozen=True)
class OffloadStats:
    """What the offload holds and has done: ``host_bytes`` the host buffers of the inputs held now (a reused buffer
    may be larger than its input), ``pool_bytes`` all the host memory it holds (those and idle buffers),
    ``offloaded`` tensors sent down, ``prefetched`` / ``on_demand`` inputs the recompute found already uploaded /
    had to wait for."""
    host_bytes: int
    pool_bytes: int
    offloaded: int
    prefetched: int
    on_demand: int


class _HostPool:
    """Exact-size host buffers (bytes), reused best fit. Thread-safe: buffers come back from autograd's threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list = []  # (nbytes, serial, buffer), sorted
        self._serial = 0
        self.held = 0  # bytes of every buffer the pool owns, in use or idle

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            i = bisect.bisect_left(self._idle, (nbytes, -1))
            if i < len(self._idle):
                return self._idle.pop(i)[2]
            self.held -= sum(b.numel() for _, _, b in self._idle)
            self._idle.clear()  # all smaller than this one: a shorter sequence's
            self.held += nbytes
        return host_empty(nbytes, torch.uint8, device)

    def give_back(self, buffers: list) -> None:
        with self._lock:
            for buf in buffers:
                self._serial += 1
                bisect.insort(self._idle, (buf.numel(), self._serial, buf))

    def trim(self) -> None:
        with self._lock:
            self.held -= sum(b.numel() for _, _, b in self._idle)
            self._idle.clear()


class _Entry:
    """One offloaded tensor: its host copy and what rebuilds it on the device; ``device_copy`` once uploaded."""
    __slots__ = ("host", "size", "dtype", "device", "device_copy", "uploaded")

    def __init__(self, host, t: torch.Tensor):
        self.host, self.size, self.dtype, self.device = host, t.size(), t.dtype, t.device
        self.device_copy, self.uploaded = None, None  # uploaded: the copy stream's event (CUDA)


def _dense(size, stride) -> bool:
    """Whether ``stride`` lays ``size`` out without gaps or overlaps (a permutation of a contiguous layout): a copy
    with those strides is a straight copy, and the device copy keeps the layout the layer saw."""
    dims = sorted((st, sz) for sz, st in zip(size, stride) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


class _Stash:
    """What one offloaded layer's forward left on the host. Autograd's saved handles hold it; when autograd frees the
    layer's graph it dies and its buffers go back to the pool (a finalizer: no cycle, so that is at once)."""
    __slots__ = ("owner", "layer", "older", "entries", "_buffers", "__weakref__")

    def __init__(self, owner: "ActivationOffload", layer: int, older: Optional["_Stash"]):
        self.owner, self.layer = owner, layer
        self.older = weakref.ref(older) if older is not None else None  # the offloaded layer just below, same forward
        self.entries: list = []
        buffers: list = []
        weakref.finalize(self, owner._release, buffers)
        self._buffers = buffers

    def put(self, t: torch.Tensor) -> int:
        nbytes = t.numel() * t.element_size()
        buf = self.owner._pool.take(nbytes, t.device)
        self._buffers.append(buf)
        size, stride = (t.size(), t.stride()) if _dense(t.size(), t.stride()) else (t.size(), _contiguous(t.size()))
        host = buf[:nbytes].view(t.dtype).as_strided(size, stride)
        self.owner._copy_down(host, t.detach())
        self.entries.append(_Entry(host, t))
        self.owner._count(offloaded=1, host_bytes=buf.numel())
        return len(self.entries) - 1

    def fetch(self) -> None:
        """Start the upload of every input not on the device (a prefetch: nobody waits here)."""
        for e in self.entries:
            if e.device_copy is None:
                self.owner._copy_up(e)

    def take(self, i: int) -> torch.Tensor:
        """Input ``i`` on the device, for the recompute; starts the upload of the offloaded layer below."""
        e = self.entries[i]
        ahead = e.device_copy is not None
        if not ahead:
            self.owner._copy_up(e)
        self.owner._count(prefetched=int(ahead), on_demand=int(not ahead))
        older = self.older() if self.older is not None else None
        for _ in range(PREFETCHED_LAYERS):
            if older is None:
                break
            older.fetch()
            older = older.older() if older.older is not None else None
        self.owner._wait(e)
        out, e.device_copy, e.uploaded = e.device_copy, None, None  # the recompute's now: freed with it
        return out


def _contiguous(size) -> tuple:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


class _Saved:
    """What autograd holds for one offloaded input (saved-tensor hooks' packed value)."""
    __slots__ = ("stash", "index")

    def __init__(self, stash: _Stash, index: int):
        self.stash, self.index = stash, index


def offloads(t: torch.Tensor) -> bool:
    """Whether an input saved for a layer's recompute goes to the host (the module docstring says why only these)."""
    return t.requires_grad and t.is_floating_point() and t.layout == torch.strided and t.numel() > 0


class ActivationOffload:
    """The host side of activation offload for one model's layers: the copy stream, the host pool, and the chain of
    the last forward's offloaded layers that the backward prefetches along. ``saving(layer)`` is the context one
    layer's checkpoint call runs in; ``OffloadedCheckpoint`` opens it."""

    def __init__(self):
        self._pool = _HostPool()
        self._streams: dict = {}
        self._newest: Optional[weakref.ref] = None
        self._lock = threading.Lock()
        self._counts = {"offloaded": 0, "prefetched": 0, "on_demand": 0, "host_bytes": 0}

    @contextlib.contextmanager
    def saving(self, layer: int):
        """Inside: the inputs a checkpoint call saves for its recompute go to the host, as layer ``layer``'s (the
        index orders the prefetch: a layer below the last one saved starts a new forward's chain)."""
        newest = self._newest() if self._newest is not None else None
        stash = _Stash(self, layer, newest if newest is not None and newest.layer < layer else None)
        self._newest = weakref.ref(stash)

        def pack(t: torch.Tensor):
            return _Saved(stash, stash.put(t)) if offloads(t) else t

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield

    def prefetch_newest(self) -> None:
        """Start uploading the inputs of the last offloaded layer of the last forward (the first the backward
        recomputes), for a caller that knows the backward is about to start."""
        newest = self._newest() if self._newest is not None else None
        if newest is not None:
            newest.fetch()

    def stats(self) -> OffloadStats:
        with self._lock:
            c = dict(self._counts)
        return OffloadStats(host_bytes=c["host_bytes"], pool_bytes=self._pool.held, offloaded=c["offloaded"],
                            prefetched=c["prefetched"], on_demand=c["on_demand"])

    def trim(self) -> None:
        """Free the idle host buffers (the inputs still held keep theirs)."""
        self._pool.trim()

    # --- copies -------------------------------------------------------------------------------------------------
    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        key = device.index if device.index is not None else torch.cuda.current_device()
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=key)
        return self._streams[key]

    def _copy_down(self, host: torch.Tensor, t: torch.Tensor) -> None:
        stream = self._stream(t.device)
        if stream is None:
            host.copy_(t)
            return
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written on the compute stream
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # its memory is not reused before the copy has read it

    def _copy_up(self, e: _Entry) -> None:
        dev = torch.empty_strided(e.size, e.host.stride(), dtype=e.dtype, device=e.device)
        stream = self._stream(e.device)
        if stream is None:
            dev.copy_(e.host)
        else:
            stream.wait_stream(torch.cuda.current_stream(e.device))  # dev's block may be just freed by compute work
            with torch.cuda.stream(stream):
                dev.copy_(e.host, non_blocking=True)
                e.uploaded = torch.cuda.Event()
                e.uploaded.record(stream)
            dev.record_stream(stream)
        e.device_copy = dev

    def _wait(self, e: _Entry) -> None:
        if e.uploaded is not None:
            torch.cuda.current_stream(e.device).wait_event(e.uploaded)

    def _count(self, **deltas) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def _release(self, buffers: list) -> None:
        self._count(host_bytes=-sum(b.numel() for b in buffers))
        self._pool.give_back(buffers)


def _unpack(saved):
    return saved.stash.take(saved.index) if isinstance(saved, _Saved) else saved


class OffloadedCheckpoint:
    """A checkpoint function (``inner``: torch's, or the one the model was given) whose saved inputs ``offload``
    holds on the host as layer ``layer``'s: what ``recompute.apply`` installs in an offloaded layer."""

    def __init__(self, inner: Callable, offload: ActivationOffload, layer: int):
        self.inner, self.offload, self.layer = inner, offload, layer

    def __call__(self, function, *args, **kwargs):
        with self.offload.saving(self.layer):
            return self.inner(function, *args, **kwargs)
