"""This rank's fp32 master slices of every unit's OS chunk, and the client's optimizer bound to them (docs/design.md
§3 step 4, §13, §14). ``LinsRuntime`` owns one ``Masters`` per plan; the optimizer adapter, the checkpoints and a
re-layout reach them only through the runtime's queries.

The client's (or DeepSpeed's) basic optimizer keeps its param groups — same order, same hyperparameters, so LR
schedulers work unchanged — but each group's ``params`` become this rank's fp32 master slices of that group inside its
OS chunks; a unit whose OS the plan puts off the device has its slices in the OS's tier (``storage.Tier``: pinned host
memory today), in pieces of ``HOST_PIECE`` elements.
"""

from __future__ import annotations

from typing import Optional

import torch

from .host_memory import HOST_PIECE
from .storage import Tier


def steps_per_parameter(optimizer) -> bool:
    """Whether ``optimizer`` keeps its step count per parameter (torch.optim's do), so that it may be
    stepped over a subset of its parameters at a time."""
    return type(optimizer).__module__.startswith("torch.optim")


class MasterSlice:
    """The master tensor of one ``OSRange`` (a param group's part of one unit's OS chunk on this rank); in ``tier``
    (host memory, pinned where the device is a GPU) for a unit whose OS is offloaded, ``on_host`` then."""

    def __init__(self, os_range, tier: Optional[Tier] = None):
        self.range, self.on_host = os_range, tier is not None
        src = os_range.params()
        self.aliased = src.dtype == torch.float32 and not self.on_host  # fp32 params are their own master copy
        if self.on_host:
            master = tier.allocate(src.numel(), torch.float32)  # src is in the tier already with P there
            master.copy_(src)
        else:
            master = src if self.aliased else src.float().clone()
        self.param = torch.nn.Parameter(master)

    def grad_view(self) -> torch.Tensor:
        return self.range.grads()

    def write_back(self) -> None:
        if not self.aliased:
            self.range.params().copy_(self.param.data)


def scalar_state(value, param: torch.Tensor, group: dict):
    """A copy of scalar optimizer state (Adam's step) for ``param``: where torch keeps it — on the parameter's
    device for fused or capturable optimizers, on the CPU otherwise (``Optimizer.load_state_dict``'s rule)."""
    if not torch.is_tensor(value):  # DeepSpeedCPUAdam's int step: torch's optimizers take a float32 tensor
        value = torch.tensor(float(value), dtype=torch.float32)
    on_device = group.get("fused") or group.get("capturable")
    return value.to(param.device if on_device else "cpu", copy=True)


def _moved(os_range, old: list, tier: Optional[Tier], state: dict, group: dict) -> list:
    """New master slices of ``os_range`` (in ``tier`` in pieces, or with None on the device whole) holding the values
    and optimizer state of the ``old`` slices that cover it."""
    out = []
    for r in (os_range.pieces(HOST_PIECE) if tier is not None else [os_range]):
        m = MasterSlice(r, tier)
        moved: dict = {}
        for sl in old:
            a, b = max(sl.range.lo, r.lo), min(sl.range.hi, r.hi)
            if a >= b:
                continue
            src, dst = slice(a - sl.range.lo, b - sl.range.lo), slice(a - r.lo, b - r.lo)
            m.param.data[dst].copy_(sl.param.data[src])
            for k, v in state.get(sl.param, {}).items():
                if torch.is_tensor(v) and v.shape == sl.param.shape:
                    moved.setdefault(k, torch.zeros_like(m.param.data))[dst].copy_(v[src])
                else:
                    moved.setdefault(k, scalar_state(v, m.param, group))
        if moved:
            state[m.param] = moved
        out.append(m)
    return out


class Masters:
    """Every master slice of this rank under one plan, bound into ``basic``'s param groups (group-major, units in
    order), and the batches the device slices are updated in."""

    def __init__(self, basic, units: list, host_units: list, tier: Optional[Tier] = None):
        """``units``: the plan's units, in order; ``host_units``: those whose OS the plan keeps off the device, in
        ``tier``. The basic optimizer keeps its param groups (hyperparameters, LR schedulers); its ``params`` and state
        start over."""
        _check_tier(host_units, tier)
        self.basic = basic
        self.slices: list = []
        on_host = set(host_units)
        for gi, group in enumerate(basic.param_groups):
            masters = [MasterSlice(r, tier if u in on_host else None) for u in units
                       for r in _ranges(u, gi, u in on_host)]
            self.slices.extend(masters)
            group["params"] = [m.param for m in masters]
        basic.state.clear()
        self._batches()

    # --- queries ---------------------------------------------------------------------------------------------------
    def on_host(self) -> list:
        """(unit, its slices) for every unit whose slices live on the host, in unit order."""
        host = [s for s in self.slices if s.on_host]
        return [(u, [s for s in host if s.range.unit is u]) for u in dict.fromkeys(s.range.unit for s in host)]

    def of_unit(self, unit) -> list:
        return [s for s in self.slices if s.range.unit is unit]

    def state_of(self, sl: MasterSlice) -> dict:
        return self.basic.state.get(sl.param, {})

    def host_state_made(self) -> bool:
        """Whether every host slice has its optimizer state (after the first host update)."""
        return all(self.basic.state.get(s.param) for s in self.slices if s.on_host)

    def elementwise_keys(self) -> set:
        """The optimizer's element-wise state keys this rank holds."""
        return {k for sl in self.slices for k, v in self.state_of(sl).items()
                if torch.is_tensor(v) and v.shape == sl.param.shape}

    def scalars(self) -> dict:
        """Param group -> its scalar state (a step count), as this rank holds it (host copies)."""
        out: dict = {}
        for sl in self.slices:
            for k, v in self.state_of(sl).items():
                if not (torch.is_tensor(v) and v.shape == sl.param.shape):
                    out.setdefault(sl.range.group, {})[k] = v.detach().cpu().clone() if torch.is_tensor(v) else v
        return out

    # --- the update ---------------------------------------------------------------------------------------------
    def _batches(self) -> None:
        """torch's optimizers keep their state, the step count included, per parameter: stepping them one unit at a
        time is the same update, with one unit's fp32 gradients and temporaries alive at once instead of the whole OS
        chunk's (docs/design.md §8). Others (DeepSpeed's FusedAdam counts steps per group) take one step over
        everything."""
        on_gpu = [s for s in self.slices if not s.on_host]
        units = list(dict.fromkeys(s.range.unit for s in on_gpu))
        self.update_batches = ([[s for s in on_gpu if s.range.unit is u] for u in units]
                               if steps_per_parameter(self.basic) else [on_gpu] if on_gpu else [])
        # each batch's parameters per param group, in the group's order: what ``update`` steps the optimizer over
        self._batch_params = [[[s.param for s in batch if s.range.group == gi]
                               for gi in range(len(self.basic.param_groups))] for batch in self.update_batches]

    def update(self, coef: torch.Tensor) -> None:
        """The device slices' update, batch by batch: fp32 gradients for one batch alone (scaled by ``coef``), then
        the basic optimizer over that batch's parameters alone; the result written into the P storage. Alone: the
        host slices are the basic optimizer's parameters too, and a host update begun inside the last backward may
        be running now, its master's ``.grad`` set (``host_optimizer.update_piece``): a step over every parameter
        would update that master a second time."""
        groups = self.basic.param_groups
        every = [g["params"] for g in groups]
        try:
            for batch, by_group in zip(self.update_batches, self._batch_params):
                for g, params in zip(groups, by_group):
                    g["params"] = params
                for s in batch:
                    g = s.grad_view()
                    s.param.grad = g.mul_(coef) if g.dtype == torch.float32 else g.float().mul_(coef)
                self.basic.step()
                for s in batch:
                    s.write_back()
                    s.param.grad = None
        finally:
            for g, params in zip(groups, every):
                g["params"] = params

    # --- moves (a re-plan: docs/design.md §14) ------------------------------------------------------------------------
    @torch.no_grad()
    def place(self, units: list, host_units: list, tier: Optional[Tier] = None) -> None:
        """After the host units changed under the same layout: each unit whose OS placement changed moves (to
        ``tier`` first, then to the device, one unit at a time: one unit's state extra at most); the others keep their
        masters and state untouched. Idempotent: it moves what differs from ``host_units``."""
        _check_tier(host_units, tier)
        state, want = self.basic.state, set(host_units)
        by_unit: dict = {}
        for sl in self.slices:
            by_unit.setdefault(sl.range.unit, []).append(sl)
        moving = [u for u in units if u in by_unit and by_unit[u][0].on_host != (u in want)]
        groups = self.basic.param_groups
        for u in sorted(moving, key=lambda u: u not in want):
            new = []
            try:
                for gi in dict.fromkeys(sl.range.group for sl in by_unit[u]):
                    new += _moved(u.os_range(gi), [sl for sl in by_unit[u] if sl.range.group == gi],
                                  tier if u in want else None, state, groups[gi])
            except BaseException:
                for m in new:  # this unit stays where it was, its state untouched
                    state.pop(m.param, None)
                raise
            for sl in by_unit[u]:
                state.pop(sl.param, None)
            by_unit[u] = new
            self._adopt(units, by_unit)  # consistent after every unit: a failure later leaves no slice without state
        self._adopt(units, by_unit)
        self._batches()

    def _adopt(self, units: list, by_unit: dict) -> None:
        """``by_unit``'s slices become the optimizer's (group-major, units in order)."""
        self.slices = [sl for gi in range(len(self.basic.param_groups)) for u in units
                       for sl in by_unit.get(u, []) if sl.range.group == gi]
        for gi, group in enumerate(self.basic.param_groups):
            group["params"] = [sl.param for sl in self.slices if sl.range.group == gi]

    def release(self) -> None:
        """Drop every master slice and its state (a re-layout, which staged them, builds new ones)."""
        for group in self.basic.param_groups:
            group["params"] = []
        self.basic.state.clear()
        self.slices, self.update_batches, self._batch_params = [], [], []

    # --- a unit's OS chunk as one tensor (re-layout: ``step/staging.py``) ------------------------------------------
    def export_os(self, unit, key: str, chunk: torch.Tensor, os_start: int) -> torch.Tensor:
        """This rank's OS chunk of ``unit`` for state ``key`` ("master" or an element-wise key), fp32, written into
        ``chunk`` (the chunk's first element is unit element ``os_start``); zeros where this rank holds no such state."""
        chunk.zero_()
        for sl in self.of_unit(unit):
            src = sl.param.data if key == "master" else self.state_of(sl).get(key)
            if src is not None:
                chunk[sl.range.lo - os_start:sl.range.hi - os_start].copy_(src)
        return chunk

    @torch.no_grad()
    def import_os(self, unit, os_start: int, values: dict, scalars: dict) -> None:
        """``unit``'s slices from a whole OS chunk per state key (``values``, "master" among them; element ``os_start``
        first) and the scalar state per param group (``scalars``); then the parameters' P storage (``write_back``)."""
        groups = self.basic.param_groups
        for sl in self.of_unit(unit):
            a, b = sl.range.lo - os_start, sl.range.hi - os_start
            sl.param.data.copy_(values["master"][a:b])
            state = {k: v[a:b].to(sl.param.device, copy=True) for k, v in values.items() if k != "master"}
            gi = sl.range.group
            for k, v in scalars.get(gi, {}).items():
                state[k] = scalar_state(v, sl.param, groups[gi])
            if state:
                self.basic.state[sl.param] = state
            sl.write_back()


def _check_tier(host_units: list, tier: Optional[Tier]) -> None:
    if host_units and tier is None:
        raise ValueError("lins: master slices off the device need the tier that holds them")


def _ranges(unit, group: int, on_host: bool) -> list:
    """``unit``'s OS range of param ``group`` (none where the unit holds none of it): in pieces of at most
    ``HOST_PIECE`` elements on the host (host tensors the worker updates one by one)."""
    r = unit.os_range(group)
    if r is None:
        return []
    return r.pieces(HOST_PIECE) if on_host else [r]
