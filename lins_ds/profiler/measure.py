"""Measure collective bandwidth per (intra x inter) mesh, every group of a shape running at once
(docs/design.md §11). Side effects only here; the table and its interpolation are pure (lins_ds.plan.profile_table).

Run by every rank together. Each timing is the slowest rank's (a MAX all-reduce of the elapsed
times), the median over repeats is kept, and the spread is (max - min) / median.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable, Optional

import torch
from .. import comm
from ..plan import Factor, ProfileTable, Topology
from ..plan.profile_table import OPS, Series

FULL = dict(min_bytes=32 * 2**10, max_bytes=1 * 2**30, step=4, warmup=3, repeats=8)
QUICK = dict(min_bytes=64 * 2**10, max_bytes=64 * 2**20, step=8, warmup=1, repeats=3)


def sizes(min_bytes: int, max_bytes: int, step: int) -> list:
    out, s = [], min_bytes
    while s < max_bytes:
        out.append(s)
        s *= step
    return out + [max_bytes]


def mesh_groups(topo: Topology, mesh: Factor) -> list:
    """Groups of ``mesh.intra`` local ranks on ``mesh.inter`` nodes, partitioning the world."""
    L = topo.gpus_per_node
    groups: dict = {}
    for r in range(topo.world_size):
        m, l = divmod(r, L)
        groups.setdefault((l // mesh.intra, m // mesh.inter), []).append(r)
    return [sorted(g) for _, g in sorted(groups.items())]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _buffers(op: str, nbytes: int, n: int, device, dtype=torch.bfloat16):
    """(output, input) of one call moving ``nbytes`` in nccl-tests' sense."""
    el = torch.tensor([], dtype=dtype).element_size()
    count = max(n, (nbytes // el) // n * n)
    if op == "all_gather":
        out = torch.empty(count, dtype=dtype, device=device)
        return out, out[: count // n]
    if op == "reduce_scatter":
        inp = torch.empty(count, dtype=dtype, device=device)
        return inp[: count // n].clone(), inp
    t = torch.empty(count, dtype=dtype, device=device)
    return t, t


def time_op(op: str, nbytes: int, pg, members: list, device, warmup: int, repeats: int,
            dtype=torch.bfloat16) -> tuple:
    """(median seconds, spread) of ``op`` on ``pg``; every rank of the world takes part in the timing."""
    out, inp = _buffers(op, nbytes, len(members), device, dtype)
    for _ in range(warmup):
        comm.timed_collective(op, out, inp, pg, members[0])
    samples = []
    for _ in range(repeats):
        _sync(device)
        comm.barrier()
        t0 = time.perf_counter()
        comm.timed_collective(op, out, inp, pg, members[0])
        _sync(device)
        samples.append(comm.max_over_world(time.perf_counter() - t0, device))
    med = statistics.median(samples)
    return med, (max(samples) - min(samples)) / med


def measure(topo: Topology, meshes: Iterable[Factor], device, *, min_bytes: int, max_bytes: int, step: int,
            warmup: int, repeats: int, ops=OPS, meta: Optional[dict] = None,
            progress: Optional[Callable[[str], None]] = None) -> ProfileTable:
    """A ProfileTable of every op over every mesh, at log-spaced sizes."""
    rank = comm.rank()
    series = {}
    size_list = sizes(min_bytes, max_bytes, step)
    for mesh in sorted(set(meshes)):
        if mesh.size == 1:
            continue
        mine = None
        for g in mesh_groups(topo, mesh):  # every rank creates every group, in the same order
            pg = comm.new_group(g)
            if rank in g:
                mine, my_pg = g, pg
        for op in ops:
            times, spreads = [], []
            for s in size_list:
                t, sp = time_op(op, s, my_pg, mine, device, warmup, repeats)
                times.append(t)
                spreads.append(sp)
                if progress:
                    progress(f"{op} {mesh} {s}")
            series[(op, mesh.intra, mesh.inter)] = Series(tuple(size_list), tuple(times), tuple(spreads))
        comm.barrier()  # no rank still uses the group
        comm.destroy_group(my_pg)
    return ProfileTable(dict(meta or {}), series)
