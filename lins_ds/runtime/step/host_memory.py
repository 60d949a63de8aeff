"""Host memory for offload (docs/design.md §13): page-locked buffers for copies to and from a GPU, the tier they make
(``PinnedHost``, the one implementation of ``storage.Tier``), the host's passes over them that more than one
component takes, and the threads those passes run on (``host_threads``, ``intra_op_threads``)."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import weakref

import torch

from .storage import Lane, StreamLane, SyncLane, Tier

HOST_PIECE = 1 << 25  # elements per host master tensor (128 MiB in fp32): few enough calls that the worker rarely
# waits for the GIL, small enough that the first update starts soon and memory-bound temporaries stay small
SWITCH_INTERVAL_S = 5e-4  # while a host thread works: the training thread hands over the GIL within 0.5 ms, not 5
REGISTER_MIN_BYTES = 1 << 20  # host_empty: smaller pinned buffers come from torch's caching allocator
TRAINING_THREAD_CORES = 1  # what each rank's training thread keeps busy while a host thread works beside it
CPU_MAX = "/sys/fs/cgroup/cpu.max"  # a cgroup v2 CPU quota ("max 100000": none)


def usable_cores(cpu_max: str = CPU_MAX) -> int:
    """The cores this process may run on: its affinity, or fewer where a cgroup quota allows less CPU time (a
    container that sees the host's cores but may use a share of them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def host_threads(ranks_per_node: int = 1, cores: int = 0) -> int:
    """Intra-op threads for a host thread's passes (the host update's, the gradient sums'): this rank's share of the
    usable cores (``usable_cores``, shared by the node's ``ranks_per_node`` ranks; where ``OMP_NUM_THREADS`` is set,
    as DeepSpeed's ``--bind_cores_to_rank`` sets it to each rank's cores, torch's count is that share) less the core
    its training thread keeps busy launching the device's work, at most torch's own setting (OMP_NUM_THREADS,
    torch.set_num_threads, a launcher's choice), at least 1.

    Why not torch's setting itself: it is a team of every core, and the training thread runs beside it. One of
    the team's threads then shares a core with the training thread, and each parallel region (every op over a
    piece) ends when that thread is scheduled again, a time slice later. The blocked update runs four such regions
    per cache-sized block, not four per piece, so on a 2-core slice with the training thread busy it ran 2-3x
    slower than the staged update; with the team one core short of the cores, no region waits for a time slice."""
    if cores:  # the node's usable cores, given
        share = cores // max(1, ranks_per_node)
    elif os.environ.get("OMP_NUM_THREADS"):  # a launcher's (or the user's) threads per rank: its share already
        share = torch.get_num_threads()
    else:
        share = usable_cores() // max(1, ranks_per_node)
    return max(1, min(torch.get_num_threads(), share - TRAINING_THREAD_CORES))


@functools.lru_cache(maxsize=None)
def per_thread_counts() -> bool:
    """Whether torch's intra-op thread count is the calling thread's own (the OpenMP backend: each thread that
    calls a parallel op leads a team of its own size). With the native backend every thread shares one pool, whose
    size may not change once it has run: there a host thread keeps torch's setting."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def intra_op_threads(n: int):
    """The calling thread's parallel ops run on ``n`` threads inside the block (where ``per_thread_counts``), then on
    what they ran on before. The training thread's own count is not touched; torch's default for threads that make
    their first parallel call meanwhile is ``n`` (``torch.set_num_threads`` sets both)."""
    before = torch.get_num_threads()
    if n == before or n < 1 or not per_thread_counts():
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
