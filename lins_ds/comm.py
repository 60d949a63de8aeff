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
        # where P is partitioned, the calls that gather first meet here (docs/design.md §4): every rank creates them
        self.arrival = Arrival(all_groups(topo, layout, "p"), self.rank, "P group") if layout.p.size > 1 else None
        _world_arrival()  # a save's and a load's (every rank is here)

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
        if self.arrival is not None:
            self.arrival.destroy()
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


ARRIVE_TIMEOUT_ENV = "LINS_ARRIVE_TIMEOUT_S"  # how long a call that gathers waits for the other ranks (``Arrival``)
ARRIVE_TIMEOUT_S = 30.0  # a default of seconds, not NCCL's 10 minutes: a rank left alone in a gather learns it soon
ARRIVAL_GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default: what a training forward may wait (gloo's)


def arrive_timeout() -> float:
    """``LINS_ARRIVE_TIMEOUT_S`` (seconds; 0 turns the arrival check off)."""
    raw = os.environ.get(ARRIVE_TIMEOUT_ENV, "").strip()
    try:
        return float(raw) if raw else ARRIVE_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{ARRIVE_TIMEOUT_ENV}={raw!r}: a number of seconds (0 turns the check off)") from None


class ArrivalError(RuntimeError):
    """A call that every rank of a group must make was not made by every one (raised on each rank that made it)."""


class Arrival:
    """Every rank of a group at the same call before it gathers (docs/design.md §4, "Rank-0-only gathers fail, not
    hang"). Under a plan that partitions P, a forward, ``generate`` and ``state_dict()`` gather over the P group (and a
    save or load agrees over the world): a call some ranks make alone would wait in that collective (NCCL: 10 minutes,
    silently), or, worse, be matched by the other ranks' own gathers of their next training step. So each such call
    first exchanges, over a gloo group of its own (one per P group, or the world; on the host: no device work waits), 4
    integers per rank: which call, when it came, how long it waits, the rank. Every rank decides from the same
    integers, so all of those that came fail together where:

    - the ranks are in different calls (rank 0 in ``generate``, rank 1 in its next training forward): at once;
    - a rank waited ``LINS_ARRIVE_TIMEOUT_S`` (30 s) in vain: it raises then; a rank that comes later receives what
      that rank sent (it stays delivered), sees the wait ran out, and raises too.

    A training forward (train mode, gradients on), a save and a load warn after ``LINS_ARRIVE_TIMEOUT_S`` and wait on,
    as long as the group's collectives do (30 minutes): a partner may be legitimately late there (rank 0 logging, or
    writing the Trainer's model files before every rank saves the checkpoint); every other call waits
    ``LINS_ARRIVE_TIMEOUT_S``. After a failure the group is out of step (an exchange abandoned on one rank): it is
    aborted, and every later call on it fails at once. Cost: one gloo AllGather of 4 integers per call, on the host
    (``Executor`` makes it once per optimizer step for training forwards, once per ``generate``)."""

    TRAINING = "forward (training: train mode, gradients on)"
    FORWARD = "forward (evaluation: eval mode or no gradients; generate's steps)"
    GENERATE = "generate()"
    STATE_DICT = "state_dict()"
    SAVE = "save_checkpoint()"
    LOAD = "load_checkpoint()"
    CALLS = (TRAINING, FORWARD, GENERATE, STATE_DICT, SAVE, LOAD)
    # calls a rank may legitimately wait long at (its partner busy alone: rank 0 writing the Trainer's model files
    # before everyone saves the checkpoint): they warn after LINS_ARRIVE_TIMEOUT_S and wait on; the others fail then
    WAITS_ON = (TRAINING, SAVE, LOAD)

    def __init__(self, groups, rank: int, what: str):
        """``groups``: every group's ranks (each rank creates every group, in this order); ``what`` names them."""
        self.rank, self.what, self.pg, self.members, self.failed = rank, what, None, (), None
        for ranks in groups:
            if len(ranks) == 1:
                continue
            pg = tdist.new_group(sorted(ranks), backend="gloo", timeout=ARRIVAL_GROUP_TIMEOUT)
            if rank in ranks:
                self.pg, self.members = pg, tuple(sorted(ranks))

    @property
    def _who(self) -> str:
        return f"{self.what} (ranks {list(self.members)})"

    def check(self, call: str, fix: str) -> None:
        """Return once every rank of this rank's group is at ``call`` (one of ``CALLS``); else ``ArrivalError`` naming
        the call, the ranks and ``fix``, on every rank that came. Nothing where the check is off."""
        timeout = arrive_timeout()
        if self.pg is None or timeout <= 0:
            return
        if self.failed is not None:
            raise ArrivalError(f"lins: {call} on rank {self.rank}: its {self._who} has been out of step since an "
                               f"earlier call failed ({self.failed}); nothing more is issued on it: end the job on "
                               "every rank")
        patience = None if call in self.WAITS_ON else timeout
        mine = torch.tensor([self.CALLS.index(call), int(time.time() * 1000),
                             -1 if patience is None else int(patience * 1000), self.rank], dtype=torch.int64)
        rows = torch.empty(len(self.members) * 4, dtype=torch.int64)
        t0 = time.monotonic()
        try:
            work = _ALL_GATHER(rows, mine, group=self.pg, async_op=True)
            if not _wait(work, timeout, t0):
                if patience is not None:
                    self._abort()  # what this rank sent stays delivered: a rank that comes later reads it
                    self._fail(f"lins: {call} on rank {self.rank}: not every rank of its {self._who} came to it "
                               f"within {patience:g} s ({ARRIVE_TIMEOUT_ENV}). Every one of them must call it: {fix}. "
                               f"A rank that is only late (busy alone, say evaluating or writing files on rank 0) "
                               f"fails this check too: raise {ARRIVE_TIMEOUT_ENV} (0 turns the check off; a missing "
                               "rank then hangs)")
                minutes = ARRIVAL_GROUP_TIMEOUT.total_seconds() / 60
                warnings.warn(f"lins: {call} on rank {self.rank} has waited {timeout:g} s ({ARRIVE_TIMEOUT_ENV}) for "
                              f"the other ranks of its {self._who}; it waits on (a rank may be busy alone), but if "
                              f"they never come (a call some ranks make alone) it fails after {minutes:g} min: {fix}",
                              RuntimeWarning, stacklevel=2)
                work.wait()
        except ArrivalError:
            raise
        except RuntimeError as e:
            self._abort()
            self._fail(f"lins: {call} on rank {self.rank}: another rank of its {self._who} failed, or gave up waiting "
                       f"at a call not every rank made ({str(e).splitlines()[0][:200]})")
        self._decide(call, rows.view(-1, 4).tolist(), fix)

    def _decide(self, call: str, rows: list, fix: str) -> None:
        names = {r: self.CALLS[code] for code, _, _, r in rows}
        if len(set(names.values())) > 1:
            calls = ", ".join(f"rank {r} in {c}" for r, c in sorted(names.items()))
            self._fail(f"lins: the ranks of a {self._who} are in different calls: {calls}. Every one of them must "
                       f"make the same calls, in the same order: {fix}")
        latest = max(t for _, t, _, _ in rows)
        for _, came, waits, r in rows:
            if waits >= 0 and latest - came > waits - min(2000, waits // 4):  # r's own wait ran out (or about to)
                self._fail(f"lins: {call} on rank {self.rank}: rank {r} stopped waiting for the others after "
                           f"{waits / 1000:g} s ({ARRIVE_TIMEOUT_ENV}) and raised; the last rank came "
                           f"{(latest - came) / 1000:.1f} s after it. Every rank of the {self._who} must make this "
                           f"call, at most {ARRIVE_TIMEOUT_ENV} apart: {fix}")

    def _fail(self, message: str) -> None:
        self.failed = self.failed or message.split(". ")[0]
        raise ArrivalError(message)

    def _abort(self) -> None:
        """An exchange this rank abandons would keep gloo's worker (and a later destroy, which joins it) waiting."""
        with contextlib.suppress(Exception):
            self.pg.abort()

    def destroy(self) -> None:
        if self.pg is not None:
            destroy_group(self.pg)
            self.pg = None


def _wait(work, seconds: float, t0: float) -> bool:
    """Wait for ``work`` up to ``seconds`` after ``t0``: whether it completed (False: the time ran out; a failure
    raises)."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
        return True
    except RuntimeError:
        if time.monotonic() - t0 < 0.99 * seconds:  # not the timeout: the exchange itself failed
            raise
        return False


_WORLD_ARRIVAL: dict = {}  # the world group -> an Arrival over every rank (save, load)


def _world_arrival() -> Arrival:
    """An Arrival over every rank, made at the first call under this world (``Groups`` makes that call, where every
    rank is, like ``_cpu_group``)."""
    world = tdist.group.WORLD
    if world not in _WORLD_ARRIVAL:
        _WORLD_ARRIVAL.clear()
        _WORLD_ARRIVAL[world] = Arrival([list(range(world_size()))], rank(), "world")
    return _WORLD_ARRIVAL[world]


def all_ranks_arrive(call: str, fix: str) -> None:
    """Every rank at ``call`` (``Arrival.SAVE``, ``Arrival.LOAD``): a warning after ``LINS_ARRIVE_TIMEOUT_S`` where one
    is missing, ``ArrivalError`` naming ``fix`` where one is in another call, has left, or never comes (``Arrival``)."""
    if world_size() > 1:
        _world_arrival().check(call, fix)


def max_over_world(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.item()


# --- objects and agreement -------------------------------------------------------------------------------
def barrier() -> None:
    tdist.barrier()


def all_gather_object(obj, cpu: bool = False) -> list:
    """Every rank's ``obj``, by rank; ``cpu``: over Lins' own gloo group (``_cpu_group``: no device work)."""
    out = [None] * world_size()
    tdist.all_gather_object(out, obj, group=_cpu_group() if cpu else None)
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
