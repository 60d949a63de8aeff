"""One unit's flat buffers and the transitions of its parameters and gradients (docs/design.md §4).

A unit is one repeated layer (a decoder block) or the root (every other trainable parameter). Its
parameters live in one flat buffer, ordered by optimizer param group so that each group is one
contiguous range, and padded so that s_os chunks of ``ALIGN``-multiple length cover it. Offsets of
the chunks this rank owns come from the pure layout; nothing here re-derives the plan.

The unit owns its state; callers ask for transitions, and each transition checks the state it starts from
(``UnitStateError`` otherwise, as FSDP2's ``_assert_in_states``):

    parameters  SHARDED --start_gather--> GATHERING --wait_gather--> GATHERED --release--> SHARDED
                SHARDED --start_param_sync--> SYNCING --wait_param_sync--> SHARDED
                at rest --begin_host_update--> UPDATING --wait_param_sync--> at rest   (OS offloaded: the host
                optimizer writes the P chunk; the unit's next use waits for it, docs/design.md §13)
                (P on the host: at rest SHARDED; start_gather uploads the P chunk, and gathers it where s_p > 1)
                (s_p == 1: GATHERED --start_param_sync--> SYNCING --wait_param_sync--> GATHERED)
    gradients   ACCUMULATING --start_reduce--> REDUCING --finish_reduce--> REDUCED
                (s_g == 1: start_reduce goes straight to REDUCED; G on the host: the reduced chunk goes down to the
                unit's host accumulator, ``HostGrads.push``, docs/design.md §13)
                REDUCED --begin_backward--> ACCUMULATING              (the next micro-batch of the window)
                FINAL --begin_backward--> ACCUMULATING                (another backward over the window's last
                                                                       micro-batch: its sum kept on one replica)
                REDUCED --start_replica_reduce--> REPLICA_REDUCING --finish_replica_reduce--> FINAL
                (one replica: start_replica_reduce goes straight to FINAL)
                ACCUMULATING / REDUCED / FINAL --reset_grads (after the step)--> ACCUMULATING

The optimizer and the checkpoints see a unit only through ``OSRange``: one param group's part of this
rank's OS chunk, its parameter and gradient views, and the parameter names it covers.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from ... import comm
from ...plan import Layout, Topology
from ...plan.layout import chunks
from ..errors import LinsConfigError, UnitStateError

ALIGN = 64  # elements; keeps every chunk 128-byte aligned in 16-bit dtypes


def param_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's shape in the model, also while its unit is released (then ``p`` itself is empty, its shape kept
    in ``ds_shape`` as ZeRO-3 keeps a partitioned parameter's)."""
    return getattr(p, "ds_shape", p.shape)


class ParamState(enum.Enum):
    SHARDED = "sharded"  # only the P chunk is materialised (s_p > 1)
    GATHERING = "gathering"  # an AllGather into the full buffer is in flight (prefetch)
    GATHERED = "gathered"  # the full buffer is materialised; parameters are views into it
    SYNCING = "syncing"  # after the update, the P chunk is being rebuilt from the OS chunks (P-sync in flight)
    UPDATING = "updating"  # the host optimizer is updating this unit (OS offloaded); not yet on the device


class GradState(enum.Enum):
    ACCUMULATING = "accumulating"  # this backward's gradients are arriving in the parameters' .grad
    REDUCING = "reducing"  # their ReduceScatter is in flight (s_g > 1)
    REDUCED = "reduced"  # this backward's gradient is in the G accumulator
    REPLICA_REDUCING = "replica-reducing"  # the window's G chunk is being all-reduced over its replicas
    FINAL = "final"  # the window's gradient, summed over every rank, is in the G accumulator


@dataclass(frozen=True)
class Slot:
    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    group: int  # optimizer param-group index


@dataclass(frozen=True)
class ChunkSpec:
    """Element ranges [start, start + size) of this rank's chunks, in unit coordinates."""

    padded: int
    p_start: int
    p_size: int
    g_start: int
    g_size: int
    os_start: int
    os_size: int

    @classmethod
    def make(cls, numel: int, topo: Topology, layout: Layout, rank: int) -> "ChunkSpec":
        s_p, s_g, s_os = layout.sharding()
        os_size = -(-max(numel, 1) // (s_os * ALIGN)) * ALIGN
        padded = os_size * s_os
        c = chunks(topo, layout, rank)
        p_size, g_size = padded // s_p, padded // s_g
        return cls(padded, c.p * p_size, p_size, c.g * g_size, g_size, c.os * os_size, os_size)


@dataclass(frozen=True)
class OSRange:
    """One optimizer param group's part [lo, hi) (unit coordinates) of a unit's OS chunk on this rank."""

    unit: "Unit"
    group: int
    lo: int
    hi: int

    def params(self) -> torch.Tensor:
        """The parameters of the range (a view into the P storage: the optimizer writes updates here)."""
        return self.unit.p_storage[self.lo - self.unit.p_base:self.hi - self.unit.p_base]

    def grads(self) -> torch.Tensor:
        """The window's accumulated gradient of the range (a view into the G accumulator)."""
        return self.unit.g_acc[self.lo - self.unit.g_base:self.hi - self.unit.g_base]

    def pieces(self, size: int) -> list:
        """The range cut into consecutive ranges of at most ``size`` elements."""
        return [OSRange(self.unit, self.group, a, min(a + size, self.hi)) for a in range(self.lo, self.hi, size)]

    def by_parameter(self) -> Iterator[tuple]:
        """(parameter name, [a, b) within the parameter, [s, e) within the range) for each parameter it covers."""
        for slot, ab, se in self.unit.slices_by_parameter(self.lo, self.hi):
            yield slot.name, ab, se


class Unit:
    """One unit's storage and state. ``full`` holds the gathered parameters (always, when s_p == 1);
    ``p_shard`` the P chunk when s_p > 1; ``g_acc`` the accumulated G chunk (the whole unit when s_g == 1)."""

    def __init__(self, name: str, slots: list, spec: ChunkSpec, layout: Layout, groups: comm.Groups,
                 accum_dtype: torch.dtype, reduce_dtype: torch.dtype, modules: Optional[list] = None,
                 materializer=None, device: Optional[torch.device] = None, is_root: bool = False):
        self.name, self.slots, self.spec, self.modules, self.is_root = name, slots, spec, modules or [], is_root
        self.groups, self._reduce_dtype = groups, reduce_dtype
        self.sharded_p, self.sharded_g = layout.p.size > 1, layout.g.size > 1
        dtypes, devices = {s.param.dtype for s in slots}, {s.param.device for s in slots}
        if len(dtypes) != 1 or len(devices) != 1:
            raise LinsConfigError(f"lins: unit {name} mixes dtypes {sorted(map(str, dtypes))} or devices; "
                                  "every trainable parameter of a unit must share dtype and device")
        self.dtype, self.device = dtypes.pop(), devices.pop()
        if self.device.type == "meta":  # built under lins_ds.init: materialised here, one unit at a time
            self.device = device
        self.numel = sum(s.numel for s in slots)
        # a deferred root unit (embeddings and heads: often the largest) with P sharded is never written whole:
        # its P chunk is filled module by module (the full buffer, never touched, only gives the parameters
        # their views); a layer unit is filled through its buffer, one unit at a time (docs/design.md §10)
        by_module = materializer is not None and self.sharded_p and is_root
        self.full = (torch.empty if by_module else torch.zeros)(spec.padded, dtype=self.dtype, device=self.device)
        self.p_shard = (torch.zeros(spec.p_size, dtype=self.dtype, device=self.device) if by_module else None)
        with torch.no_grad():
            for i, s in enumerate(slots):
                view = self.full[s.offset:s.offset + s.numel].view(s.shape)
                if s.param.is_meta:  # a new Parameter takes the meta one's places in the model
                    slots[i] = dataclasses.replace(s, param=materializer.materialise(s.param, view))
                elif by_module:
                    self.p_shard_write(s, s.param.data.reshape(-1))
                    s.param.data = view
                else:
                    view.copy_(s.param.data)
                    s.param.data = view
            if by_module:
                materializer.fill_shard(self)
            elif materializer is not None:
                materializer.fill(self)
        if self.sharded_p and not by_module:
            self.p_shard = self.full[spec.p_start:spec.p_start + spec.p_size].clone()
        # s_g == 1 and gradients accumulate in the parameter dtype: each .grad is a view into the accumulator, so
        # autograd accumulates in place and nothing is copied (DDP's gradient_as_bucket_view)
        self.accum_dtype, self._g_acc, self._grad_views = accum_dtype, None, None
        self._host_grads = self._host_params = None  # where the plan puts G or P on the host (``host_grads``)
        self._param_state, self._grad_state = ParamState.GATHERED, GradState.ACCUMULATING
        self._pending: set = set()  # parameters whose gradient arrived in this backward, or will get none
        self._no_grad: set = set()  # parameters this backward does not reach (counted in _pending)
        self._gather_work = self._sync_work = self._replica_work = None
        self._ticket = None  # the HostTicket of the host update writing this unit's P chunk (UPDATING)
        self._reduce = None  # (work, output) of an in-flight ReduceScatter
        self._replica_tmp = None  # the reduce-dtype copy an in-flight replica AllReduce works on
        self._grads_attached = False
        self._held = 0  # holds on the gathered parameters (``hold``): a release waits for none left
        self._holds: list = []  # per hold: whether the unit was already gathered for use when it came
        self._status = None  # (available, not available): what ``ds_status`` says as the parameters show
        self.release()

    def _expect(self, state, allowed: tuple, transition: str) -> None:
        if state not in allowed:
            raise UnitStateError(f"lins: unit {self.name}: {transition} from {state.value}, expected "
                                 f"{' or '.join(a.value for a in allowed)}")

    # --- what only the unit's transitions change: read-only outside it ---------------------------------------------
    @property
    def param_state(self) -> ParamState:
        return self._param_state

    @property
    def grad_state(self) -> GradState:
        return self._grad_state

    @property
    def held(self) -> int:
        """Holds on the gathered parameters (``hold``) not yet undone."""
        return self._held

    @property
    def host_grads(self):
        """This unit's HostGradSlot (its host G accumulator), where the plan puts G on the host; else None."""
        return self._host_grads

    @property
    def host_params(self):
        """The HostParams uploading this unit's P chunk (held in ``p_shard``, on the host), where the plan puts P
        there; else None."""
        return self._host_params

    def show_status(self, status: Optional[tuple]) -> None:
        """What ``ds_status`` says of the parameters from now on, (while gathered, while released), as they show
        (``_show_params``); None: nothing (DeepSpeed's ZeRO-3 view, ``LinsRuntime.show_zero3_status``)."""
        self._status = status

    # --- parameters ------------------------------------------------------------------------
    @property
    def releases(self) -> bool:
        """Whether the full parameters exist only while gathered for use: P sharded, or P on the host."""
        return self.sharded_p or self._host_params is not None

    @property
    def p_storage(self) -> torch.Tensor:
        """This rank's P chunk, where the optimizer writes updated parameters (on the host with P there)."""
        return self.p_shard if self.releases else self.full

    @property
    def p_base(self) -> int:
        return self.spec.p_start if self.sharded_p else 0

    @property
    def g_base(self) -> int:
        return self.spec.g_start if self.sharded_g else 0

    @property
    def _at_rest(self) -> ParamState:
        """The parameters' state with nothing in flight and nothing gathered for use."""
        return ParamState.SHARDED if self.releases else ParamState.GATHERED

    def place_params(self, host_params) -> None:
        """Where the P chunk lives: on the host (``host_params``, a HostParams: pinned, uploaded before each use) or
        on the device (None). Nothing in flight; a gathered copy is released first."""
        if (host_params is None) == (self._host_params is None):
            self._host_params = host_params
            return
        self.release()
        self._expect(self._param_state, (self._at_rest,), "place_params")
        with torch.no_grad():
            if host_params is not None:
                host = host_params.empty(self.spec.p_size, self.dtype)
                host.copy_(self.p_storage)
                if not self.sharded_p:
                    self._show_params(False)
                    self.full.untyped_storage().resize_(0)
                self.p_shard, self._host_params, self._param_state = host, host_params, ParamState.SHARDED
            else:
                host, self._host_params = self.p_shard, None
                if self.sharded_p:
                    self.p_shard = host.to(self.device)
                else:
                    self.full.untyped_storage().resize_(self.spec.padded * self.full.element_size())
                    self.full.copy_(host)
                    self._show_params(True)
                    self.p_shard, self._param_state = None, ParamState.GATHERED

    def start_gather(self) -> None:
        """Launch the AllGather of the full parameters without waiting (prefetch); once per use: nothing to do
        when the gather is in flight or done. A P-sync still in flight is waited for first; a host update still
        running is not (a prefetch must not block on it: ``wait_gather`` does). Where the gather is a collective
        (P sharded), a unit still UPDATING is gathered at its use, never here: whether its update is done differs
        by rank, and a prefetch that one rank made and another did not (a layer the forward then skips) would pair
        the ranks' collectives wrongly."""
        if self._param_state is ParamState.UPDATING and (self.sharded_p or not self._ticket.ready()):
            return
        self.wait_param_sync()
        if self._param_state is not ParamState.SHARDED:
            return
        nbytes = self.spec.padded * self.full.element_size()
        if self.full.untyped_storage().size() != nbytes:
            self.full.untyped_storage().resize_(nbytes)
        if self._host_params is not None and self._host_params.stream is not None:  # P on the host of a GPU: up,
            self._gather_work = self._host_params.upload(  # then gathered where s_p > 1, on the upload's stream
                self.p_shard, None if self.sharded_p else self.full, self._gather_from)
        else:  # on a CPU device the host pool is the device's memory
            self._gather_work = comm.all_gather(self.groups, "p", self.full, self.p_shard, async_op=True,
                                                tag=self.name)
        self._param_state = ParamState.GATHERING

    def _gather_from(self, src: torch.Tensor):
        return comm.all_gather(self.groups, "p", self.full, src, async_op=True, tag=self.name)

    def wait_gather(self) -> None:
        """Make the full parameters current and usable on this stream."""
        self.wait_param_sync()
        self.start_gather()
        if self._param_state is ParamState.GATHERING:
            if self._gather_work is not None:
                self._gather_work.wait()
            self._gather_work = None
            self._show_params(True)
            self._param_state = ParamState.GATHERED

    def release(self) -> None:
        """Free the full buffer (s_p > 1), never while a collective still writes into it. Nothing to do when it
        is not gathered (SHARDED, or SYNCING: a unit the last forward did not use). The parameters become empty
        tensors, as ZeRO-3's partitioned ones: a read outside forward sees no elements, never freed memory."""
        if (not self.releases or self._held
                or self._param_state in (ParamState.SHARDED, ParamState.SYNCING, ParamState.UPDATING)):
            return
        self.wait_gather()
        self._show_params(False)
        self.full.untyped_storage().resize_(0)
        self._param_state = ParamState.SHARDED

    def hold(self) -> None:
        """Gathered and kept so until ``unhold`` (ZeRO-3's ``GatheredParameters``): no release in between. A unit
        already gathered for use (inside a forward) stays as it was after the last unhold."""
        self._holds.append(self._param_state is ParamState.GATHERED and not self._held)
        self.wait_gather()
        self._held += 1

    def unhold(self) -> None:
        was_gathered = self._holds.pop() if self._holds else False
        self._held = max(0, self._held - 1)
        if not self._held and not was_gathered:
            self.release()

    def _show_params(self, full: bool) -> None:
        """Each parameter a view into the full buffer (gathered), or an empty tensor (released); ``status`` (ZeRO-3's
        available / not available, where the parameters carry its API) follows."""
        if full:
            for s in self.slots:
                s.param.data = self.full[s.offset:s.offset + s.numel].view(s.shape)
        else:
            empty = torch.empty(0, dtype=self.dtype, device=self.device)
            for s in self.slots:
                s.param.data = empty
                s.param.ds_shape, s.param.ds_numel = s.shape, s.numel
        if self._status is not None:
            for s in self.slots:
                s.param.ds_status = self._status[0 if full else 1]

    def start_param_sync(self, async_op: bool) -> None:
        """After the optimizer: this rank's P chunk from the OS chunks of its P-sync group."""
        self._expect(self._param_state, (self._at_rest,), "start_param_sync")  # never while gathered or gathering
        work = comm.all_gather(self.groups, "p_sync", self.p_storage, self.os_params(), async_op=async_op,
                               tag=self.name)
        if async_op and work is not None:
            self._sync_work, self._param_state = work, ParamState.SYNCING

    def begin_host_update(self, ticket) -> None:
        """The host optimizer now writes this unit's P chunk; its next use waits on ``ticket`` (a HostTicket)."""
        self._expect(self._param_state, (self._at_rest,), "begin_host_update")
        self._ticket, self._param_state = ticket, ParamState.UPDATING

    def wait_host_update(self) -> None:
        """Block until the host optimizer is done with this unit (its G accumulator on the host may be written
        again); the unit stays UPDATING until its next use finishes the update (``finish_host_update``)."""
        if self._param_state is ParamState.UPDATING:
            self._ticket.wait()

    def finish_host_update(self) -> None:
        """Wait for the host optimizer's update of this unit (its P chunk then current on this device's stream;
        the P-sync, where there is one, is the caller's)."""
        self._expect(self._param_state, (ParamState.UPDATING,), "finish_host_update")
        self._ticket.wait()  # a failed update does not raise here, on one rank: every rank raises it at the next
        # step boundary (LinsRuntime.check_host), before the stale P chunk is updated again or saved
        self._ticket, self._param_state = None, self._at_rest

    def wait_param_sync(self) -> None:
        """The P chunk current: a host update waited for (and the P-sync after it run: none when s_os == s_p, the
        only layouts whose host updates outlive ``step()``), a P-sync in flight completed."""
        if self._param_state is ParamState.UPDATING:
            self.finish_host_update()
            self.start_param_sync(async_op=False)
        if self._param_state is ParamState.SYNCING:
            self._sync_work.wait()
            self._sync_work, self._param_state = None, self._at_rest

    def gather_whole(self, chunk: torch.Tensor, p_buf: torch.Tensor, whole_buf: torch.Tensor) -> torch.Tensor:
        """The unit's whole padded buffer of one fp32 state from this rank's OS chunk of it (``chunk``): over the P-sync
        group, then the P group, the parameters' own path (a re-layout's staging, ``step/staging.py``). Every rank of
        those groups calls it, unit by unit in one order; ``p_buf`` and ``whole_buf`` are the caller's scratch."""
        p_chunk = p_buf[:self.spec.p_size]
        comm.all_gather(self.groups, "p_sync", p_chunk, chunk, tag=f"relayout {self.name}")
        if not self.sharded_p:
            return p_chunk
        whole = whole_buf[:self.spec.padded]
        comm.all_gather(self.groups, "p", whole, p_chunk, tag=f"relayout {self.name}")
        return whole

    @torch.no_grad()
    def write_param(self, slot, flat: torch.Tensor) -> None:
        """The part of ``slot``'s values this rank holds in P (its P chunk, or the whole unit), from ``flat`` (the
        whole parameter): ``safe_set_full_fp32_param``, ``GatheredParameters`` with a ``modifier_rank``."""
        if self.releases:
            self.p_shard_write(slot, flat.to(self.dtype))
        else:
            self.full[slot.offset:slot.offset + slot.numel].copy_(flat)

    @torch.no_grad()
    def write_grad(self, slot, flat: torch.Tensor) -> None:
        """The part of ``slot``'s gradient this rank's G accumulator holds, from ``flat`` (the whole parameter's, in
        the accumulator's scale): ``safe_set_full_grad``."""
        for s_, (a, b), (s, e) in self.slices_by_parameter(self.g_base, self.g_base + self.g_numel):
            if s_ is slot:
                self.g_acc[s:e].copy_(flat[a:b])

    @torch.no_grad()
    def drop_grad(self, slot) -> None:
        """``slot``'s part of the gradient accumulated so far dropped (a submodule's ``zero_grad``; nothing in
        flight): zeros where this rank's G accumulator holds it; nothing where no gradient of the window arrived."""
        if self._g_acc is None and self._host_grads is None:
            return
        self.write_grad(slot, torch.zeros(slot.numel, dtype=self.accum_dtype, device=self.device))

    def p_shard_write(self, slot, flat: torch.Tensor) -> None:
        """Copy the part of ``slot``'s flat values that lies in this rank's P chunk into it."""
        lo, hi = self.spec.p_start, self.spec.p_start + self.spec.p_size
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            self.p_shard[a - lo:b - lo].copy_(flat[a - slot.offset:b - slot.offset])

    def free(self) -> None:
        """A re-layout drops this unit: every buffer freed, each parameter left its shape over no storage (a
        zero-stride view of one element) until the next plan's unit adopts it. Nothing may be in flight."""
        for s in self.slots:
            s.param.grad = None
            s.param.data = torch.zeros((), dtype=self.dtype, device=self.device).expand(s.shape)
        self.full = self.p_shard = self._g_acc = self._grad_views = self._host_params = None

    # --- gradients -------------------------------------------------------------------------
    def place_grads(self, host_grads) -> None:
        """Where the G accumulator lives from the next window on: on the host, ``host_grads`` (a HostGradSlot), or
        on the device (None). Only between windows, with no gradient held."""
        self._expect(self._grad_state, (GradState.ACCUMULATING,), "place_grads")
        if self._g_acc is not None or self._pending:
            raise UnitStateError(f"lins: unit {self.name}: place_grads while it holds gradients")
        self._host_grads, self._grad_views = host_grads, None
        self.attach_grads()

    @property
    def in_place(self) -> bool:
        """Each .grad a view into the accumulator (s_g == 1, gradients accumulated in the parameter dtype, G on the
        device), unless the unit releases its parameters: an empty parameter cannot hold a full-size .grad."""
        return (self._host_grads is None and not self.sharded_g and self.accum_dtype == self.dtype
                and not self.releases)

    @property
    def g_numel(self) -> int:
        """Elements of the G accumulator: this rank's G chunk, or the whole unit when s_g == 1."""
        return self.spec.g_size if self.sharded_g else self.spec.padded

    @property
    def g_acc(self) -> torch.Tensor:
        """The G accumulator: allocated when the window's first gradient of this unit arrives, freed after the
        optimizer step (``reset_grads``), so that a backward's start, where activations peak, holds none. Where the
        plan keeps it on the host, the host's (``HostGrads``), current once the step has begun."""
        if self._host_grads is not None:
            return self._host_grads.acc
        if self._g_acc is None:
            self._g_acc = torch.zeros(self.g_numel, dtype=self.accum_dtype, device=self.device)
        return self._g_acc

    @property
    def grad_views(self) -> Optional[list]:
        """In-place mode: each parameter's view into the accumulator (its .grad); None otherwise."""
        if self.in_place and self._grad_views is None:
            self._grad_views = [self.g_acc[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]
        return self._grad_views

    def attach_grads(self) -> None:
        """Point every .grad at its slice of g_acc (in-place mode, once the accumulator exists) or clear it."""
        views = self.grad_views if self._g_acc is not None else None
        for i, s in enumerate(self.slots):
            s.param.grad = views[i] if views is not None else None
        self._grads_attached = True

    def detach_grads(self) -> None:
        """No .grad holds the accumulator any more (a window's gradients are whole; the next backward attaches them
        again)."""
        for s in self.slots:
            s.param.grad = None
        self._grads_attached = False

    def _start_accumulator(self, first) -> None:
        """In-place mode, the window's first gradient of this unit (``first``'s, which autograd made as its own
        tensor): the accumulator now, every other .grad a view into it, so that autograd accumulates the rest in
        place; ``first``'s copied in."""
        for s, view in zip(self.slots, self.grad_views):
            if s.param is first:
                view.copy_(first.grad.reshape(view.shape))
                s.param.grad = view
            elif s.param.grad is None:
                s.param.grad = view

    def begin_backward(self) -> None:
        """A backward of the accumulation window starts (the first, or the next micro-batch's). From FINAL: a further
        backward over the window's last micro-batch (``engine.backward`` twice on one forward) after the one that
        ended the window: every replica holds the window's sum, which stays on the first replica of this G chunk
        only (zeros on the others, in place: no collective), so that the next replica AllReduce counts it once."""
        self._expect(self._grad_state, (GradState.ACCUMULATING, GradState.REDUCED, GradState.FINAL), "begin_backward")
        if self._grad_state is GradState.FINAL and self.groups.size("g_replica") > 1 \
                and self.groups.members["g_replica"][0] != self.groups.rank:
            self.g_acc.zero_()
        if not self._grads_attached:
            self.attach_grads()
        self._grad_state = GradState.ACCUMULATING

    def grad_arrived(self, param) -> bool:
        """Note ``param``'s gradient; True once every parameter of the unit has one in this backward (or is
        known to get none)."""
        if param in self._no_grad:
            self._late_grad(param)
        if self.in_place and self._g_acc is None:
            self._start_accumulator(param)
        self._pending.add(param)
        return self.grads_complete

    @property
    def grads_complete(self) -> bool:
        return len(self._pending) == len(self.slots)

    def expect_no_grad(self, params: list) -> None:
        """This backward will not reach ``params``: count them as arrived (their gradient here is zero)."""
        self._no_grad.update(params)
        self._pending.update(params)

    def _late_grad(self, param) -> None:
        name = next(s.name for s in self.slots if s.param is param)
        if self._grad_state is not GradState.ACCUMULATING:
            raise RuntimeError(
                f"lins: parameter {name} got a gradient after unit {self.name} was reduced: autograd said this "
                "backward would not reach it. Part of the unit's forward ran where the graph could not see it "
                "(a reentrant checkpoint around part of a layer?); checkpoint whole layers, or use "
                "use_reentrant=False")
        self._no_grad.discard(param)

    def start_reduce(self, staging: Optional[torch.Tensor]) -> bool:
        """Move this backward's gradients towards the G accumulation: local accumulation when s_g = 1 (in
        place where the gradients are views into it), else a ReduceScatter launched now, staged in
        ``staging``. True when a ReduceScatter is in flight (``finish_reduce`` completes it)."""
        self._expect(self._grad_state, (GradState.ACCUMULATING,), "start_reduce")
        self._pending.clear()
        self._no_grad.clear()
        if self.in_place:
            self._adopt_grads()
            self._grad_state = GradState.REDUCED
            return False
        flat = self._stage(staging)
        if not self.sharded_g:
            self._accumulate(flat)
            self._grad_state = GradState.REDUCED
            return False
        out = torch.empty(self.spec.g_size, dtype=self._reduce_dtype, device=self.device)
        work = comm.reduce_scatter(self.groups, "g", out, flat, async_op=True, tag=self.name)
        self._reduce = (work, out)
        self._grad_state = GradState.REDUCING
        return True

    def finish_reduce(self) -> None:
        """Wait for the ReduceScatter and accumulate its chunk."""
        self._expect(self._grad_state, (GradState.REDUCING,), "finish_reduce")
        work, out = self._reduce
        if work is not None:
            work.wait()
        self._accumulate(out)
        self._reduce = None
        self._grad_state = GradState.REDUCED

    def _accumulate(self, chunk: torch.Tensor) -> None:
        """This backward's reduced G chunk into the accumulator: on the device, or down to the host's."""
        if self._host_grads is not None:
            self._host_grads.push(chunk)
        else:
            self.g_acc.add_(chunk)

    def start_replica_reduce(self) -> bool:
        """The G chunk is final for this accumulation window: AllReduce it over its replicas. True when the
        AllReduce runs on a reduce-dtype copy in flight (memory ``finish_replica_reduce`` frees). A window
        without a backward (ACCUMULATING) reduces its zeros like any other."""
        self._expect(self._grad_state, (GradState.REDUCED, GradState.ACCUMULATING), "start_replica_reduce")
        if self.groups.size("g_replica") == 1:
            self._grad_state = GradState.FINAL
            return False
        tmp = None if self.g_acc.dtype == self._reduce_dtype else self.g_acc.to(self._reduce_dtype)
        self._replica_work = comm.all_reduce(self.groups, "g_replica", self.g_acc if tmp is None else tmp,
                                             async_op=True, tag=self.name)
        self._replica_tmp = tmp
        self._grad_state = GradState.REPLICA_REDUCING
        return tmp is not None

    def finish_replica_reduce(self) -> None:
        self._expect(self._grad_state, (GradState.REPLICA_REDUCING,), "finish_replica_reduce")
        self._replica_work.wait()
        if self._replica_tmp is not None:
            self.g_acc.copy_(self._replica_tmp)
        self._replica_work = self._replica_tmp = None
        self._grad_state = GradState.FINAL

    def reset_grads(self) -> None:
        """After the optimizer step (or a skipped one): the accumulator freed (the next window's first gradient
        allocates it again), no .grad left holding it."""
        self._expect(self._grad_state, (GradState.ACCUMULATING, GradState.REDUCED, GradState.FINAL), "reset_grads")
        self._g_acc = self._grad_views = None
        for s in self.slots:
            s.param.grad = None
        self._grads_attached = False
        self._pending.clear()
        self._no_grad.clear()
        self._grad_state = GradState.ACCUMULATING

    def wait_all(self) -> None:
        """Complete every collective of this unit still in flight; issues none. A host update still running is
        waited for: its P-sync is a local copy, since only layouts without a P-sync collective (s_os == s_p, a P-sync
        group of one) let an update outlive ``step()`` (``plan.offload.hides_behind_forward``)."""
        if self._param_state is ParamState.UPDATING and self.groups.size("p_sync") > 1:
            raise UnitStateError(f"unit {self.name}: wait_all on a host update whose P-sync is a collective (group of "
                                 f"{self.groups.size('p_sync')}): step() runs those, in unit order")
        self.wait_param_sync()
        if self._param_state is ParamState.GATHERING:
            self.wait_gather()
        if self._grad_state is GradState.REDUCING:
            self.finish_reduce()
        if self._grad_state is GradState.REPLICA_REDUCING:
            self.finish_replica_reduce()

    def _adopt_grads(self) -> None:
        """In-place mode: a .grad that autograd allocated itself (after someone set grads to None)
        is added into g_acc and replaced by the view."""
        for s, view in zip(self.slots, self.grad_views):
            g = s.param.grad
            if g is not None and g.data_ptr() != view.data_ptr():
                view.add_(g.reshape(view.shape))
            s.param.grad = view

    def _stage(self, staging: torch.Tensor) -> torch.Tensor:
        """The unit's gradients, flat in the reduce dtype, in ``staging`` (the .grads are cleared)."""
        flat = staging[:self.spec.padded]
        flat[self.numel:].zero_()  # padding; every parameter range is written below
        for s in self.slots:
            dest = flat[s.offset:s.offset + s.numel]
            if s.param.grad is None:
                dest.zero_()  # unused in this backward
            else:
                dest.copy_(s.param.grad.reshape(-1))
                s.param.grad = None
        return flat

    # --- ranges ----------------------------------------------------------------------------
    def group_range(self, group: int) -> Optional[tuple]:
        """[start, end) of param group ``group`` in unit coordinates (contiguous by construction)."""
        mine = [s for s in self.slots if s.group == group]
        if not mine:
            return None
        return mine[0].offset, mine[-1].offset + mine[-1].numel

    def os_range(self, group: int) -> Optional[OSRange]:
        """The part of param group ``group`` inside this rank's OS chunk, or None."""
        rng = self.group_range(group)
        if rng is None:
            return None
        lo = max(rng[0], self.spec.os_start)
        hi = min(rng[1], self.spec.os_start + self.spec.os_size)
        return OSRange(self, group, lo, hi) if lo < hi else None

    def os_grad(self) -> torch.Tensor:
        """The accumulated gradient of this rank's OS chunk (a view into ``g_acc``)."""
        start = self.spec.os_start - self.g_base
        return self.g_acc[start:start + self.spec.os_size]

    def os_params(self) -> torch.Tensor:
        """This rank's OS chunk of the parameters (a view into the P storage)."""
        start = self.spec.os_start - self.p_base
        return self.p_storage[start:start + self.spec.os_size]

    def slices_by_parameter(self, lo: int, hi: int):
        """(slot, [a, b) within the parameter, [s, e) within [lo, hi)) for every parameter overlapping the
        unit range [lo, hi): what a range of this unit is, by parameter name."""
        for slot in self.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                yield slot, (a - slot.offset, b - slot.offset), (a - lo, b - lo)
