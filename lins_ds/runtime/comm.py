"""The one module that issues Lins collectives and owns its process groups.

Groups come from the pure layout (``lins_ds.plan.layout``), listed in chunk order; they are created
with ``sort_ranks=False`` because chunk order is not global-rank order in general. Collectives go
through ``deepspeed.comm`` so DeepSpeed's comms logger sees them. A ``Recorder`` (tests, validation)
sees every call with its group kind and byte count.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as tdist
from deepspeed import comm as dist

from ..plan import Layout, Topology
from ..plan.layout import GROUP_KINDS, all_groups, group_of


@dataclass
class Recorder:
    calls: list = field(default_factory=list)  # (op, group kind, bytes)

    def counts(self) -> dict:
        out: dict = {}
        for op, kind, nbytes in self.calls:
            out[(op, kind, nbytes)] = out.get((op, kind, nbytes), 0) + 1
        return out


_recorder: Optional[Recorder] = None
SUPPORTS_UNSORTED_GROUPS = "sort_ranks" in inspect.signature(tdist.new_group).parameters


@contextlib.contextmanager
def recording():
    """Record every Lins collective issued inside the block (this process only)."""
    global _recorder
    prev, _recorder = _recorder, Recorder()
    try:
        yield _recorder
    finally:
        _recorder = prev


def _record(op: str, kind: str, t: torch.Tensor) -> None:
    if _recorder is not None:
        _recorder.calls.append((op, kind, t.numel() * t.element_size()))


class Groups:
    """This rank's Lins process groups, one per kind (None where the group is this rank alone)."""

    def __init__(self, topo: Topology, layout: Layout):
        self.topo, self.layout = topo, layout
        self.rank = dist.get_rank()
        self.destroyed = False
        self._pg: dict = {}
        self.members: dict = {}
        for kind in GROUP_KINDS:
            for ranks in all_groups(topo, layout, kind):  # every rank creates every group, same order
                if len(ranks) == 1:
                    continue
                if list(ranks) == sorted(ranks):
                    pg = tdist.new_group(list(ranks))
                else:  # validated up front: only reached where torch supports it
                    pg = tdist.new_group(list(ranks), sort_ranks=False)
                if self.rank in ranks:
                    self._pg[kind] = pg
            self.members[kind] = group_of(topo, layout, kind, self.rank)

    def size(self, kind: str) -> int:
        return len(self.members[kind])

    def index(self, kind: str) -> int:
        return self.members[kind].index(self.rank)

    def pg(self, kind: str):
        if self.destroyed:  # never fall back to the world group (pg=None) after a destroy
            raise RuntimeError("lins: the engine's process groups were destroyed (engine.destroy()); "
                               "build a new engine to train again")
        return self._pg.get(kind)

    def destroy(self) -> None:
        """Destroy this rank's groups (idempotent). Gloo joins its worker threads here, while the
        interpreter is alive; left to interpreter teardown they can abort the process."""
        for pg in self._pg.values():
            with contextlib.suppress(Exception):
                tdist.destroy_process_group(pg)
        self._pg.clear()
        self.destroyed = True


def all_gather(groups: Groups, kind: str, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
    """Gather ``inp`` of every member into ``out`` in group order. ``inp`` may alias its slot of ``out``.
    The version counter of ``out`` is preserved: autograd may hold views of it across the gather."""
    if groups.size(kind) == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return None
    _record("all_gather", kind, out)
    with torch.autograd._unsafe_preserve_version_counter(out):
        return dist.all_gather_into_tensor(out, inp, group=groups.pg(kind), async_op=async_op)


def reduce_scatter(groups: Groups, kind: str, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
    """Sum ``inp`` over the group; member i receives chunk i in ``out``."""
    if groups.size(kind) == 1:
        out.copy_(inp)
        return None
    _record("reduce_scatter", kind, inp)
    return dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, group=groups.pg(kind), async_op=async_op)


def all_reduce(groups: Optional[Groups], kind: str, t: torch.Tensor, op=None, async_op: bool = False):
    """Sum (or ``op``) ``t`` in place over the group kind, or over the world for kind "world"."""
    op = dist.ReduceOp.SUM if op is None else op
    if kind == "world":
        if dist.get_world_size() == 1:
            return None
        _record("all_reduce", kind, t)
        return dist.all_reduce(t, op=op, async_op=async_op)
    if groups.size(kind) == 1:
        return None
    _record("all_reduce", kind, t)
    return dist.all_reduce(t, op=op, group=groups.pg(kind), async_op=async_op)


def all_gather_object_world(obj) -> list:
    out = [None] * dist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out
