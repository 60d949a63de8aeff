"""Flat per-unit buffers: what each rank stores of P, G and OS for one unit (DESIGN §2).

A unit is one repeated layer (a decoder block) or the root (every other trainable parameter). Its
parameters live in one flat buffer, ordered by optimizer param group so that each group is one
contiguous range, and padded so that s_os chunks of ``ALIGN``-multiple length cover it. Offsets of
the chunks this rank owns come from the pure layout; nothing here re-derives the plan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..plan import Layout, Topology
from ..plan.layout import chunks
from .config import LinsConfigError

ALIGN = 64  # elements; keeps every chunk 128-byte aligned in 16-bit dtypes


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only the P chunk is materialised (s_p > 1)
    GATHERING = "gathering"  # an AllGather into the full buffer is in flight (prefetch)
    GATHERED = "gathered"  # the full buffer is materialised; parameters are views into it


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


class FlatUnit:
    """One unit's storage. ``full`` holds the gathered parameters (always, when s_p == 1);
    ``p_shard`` the P chunk when s_p > 1; ``g_acc`` the accumulated G chunk (the whole unit when s_g == 1)."""

    def __init__(self, name: str, slots: list, spec: ChunkSpec, layout: Layout, accum_dtype: torch.dtype,
                 modules: Optional[list] = None):
        self.name, self.slots, self.spec, self.modules = name, slots, spec, modules or []
        self.sharded_p = layout.p.size > 1
        self.sharded_g = layout.g.size > 1
        dtypes = {s.param.dtype for s in slots}
        devices = {s.param.device for s in slots}
        if len(dtypes) != 1 or len(devices) != 1:
            raise LinsConfigError(f"lins: unit {name} mixes dtypes {sorted(map(str, dtypes))} or devices; "
                                  "every trainable parameter of a unit must share dtype and device")
        self.dtype, self.device = dtypes.pop(), devices.pop()
        self.numel = sum(s.numel for s in slots)
        self.full = torch.zeros(spec.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for s in slots:
                self.full[s.offset:s.offset + s.numel].copy_(s.param.data.reshape(-1))
                s.param.data = self.full[s.offset:s.offset + s.numel].view(s.shape)
        self.p_shard = self.full[spec.p_start:spec.p_start + spec.p_size].clone() if self.sharded_p else None
        g_len = spec.g_size if self.sharded_g else spec.padded
        self.g_acc = torch.zeros(g_len, dtype=accum_dtype, device=self.device)
        # s_g == 1 and gradients accumulate in the parameter dtype: each .grad is a view into g_acc, so
        # autograd accumulates in place and nothing is copied (DDP's gradient_as_bucket_view)
        self.grad_views = ([self.g_acc[s.offset:s.offset + s.numel].view(s.shape) for s in slots]
                           if not self.sharded_g and accum_dtype == self.dtype else None)
        self.attach_grads()
        self.state = UnitState.GATHERED
        self.pending: set = set()  # params whose grad arrived in this backward
        self.reduced = False  # reduced in the current backward
        self.replica_reduced = False  # replica AllReduce launched in this accumulation window
        self.gather_work = None  # in-flight P AllGather (prefetch)
        self.sync_work = None  # in-flight P-sync AllGather after the optimizer step
        if self.sharded_p:
            self.release()

    # --- gradients -------------------------------------------------------------------------
    def attach_grads(self) -> None:
        """Point every .grad at its slice of g_acc (in-place mode) or clear it."""
        for i, s in enumerate(self.slots):
            s.param.grad = self.grad_views[i] if self.grad_views is not None else None

    def adopt_grads(self) -> None:
        """In-place mode: a .grad that autograd allocated itself (after someone set grads to None)
        is added into g_acc and replaced by the view."""
        for s, view in zip(self.slots, self.grad_views):
            g = s.param.grad
            if g is not None and g.data_ptr() != view.data_ptr():
                view.add_(g.reshape(view.shape))
            s.param.grad = view

    # --- P storage -------------------------------------------------------------------------
    @property
    def p_storage(self) -> torch.Tensor:
        """This rank's P chunk, where the optimizer writes updated parameters."""
        return self.p_shard if self.sharded_p else self.full

    @property
    def p_base(self) -> int:
        return self.spec.p_start if self.sharded_p else 0

    @property
    def g_base(self) -> int:
        return self.spec.g_start if self.sharded_g else 0

    def materialise(self) -> torch.Tensor:
        """Give ``full`` its storage back (contents undefined until gathered)."""
        nbytes = self.spec.padded * self.full.element_size()
        if self.full.untyped_storage().size() != nbytes:
            self.full.untyped_storage().resize_(nbytes)
        return self.full

    def release(self) -> None:
        if self.sharded_p:
            self.full.untyped_storage().resize_(0)
            self.state = UnitState.SHARDED

    # --- ranges ----------------------------------------------------------------------------
    def group_range(self, group: int) -> Optional[tuple]:
        """[start, end) of param group ``group`` in unit coordinates (contiguous by construction)."""
        mine = [s for s in self.slots if s.group == group]
        if not mine:
            return None
        return mine[0].offset, mine[-1].offset + mine[-1].numel

    def os_segment(self, group: int) -> Optional[tuple]:
        """The part of param group ``group`` inside this rank's OS chunk, or None."""
        rng = self.group_range(group)
        if rng is None:
            return None
        lo = max(rng[0], self.spec.os_start)
        hi = min(rng[1], self.spec.os_start + self.spec.os_size)
        return (lo, hi) if lo < hi else None

    def os_grad(self) -> torch.Tensor:
        """The accumulated gradient of this rank's OS chunk (a view into ``g_acc``)."""
        start = self.spec.os_start - self.g_base
        return self.g_acc[start:start + self.spec.os_size]

    def os_params(self) -> torch.Tensor:
        """This rank's OS chunk of the parameters (a view into the P storage)."""
        start = self.spec.os_start - self.p_base
        return self.p_storage[start:start + self.spec.os_size]


def find_layers(module: nn.Module, class_names: Optional[tuple]) -> list:
    """The modules that become units: those of the named classes (outermost), or by default the
    children of the ModuleList holding the most parameters whose children all share one class."""
    if class_names:
        found, inside = [], set()
        for name, m in module.named_modules():
            if type(m).__name__ in class_names and not any(name.startswith(p + ".") for p in inside):
                found.append((name, m))
                inside.add(name)
        if not found:
            raise LinsConfigError(f"lins.unit_modules: no module of class {list(class_names)} in the model")
        return found
    best, best_params = [], 0
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1:
            n = sum(p.numel() for p in m.parameters())
            if n > best_params:
                best, best_params = [(f"{name}.{i}", c) for i, c in enumerate(m)], n
    return best


def assign_units(module: nn.Module, group_of: dict, class_names: Optional[tuple]) -> list:
    """[(unit name, modules, [(param name, param)])], root first. A parameter used by several layers
    goes to the root unit, which stays gathered for a whole forward and backward."""
    names = {p: n for n, p in module.named_parameters()}
    for p, n in names.items():
        if p.requires_grad and p not in group_of:
            raise LinsConfigError(f"lins: parameter {n} requires grad but is in no optimizer param group; "
                                  "freeze it (requires_grad=False) or give it to the optimizer")
    layers = find_layers(module, class_names)
    owners: dict = {}
    for lname, m in layers:
        for p in m.parameters():
            owners.setdefault(p, set()).add(lname)
    units, taken = [], set()
    for lname, m in layers:
        ps = [(names[p], p) for p in m.parameters() if p in group_of and owners[p] == {lname} and p not in taken]
        taken.update(p for _, p in ps)
        units.append((lname, [m], ps))
    root = [(n, p) for n, p in module.named_parameters() if p in group_of and p not in taken]
    return ([("root", [], root)] if root else []) + [u for u in units if u[2]]


def build_unit(name: str, modules: list, params: list, group_of: dict, topo: Topology, layout: Layout,
               rank: int, accum_dtype: torch.dtype) -> FlatUnit:
    ordered = sorted(enumerate(params), key=lambda ip: (group_of[ip[1][1]], ip[0]))
    slots, off = [], 0
    for _, (pname, p) in ordered:
        slots.append(Slot(pname, p, off, p.numel(), p.shape, group_of[p]))
        off += p.numel()
    return FlatUnit(name, slots, ChunkSpec.make(off, topo, layout, rank), layout, accum_dtype, modules)
