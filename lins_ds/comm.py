"""The one module that issues collectives and owns process groups (docs/design.md §5).

Everything above it — the profiler, the runtime, the checkpoints — communicates through these
functions. Lins' groups come from the pure layout (``lins_ds.plan.layout``), listed in chunk order;
they are created with ``sort_ranks=False`` because chunk order is not global-rank order in general.
Tensor collectives go through ``deepspeed.comm`` so DeepSpeed's comms logger sees them; a ``Recorder``
(tests, validation) sees every Lins collective with its group kind and byte count, and with
``lins.check_collectives`` (or ``LINS_CHECK_COLLECTIVES=1``) ``Groups`` keeps what this rank issued so that
``check_order`` can hold it against every other rank's.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as tdist
from deepspeed import comm as dist

from .plan import Layout, Topology
from .plan.layout import GROUP_KINDS, all_groups, group_of

SUPPORTS_UNSORTED_GROUPS = "sort_ranks" in inspect.signature(tdist.new_group).parameters

# torch 2.13 deprecates the names DeepSpeed's comm calls (all_gather_into_tensor, reduce_scatter_tensor);
# the warning, once per process, is DeepSpeed's to act on, not the user's.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                        r"is deprecated", category=FutureWarning)
# torch 2.13 renamed the tensor collectives; older torch has only the old names
_ALL_GATHER = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor

# Processes per node as each launcher says it: torchrun and accelerate (LOCAL_WORLD_SIZE), DeepSpeed's
# launcher (LOCAL_SIZE), MPI launchers (Intel MPI / MPICH, Open MPI, MVAPICH).
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                   "MV2_COMM_WORLD_LOCAL_SIZE")


# --- the launch ---------------------------------------------------------------------------------------
def rank() -> int:
    return tdist.get_rank()


def world_size() -> int:
    return tdist.get_world_size()


def backend() -> str:
    return tdist.get_backend()


def local_world_size() -> int:
    """GPUs per node as the launcher says; without a launcher variable, the visible GPUs (1 on CPU)."""
    for var in LOCAL_SIZE_VARS:
        if os.environ.get(var):
            return int(os.environ[var])
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def set_virtual_node(gpus_per_node: int) -> None:
    """Give this process the NCCL_HOSTID of its virtual node (docs/design.md §11): NCCL then uses its network
    transport between virtual nodes of ``gpus_per_node`` ranks on one host. Before the process group exists."""
    os.environ["NCCL_HOSTID"] = f"lins-virtual-node-{int(os.environ.get('RANK', '0')) // gpus_per_node}"


# --- recording (tests and validation) -------------------------------------------------------------------
@dataclass
class Recorder:
    calls: list = field(default_factory=list)  # (op, group kind, bytes)

    def counts(self) -> dict:
        out: dict = {}
        for op, kind, nbytes in self.calls:
            out[(op, kind, nbytes)] = out.get((op, kind, nbytes), 0) + 1
        return out


_recorder: Optional[Recorder] = None


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


# --- the collective-order check (debug) ----------------------------------------------------------------
CHECK_ENV = "LINS_CHECK_COLLECTIVES"


class CollectiveOrderError(RuntimeError):
    """The ranks issued different collectives on a group: raised on every rank, after comparing."""


@dataclass(frozen=True)
class Issued:
    """One Lins collective as this rank issued it."""

    op: str
    kind: str  # the group kind
    tag: str  # what it moves: a unit's name, "grad-norm"
    numel: int
    dtype: str

    def __str__(self) -> str:
        return f"{self.op} of {self.tag} ({self.numel} x {self.dtype})"


def check_requested() -> bool:
    return os.environ.get(CHECK_ENV, "").lower() not in ("", "0", "false", "no")


def first_mismatch(logs: list) -> Optional[str]:
    """Where the ranks' logs (lists of ``Issued``, by rank) first differ on some group kind, or None. Every rank
    runs the same schedule, so each kind's sequence must be the same on all of them; only the interleaving
    of different kinds may differ (they are different process groups)."""
    kinds = sorted({e.kind for log in logs for e in log})
    worst = None
    for kind in kinds:
        seqs = [[e for e in log if e.kind == kind] for log in logs]
        for r, seq in enumerate(seqs[1:], start=1):
            n = next((i for i, (a, b) in enumerate(zip(seqs[0], seq)) if a != b), min(len(seqs[0]), len(seq)))
            if n == len(seqs[0]) == len(seq) or (worst is not None and n >= worst[0]):
                continue
            show = lambda q: str(q[n]) if n < len(q) else "nothing"  # noqa: E731
            worst = (n, f"the ranks' collectives on their {kind!r} groups differ at #{n + 1}: {show(seqs[0])} on "
                        f"rank 0, {show(seq)} on rank {r}")
    return None if worst is None else worst[1]


# --- Lins' process groups ------------------------------------------------------------------------------
def new_group(ranks: list):
    """A process group of ``ranks`` in the order given (every rank must call it, in the same order)."""
    if list(ranks) == sorted(ranks):
        return tdist.new_group(list(ranks))
    return tdist.new_group(list(ranks), sort_ranks=False)  # validated up front: only where torch supports it


def destroy_group(pg) -> None:
    """Destroy one group. Gloo joins its worker threads here, while the interpreter is alive; left to
    interpreter teardown they can abort the process."""
    with contextlib.suppress(Exception):
        tdist.destroy_process_group(pg)


class Groups:
    """This rank's Lins process groups, one per kind (None where the group is this rank alone)."""

    def __init__(self, topo: Topology, layout: Layout, check_order: bool = False):
        self.topo, self.layout = topo, layout
        self.rank = rank()
        self.destroyed = False
        self.issued: Optional[list] = [] if check_order else None  # what this rank issued since the last check
        self._pg: dict = {}
        self.members: dict = {}
        _cpu_group()  # made here, where every rank is, for the agreements outside any collective schedule
        for kind in GROUP_KINDS:
            for ranks in all_groups(topo, layout, kind):  # every rank creates every group, same order
                if len(ranks) == 1:
                    continue
                pg = new_group(list(ranks))
                if self.rank in ranks:
                    self._pg[kind] = pg
            self.members[kind] = group_of(topo, layout, kind, self.rank)
        # test-only: LINS_TEST_INTER_NODE_DELAY_S makes every collective whose group spans nodes wait first (gloo's
        # "inter-node" traffic is the same loopback as intra-node; the tuner's tests need slow links to find)
        delay = float(os.environ.get("LINS_TEST_INTER_NODE_DELAY_S", "0") or 0)
        node = lambda r: r // topo.gpus_per_node  # noqa: E731
        self._delay = {kind: delay for kind, ranks in self.members.items()
                       if delay > 0 and len({node(r) for r in ranks}) > 1}
        if delay > 0 and topo.nodes > 1:
            self._delay["world"] = delay

    def size(self, kind: str) -> int:
        return len(self.members[kind])

    def pg(self, kind: str):
        if self.destroyed:  # never fall back to the world group (pg=None) after a destroy
            raise RuntimeError("lins: the engine's process groups were destroyed (engine.destroy()); "
                               "build a new engine to train again")
        return self._pg.get(kind)

    def note(self, op: str, kind: str, t: torch.Tensor, tag: str) -> None:
        """Called by every collective below just before it is issued."""
        if self._delay.get(kind):
            time.sleep(self._delay[kind])
        _record(op, kind, t)
        if self.issued is not None:
            self.issued.append(Issued(op, kind, tag, t.numel(), str(t.dtype).replace("torch.", "")))

    def destroy(self) -> None:
        """Destroy this rank's groups (idempotent)."""
        for pg in self._pg.values():
            destroy_group(pg)
        self._pg.clear()
        self.destroyed = True


# --- Lins' tensor collectives ------------------------------------------------------------------------------
def all_gather(groups: Groups, kind: str, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False,
               tag: str = ""):
    """Gather ``inp`` of every member into ``out`` in group order. ``inp`` may alias its slot of ``out``.
    The version counter of ``out`` is preserved: autograd may hold views of it across the gather."""
    if groups.size(kind) == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return None
    groups.note("all_gather", kind, out, tag)
    with torch.autograd._unsafe_preserve_version_counter(out):
        return dist.all_gather_into_tensor(out, inp, group=groups.pg(kind), async_op=async_op)


def reduce_scatter(groups: Groups, kind: str, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False,
                   tag: str = ""):
    """Sum ``inp`` over the group; member i receives chunk i in ``out``."""
    if groups.size(kind) == 1:
        out.copy_(inp)
        return None
    groups.note("reduce_scatter", kind, inp, tag)
    return dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, group=groups.pg(kind), async_op=async_op)


def all_reduce(groups: Groups, kind: str, t: torch.Tensor, op=None, async_op: bool = False, tag: str = ""):
    """Sum (or ``op``) ``t`` in place over the group kind, or over the world for kind "world"."""
    op = dist.ReduceOp.SUM if op is None else op
    if kind == "world":
        if world_size() == 1:
            return None
        groups.note("all_reduce", kind, t, tag)
        return dist.all_reduce(t, op=op, async_op=async_op)
    if groups.size(kind) == 1:
        return None
    groups.note("all_reduce", kind, t, tag)
    return dist.all_reduce(t, op=op, group=groups.pg(kind), async_op=async_op)


# --- the profiler's timed collectives (plain torch.distributed on a given group) ---------------------------
def timed_collective(op: str, out: torch.Tensor, inp: torch.Tensor, pg, src: int) -> None:
    """One ``op`` ("all_gather", "reduce_scatter", "all_reduce", "broadcast") on ``pg``, synchronous."""
    if op == "all_gather":
        _ALL_GATHER(out, inp, group=pg)
    elif op == "reduce_scatter":
        _REDUCE_SCATTER(out, inp, group=pg)
    elif op == "all_reduce":
        tdist.all_reduce(out, group=pg)
    else:
        tdist.broadcast(out, src=src, group=pg)


_CPU_GROUP: dict = {}  # the world group -> a gloo group of every rank, for small host-side agreements


def _cpu_group():
    """Every rank in a gloo group of Lins' own (never the world group: a monitored barrier that times out there
    would upset the script's own collectives), created at the first call under this world: every rank must make
    that call at the same point."""
    world = tdist.group.WORLD
    if world not in _CPU_GROUP:
        _CPU_GROUP.clear()
        _CPU_GROUP[world] = tdist.new_group(list(range(world_size())), backend="gloo")
    return _CPU_GROUP[world]


def max_over_world_cpu(x: int) -> int:
    """The largest ``x`` of every rank, agreed over a CPU group: no device work is waited for."""
    if world_size() == 1:
        return int(x)
    t = torch.tensor([int(x)], dtype=torch.int64)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=_cpu_group())
    return int(t.item())


ARRIVE_TIMEOUT_ENV = "LINS_ARRIVE_TIMEOUT_S"  # how long all_ranks_arrive waits for the others (default 600 s:
# NCCL's own default timeout, so ranks merely late, say after an evaluation on rank 0, are not failed)


def all_ranks_arrive(why: str) -> None:
    """Before a collective only some ranks may reach (a gather inside ``state_dict``): wait for every rank at a
    monitored barrier, and where one does not come, raise naming it and ``why``, instead of hanging."""
    if world_size() == 1:
        return
    timeout = float(os.environ.get(ARRIVE_TIMEOUT_ENV, "600") or 600)
    try:
        tdist.monitored_barrier(group=_cpu_group(), timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as e:
        raise RuntimeError(f"lins: not every rank got here within {timeout:g} s ({ARRIVE_TIMEOUT_ENV}): {why}. "
                           f"[{str(e).splitlines()[0]}]") from None


def max_over_world(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.item()


# --- objects and agreement -------------------------------------------------------------------------------
def barrier() -> None:
    tdist.barrier()


def all_gather_object(obj) -> list:
    out = [None] * world_size()
    tdist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank."""
    box = [obj]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def check_order(groups: Groups, when: str) -> None:
    """Hold what this rank issued since the last check against every rank's (all ranks call it at the same
    point); on a difference every rank raises ``CollectiveOrderError`` naming the first one."""
    mine, groups.issued = groups.issued, []
    error = first_mismatch(all_gather_object(mine))
    if error:
        raise CollectiveOrderError(f"lins.check_collectives ({when}): {error}")


def agree(error: Optional[str]) -> Optional[str]:
    """Every rank's outcome of a local step (None = fine, else its error message), combined: every rank
    returns the first error any rank saw, so all of them fail together (none waits in a collective
    another has abandoned)."""
    errors = [e for e in all_gather_object(error) if e]
    return errors[0] if errors else None
