"""A re-layout's staging (docs/design.md §14): this rank's part of every unit's optimizer state under other layouts,
taken from the running plan, and written into a new plan's master slices. ``LinsRuntime.apply`` drives it.

What moves is the optimizer's state — each unit's fp32 master and element-wise state, plus the scalars (Adam's step) —
since parameters follow from it by the P-sync, and gradients are empty at a boundary. One unit at a time, every state
key in turn is gathered whole from the old OS chunks (``Unit.gather_whole``: over the old plan's P-sync group, then
its P group, the path the parameters take) and the part each target layout gives this rank is kept in host memory; so
the device holds at most one unit's full fp32 copy of one state more than training does. The staging keeps this rank's
part under the old layout too: when building the new plan fails on any rank, every rank rebuilds the old one from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ... import comm
from ...plan.layout import Layout
from ..errors import RelayoutError
from .unit import ChunkSpec


@dataclass
class Staged:
    """This rank's OS chunk of every unit under one layout: per unit, per state key, the chunk's values (host)."""

    layout: Layout
    chunks: list = field(default_factory=list)  # [(os_start, {key: cpu tensor})] per unit, in unit order
    scalars: dict = field(default_factory=dict)  # param group -> {key: value}


def _elementwise_keys(masters) -> list:
    """The optimizer's element-wise state keys on any rank (a rank may hold none of some group, or no slice at
    all; a key a rank lacks is zeros there, as the optimizer would start it)."""
    return sorted(set().union(*comm.all_gather_object(sorted(masters.elementwise_keys()))))


def _scalars(masters) -> dict:
    """Param group -> its scalar state (a step count), from any rank that holds some of the group."""
    out: dict = {}
    for view in comm.all_gather_object(masters.scalars()):
        for gi, values in view.items():
            out.setdefault(gi, values)
    return out


def _buffers(units: list, device: torch.device, p_sharded: bool) -> tuple:
    """(chunk, P chunk, whole) fp32 buffers for the largest unit: allocated before any collective of the staging,
    so that no rank fails between two of them."""
    size = lambda f: max((f(u.spec) for u in units), default=0)  # noqa: E731
    return (torch.empty(size(lambda s: s.os_size), dtype=torch.float32, device=device),
            torch.empty(size(lambda s: s.p_size), dtype=torch.float32, device=device),
            torch.empty(size(lambda s: s.padded) if p_sharded else 0, dtype=torch.float32, device=device))


@torch.no_grad()
def stage(units: list, masters, topo, rank: int, device: torch.device, layouts: list) -> list:
    """This rank's state under each of ``layouts`` (``Staged`` each), gathered from the running plan's ``units`` and
    ``masters``. Every rank calls it (collectives on the running plan's groups); nothing of the running plan changes.
    A local failure (the buffers, host memory) is agreed: every rank raises ``RelayoutError`` having issued the same
    collectives."""
    keys = ["master"] + _elementwise_keys(masters)
    unique = list(dict.fromkeys(layouts))  # the same layout is staged once (a change of checkpointing or offload)
    scalars = _scalars(masters)
    staged = [Staged(lay, scalars=scalars) for lay in unique]
    specs = [[ChunkSpec.make(u.numel, topo, lay, rank) for u in units] for lay in unique]
    bufs, error = None, None
    try:
        bufs = _buffers(units, device, any(u.sharded_p for u in units))
    except Exception as e:  # noqa: BLE001 - agreed below
        error = f"{type(e).__name__}: {e}"
    error = comm.agree(error)
    if error is not None:
        raise RelayoutError(f"relayout: staging buffers ({error}); the running plan is untouched")
    for ui, unit in enumerate(units):
        parts = [{} for _ in unique]
        for key in keys:
            chunk = masters.export_os(unit, key, bufs[0][:unit.spec.os_size], unit.spec.os_start)
            whole = unit.gather_whole(chunk, bufs[1], bufs[2])
            if error is not None:
                continue  # the collectives go on (every rank issues them); nothing more is kept
            try:
                for li, spec in enumerate(specs):
                    parts[li][key] = _to_host(whole[spec[ui].os_start:spec[ui].os_start + spec[ui].os_size])
            except Exception as e:  # noqa: BLE001 - agreed after the last collective
                error = f"{type(e).__name__}: {e}"
        for li, spec in enumerate(specs):
            staged[li].chunks.append((spec[ui].os_start, parts[li]))
    error = comm.agree(error)
    if error is not None:
        raise RelayoutError(f"relayout: staging in host memory ({error}); the running plan is untouched")
    return [staged[unique.index(lay)] for lay in layouts]


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.device.type == "cpu" else t.to("cpu")


def fill(units: list, masters, staged: Staged) -> None:
    """The staged values into ``masters``' (new) slices and state, then the parameters' P storage; the caller runs
    the P-sync."""
    for unit, (start, values) in zip(units, staged.chunks):
        masters.import_os(unit, start, values, staged.scalars)


def nbytes(*staged: Staged) -> int:
    """Host bytes the stagings hold (one copy where two are the same object)."""
    unique = {id(s): s for s in staged}.values()
    return sum(t.numel() * t.element_size() for s in unique for _, part in s.chunks for t in part.values())
