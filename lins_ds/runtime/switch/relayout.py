"""Re-lay a running engine onto another plan, in memory, at an accumulation boundary (docs/design.md §14).

What moves is the optimizer's state — each unit's fp32 master and element-wise state, plus the scalars (Adam's step)
— since parameters follow from it by the P-sync, and gradients are empty at a boundary. One unit at a time, every
state key in turn is gathered whole from the old OS chunks (over the old plan's P-sync group, then its P group: the
path the parameters take) and the part each target layout gives this rank is kept in host memory; so the device holds
at most one unit's full fp32 copy of one state more than training does. Then the runtime rebuilds its units, groups and
hooks under the new plan, the optimizer its master slices, and the staged values are written into them.

A plan with the same layout (another checkpointing depth, another number of units whose OS is on the host: what a
one-GPU job can change) moves nothing but the units whose OS changes place, one at a time, with their state.

The staging keeps this rank's part under the old layout too: when building the new plan fails on any rank (outside a
collective: an allocation, a bad candidate), every rank learns it before the next collective and rebuilds the old
plan from it, so no state is lost and no rank waits for another.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ... import comm
from ...plan import Plan
from ...plan.layout import Layout
from ...plan.tune import label
from ..errors import RelayoutError  # noqa: F401  (raised here; importable from here as before)
from ..step.optimizer import scalar_state
from ..step.unit import ChunkSpec


@dataclass
class Staged:
    """This rank's OS chunk of every unit under one layout: per unit, per state key, the chunk's values (host)."""

    layout: Layout
    chunks: list = field(default_factory=list)  # [(os_start, {key: cpu tensor})] per unit, in unit order
    scalars: dict = field(default_factory=dict)  # param group -> {key: value}


@dataclass
class RelayoutReport:
    seconds: float
    extra_peak_gb: float  # the device's peak during the move above what the old or the new plan holds (0 on CPUs)
    staged_gb: float  # host memory the staging took on this rank


def _elementwise_keys(opt) -> list:
    """The optimizer's element-wise state keys on any rank (a rank may hold none of some group, or no slice at
    all; a key a rank lacks is zeros there, as the optimizer would start it)."""
    mine = {k for sl in opt.slices for k, v in opt.state.get(sl.param, {}).items()
            if torch.is_tensor(v) and v.shape == sl.param.shape}
    return sorted(set().union(*comm.all_gather_object(sorted(mine))))


def _scalars(opt) -> dict:
    """Param group -> its scalar state (a step count), from any rank that holds some of the group."""
    mine = {}
    group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    for sl in opt.slices:
        for k, v in opt.state.get(sl.param, {}).items():
            if not (torch.is_tensor(v) and v.shape == sl.param.shape):
                mine.setdefault(group_of[id(sl.param)], {})[k] = v.detach().cpu().clone() if torch.is_tensor(v) else v
    out = {}
    for view in comm.all_gather_object(mine):
        for gi, values in view.items():
            out.setdefault(gi, values)
    return out


def _os_chunk(unit, opt, key: str, chunk: torch.Tensor) -> torch.Tensor:
    """This rank's OS chunk of ``unit`` for state ``key`` ("master" or an element-wise key), fp32, in ``chunk``."""
    spec = unit.spec
    chunk.zero_()
    for sl in opt.slices:
        if sl.range.unit is not unit:
            continue
        src = sl.param.data if key == "master" else opt.state.get(sl.param, {}).get(key)
        if src is not None:
            chunk[sl.range.lo - spec.os_start:sl.range.hi - spec.os_start].copy_(src)
    return chunk


def _gather_whole(unit, chunk: torch.Tensor, bufs: tuple) -> torch.Tensor:
    """The unit's whole padded buffer of one state from the OS chunks: P-sync group, then P group (as P itself)."""
    groups, spec = unit.groups, unit.spec
    p_chunk = bufs[1][:spec.p_size]
    comm.all_gather(groups, "p_sync", p_chunk, chunk, tag=f"relayout {unit.name}")
    if not unit.sharded_p:
        return p_chunk
    whole = bufs[2][:spec.padded]
    comm.all_gather(groups, "p", whole, p_chunk, tag=f"relayout {unit.name}")
    return whole


def _buffers(runtime) -> tuple:
    """(chunk, P chunk, whole) fp32 buffers for the largest unit: allocated before any collective of the staging,
    so that no rank fails between two of them."""
    units, dev = runtime.units, runtime.device
    size = lambda f: max((f(u.spec) for u in units), default=0)  # noqa: E731
    return (torch.empty(size(lambda s: s.os_size), dtype=torch.float32, device=dev),
            torch.empty(size(lambda s: s.p_size), dtype=torch.float32, device=dev),
            torch.empty(size(lambda s: s.padded) if runtime.layout.p.size > 1 else 0, dtype=torch.float32, device=dev))


@torch.no_grad()
def stage(runtime, opt, layouts: list) -> list:
    """This rank's state under each of ``layouts`` (``Staged`` each), gathered from the running plan. Every rank
    calls it (collectives on the running plan's groups); nothing of the running plan changes. A local failure (the
    buffers, host memory) is agreed: every rank raises ``RelayoutError`` having issued the same collectives."""
    keys = ["master"] + _elementwise_keys(opt)
    unique = list(dict.fromkeys(layouts))  # the same layout is staged once (a change of checkpointing or offload)
    staged = [Staged(lay, scalars=_scalars(opt)) for lay in unique]
    specs = [[ChunkSpec.make(u.numel, runtime.topo, lay, runtime.groups.rank) for u in runtime.units]
             for lay in unique]
    bufs, error = None, None
    try:
        bufs = _buffers(runtime)
    except Exception as e:  # noqa: BLE001 - agreed below
        error = f"{type(e).__name__}: {e}"
    error = comm.agree(error)
    if error is not None:
        raise RelayoutError(f"relayout: staging buffers ({error}); the running plan is untouched")
    for ui, unit in enumerate(runtime.units):
        parts = [{} for _ in unique]
        for key in keys:
            whole = _gather_whole(unit, _os_chunk(unit, opt, key, bufs[0][:unit.spec.os_size]), bufs)
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


@torch.no_grad()
def fill(opt, staged: Staged) -> None:
    """Write the staged values into the optimizer's (new) master slices and state, then the parameters' P
    storage (``write_back``); the caller runs the P-sync."""
    index = {id(u): i for i, u in enumerate(opt.runtime.units)}
    group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    for sl in opt.slices:
        start, values = staged.chunks[index[id(sl.range.unit)]]
        a, b = sl.range.lo - start, sl.range.hi - start
        sl.param.data.copy_(values["master"][a:b])
        state = {k: v[a:b].to(sl.param.device, copy=True) for k, v in values.items() if k != "master"}
        gi = group_of[id(sl.param)]
        for k, v in staged.scalars.get(gi, {}).items():
            state[k] = scalar_state(v, sl.param, opt.param_groups[gi])
        if state:
            opt.state[sl.param] = state
        sl.write_back()


def run(runtime, opt, plan: Plan, on_device_change=None) -> RelayoutReport:
    """Re-lay ``runtime`` (and ``opt``, its LinsOptimizer) onto ``plan``; every rank calls it at an
    accumulation boundary, after ``step()``. ``on_device_change(plan)`` re-applies what lives on the modules
    (activation checkpointing). Raises ``RelayoutError`` on every rank when any rank could not build ``plan``;
    the running plan is then rebuilt from the staged copy."""
    if plan.topology != runtime.topo:
        raise RelayoutError(f"relayout: plan for {plan.topology}, this run is {runtime.topo}")
    digests = comm.all_gather_object(plan.digest())
    if len(set(digests)) != 1:
        raise RelayoutError(f"relayout: ranks were given different plans (digests {digests})")
    t0 = time.perf_counter()
    dev = runtime.device
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    opt.quiesce()
    old = runtime.plan
    if plan.layout == old.layout:
        return _replan(runtime, opt, plan, old, on_device_change, t0, base)
    new_state, old_state = stage(runtime, opt, [plan.layout, old.layout])
    error = _try(lambda: _build(runtime, opt, plan, new_state, on_device_change))
    error = comm.agree(error)
    if error is not None:
        again = comm.agree(_try(lambda: _build(runtime, opt, old, old_state, on_device_change)))
        if again is not None:
            raise RuntimeError(f"relayout: could not rebuild the running plan either ({again}); this rank's "
                               f"state is lost — resume from the last checkpoint") from None
        runtime.sync_parameters()
        raise RelayoutError(f"relayout to {_describe(plan)} failed on a rank ({error}); back on {_describe(old)}")
    runtime.sync_parameters()
    runtime.wait()
    host = sum(t.numel() * t.element_size() for st in {id(new_state): new_state, id(old_state): old_state}.values()
               for _, part in st.chunks for t in part.values())
    return _report(dev, t0, base, host)


def _replan(runtime, opt, plan: Plan, old: Plan, on_device_change, t0: float, base: int) -> RelayoutReport:
    """The same layout: nothing is gathered or staged; only the units whose OS changes place move (one at a
    time), and the modules' checkpointing is set anew. On a failure every rank moves back."""
    def apply(p: Plan) -> None:
        runtime.replan(p)
        if on_device_change is not None:
            on_device_change(p)
        opt.place_units()

    error = comm.agree(_try(lambda: apply(plan)))
    if error is not None:
        again = comm.agree(_try(lambda: apply(old)))
        if again is not None:
            raise RuntimeError(f"relayout: could not move back to the running plan either ({again})") from None
        raise RelayoutError(f"relayout to {_describe(plan)} failed on a rank ({error}); back on {_describe(old)}")
    return _report(runtime.device, t0, base, 0)


def _describe(plan: Plan) -> str:
    return label(plan.layout, plan.activation_checkpointing_units, plan.num_layers, plan.offload_units,
                 grads=plan.offload_grads, params=plan.offload_params)


def _report(dev, t0: float, base: int, host_bytes: int) -> RelayoutReport:
    # the peak above what the old or the new plan holds at rest: what the move itself costs
    peak = ((torch.cuda.max_memory_allocated(dev) - max(base, torch.cuda.memory_allocated(dev))) / 2**30
            if dev.type == "cuda" else 0.0)
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the move's freed blocks back to the device: the new plan starts unfragmented
    return RelayoutReport(time.perf_counter() - t0, peak, host_bytes / 2**30)


def _try(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - agreed by the caller: every rank goes back together
        return f"{type(e).__name__}: {e}"


def _build(runtime, opt, plan: Plan, staged: Staged, on_device_change) -> None:
    """The optimizer's state dropped first (the staging holds it), so that the device never holds two plans'."""
    opt.release()
    runtime.relayout(plan)
    if on_device_change is not None:
        on_device_change(plan)
    opt.rebuild()
    fill(opt, staged)
