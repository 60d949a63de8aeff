"""Which parameters form which unit (docs/design.md §2): each repeated layer one unit, the rest the root."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ... import comm
from ...plan import Layout, Topology
from ..errors import LinsConfigError
from ..step.unit import ChunkSpec, Slot, Unit


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


def assign_units(module: nn.Module, group_of: dict, class_names: Optional[tuple]) -> tuple:
    """(root, layers): the root unit's [(param name, param)] (None when every trainable parameter is in a layer)
    and [(unit name, modules, [(param name, param)])] per layer unit, in model order. A parameter used by
    several layers goes to the root unit, which stays gathered for a whole forward and backward."""
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
    return root or None, [u for u in units if u[2]]


def build_unit(name: str, modules: list, params: list, group_of: dict, topo: Topology, layout: Layout,
               groups: comm.Groups, accum_dtype: torch.dtype, reduce_dtype: torch.dtype, materializer=None,
               device=None, is_root: bool = False) -> Unit:
    """A unit of ``params`` ordered by param group (each group one contiguous range)."""
    ordered = sorted(enumerate(params), key=lambda ip: (group_of[ip[1][1]], ip[0]))
    slots, off = [], 0
    for _, (pname, p) in ordered:
        slots.append(Slot(pname, p, off, p.numel(), p.shape, group_of[p]))
        off += p.numel()
    return Unit(name, slots, ChunkSpec.make(off, topo, layout, groups.rank), layout, groups, accum_dtype,
                reduce_dtype, modules, materializer, device, is_root)
