"""Host memory for offload (docs/design.md §13): page-locked buffers for copies to and from a GPU, the tier they make
(``PinnedHost``, the one implementation of ``storage.Tier``), and the host's passes over them that more than one
component takes."""

from __future__ import annotations

import weakref

import torch

from .storage import Lane, StreamLane, SyncLane, Tier

HOST_PIECE = 1 << 25  # elements per host master tensor (128 MiB in fp32): few enough calls that the worker rarely
# waits for the GIL, small enough that the first update starts soon and memory-bound temporaries stay small
SWITCH_INTERVAL_S = 5e-4  # while a host thread works: the training thread hands over the GIL within 0.5 ms, not 5
REGISTER_MIN_BYTES = 1 << 20  # host_empty: smaller pinned buffers come from torch's caching allocator


def host_empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host memory for a copy to or from ``device``: page-locked where the device is a GPU.

    From ``REGISTER_MIN_BYTES`` on, the tensor is allocated pageable and registered with CUDA
    (``cudaHostRegister``, as torch.distributed.checkpoint's stager does) rather than taken from torch's pinned
    caching allocator, which rounds every block up to a power of two: a 113 M-parameter layer's bf16 gradient
    (226 MB) would hold 256 MiB, 4 GiB more host memory over a 2.9 B model's offloaded state. Unlike that
    allocator's blocks, nothing keeps registered memory alive for a copy in flight: when the storage dies (a
    re-layout drops its owner) the device is synchronized before it is unregistered and freed."""
    if device.type != "cuda":
        return torch.empty(n, dtype=dtype)
    if n * dtype.itemsize < REGISTER_MIN_BYTES:
        return torch.empty(n, dtype=dtype, pin_memory=True)
    t = torch.empty(n, dtype=dtype)
    storage = t.untyped_storage()
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes(), 1)  # 1: portable
    if int(err):
        raise RuntimeError(f"lins.offload: page-locking {storage.nbytes() / 2**30:.2f} GiB of host memory failed "
                           f"({cudart.cudaGetErrorString(err)}); lower lins.host_memory_gb or raise the "
                           "locked-memory limit (ulimit -l)")
    finalizer = weakref.finalize(storage, _unregister, storage.data_ptr(), device)
    finalizer.atexit = False  # not after CUDA is gone
    return t


def _unregister(ptr: int, device: torch.device) -> None:
    """A registered buffer's storage died: no copy may still read or write it, then it is unregistered."""
    torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(ptr)


class PinnedHost(Tier):
    """Host memory as offload's tier: page-locked buffers (``host_empty``) that a GPU's copy engines read and write
    while it computes, each client's copies non-blocking on a CUDA stream of its own. On a CPU device the "host" is a
    separate tensor pool on the same memory and its copies are plain and synchronous: the same code paths run, which
    is what the CPU tests check."""

    def __init__(self, device: torch.device):
        self.device = device

    def allocate(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return host_empty(n, dtype, self.device)

    def lane(self) -> Lane:
        return StreamLane(self.device) if self.device.type == "cuda" else SyncLane()


def square_sum(acc: torch.Tensor, scratch: torch.Tensor) -> float:
    """The squared L2 norm of ``acc``, summed in fp32 piece by piece through ``scratch`` (no fp32 copy of the whole
    chunk)."""
    total = 0.0
    for a in range(0, acc.numel(), HOST_PIECE):
        piece = acc[a:a + HOST_PIECE]
        if piece.dtype != torch.float32:
            piece = scratch[:piece.numel()].copy_(piece)
        total += float(torch.dot(piece, piece))
    return total
