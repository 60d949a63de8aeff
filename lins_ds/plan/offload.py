"""Offload as a plan dimension (docs/design.md §13): which units keep their optimizer state (OS) in host memory,
what that costs in host memory and in time, and what of it the next forward hides.

The placement is one number, ``k``: the last k units in forward order (the root, which runs first, only when
k covers every unit) keep their fp32 master and moments on the host. Their gradients leave the GPU once final,
the host optimizer updates them unit by unit in forward order, and each unit's updated parameters return just
in time for its next forward — so the last units' host work hides behind the first units' forward. A unit
offloaded costs, per element of this rank's OS chunk: the host update, the gradient down and the parameter up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .spec import GIB, TrainingSpec
from .topology import Layout, PlanError

MODES = ("off", "auto", "fixed")
HOST_STATE_BYTES = 4 + 8  # fp32 master and Adam's two fp32 moments, always on the host for an offloaded unit


@dataclass(frozen=True)
class HostSpec:
    """What this machine's host does for offload: measured at start-up (``lins_ds.runtime.offload.measure``)
    or given (``lins-ds plan --host-*``)."""

    capacity_gb: float  # host memory this rank may pin (the node's available memory / its ranks)
    update_elems_per_s: float = 1.0e9  # the host optimizer's throughput, elements per second
    h2d_gbs: float = 25.0  # pinned host-to-device copy bandwidth
    d2h_gbs: float = 25.0
    optimizer: str = "torch AdamW (fused, CPU)"  # the host optimizer, named in the summary
    source: str = "assumed"  # "measured on <device>" or "assumed"

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class OffloadSpec:
    """``mode``: "off" (never), "auto" (the solver decides; it costs time, so only where it pays or is needed)
    or "fixed" (``fraction`` of the units, rounded up, at least one)."""

    mode: str = "off"
    fraction: float = 1.0
    host: Optional[HostSpec] = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PlanError(f"offload: {self.mode!r} is not one of {MODES}")
        if not 0 < self.fraction <= 1:
            raise PlanError(f"offload.os_fraction: {self.fraction!r} is not in (0, 1]")
        if self.mode != "off" and self.host is None:
            raise PlanError("offload: a host description (HostSpec) is needed to price offload")

    def choices(self, num_units: int) -> list:
        """How many units may keep their OS on the host, ascending."""
        if self.mode == "off":
            return [0]
        if self.mode == "fixed":
            return [max(1, min(num_units, math.ceil(self.fraction * num_units - 1e-9)))]
        return list(range(num_units + 1))


def offloaded(units: list, k: int) -> list:
    """The parameter counts of the offloaded units (forward order: the root first, then the layers)."""
    return units[len(units) - k:] if k else []


def hides_behind_forward(layout: Layout) -> bool:
    """Whether a unit's update may finish after ``step()`` returns, waited for by the unit's next use: only where
    no P-sync collective follows the update (s_os == s_p; else the P-syncs run in ``step()``, in order)."""
    return layout.os.size == layout.p.size


def host_gb(units: list, k: int, s_os: int, train: TrainingSpec) -> float:
    """Host memory of the offloaded units' OS chunks on this rank: master, moments, the pinned gradient that
    comes down and the pinned parameter copy that goes up (none for fp32 parameters: the master goes up)."""
    up = train.param_bytes if train.param_dtype != "fp32" else 0
    return sum(offloaded(units, k)) / s_os * (HOST_STATE_BYTES + train.grad_bytes + up) / GIB


def unit_seconds(n: float, s_os: int, train: TrainingSpec, host: HostSpec) -> float:
    """One offloaded unit of ``n`` parameters: its gradient down, its host update and its parameters up."""
    per = n / s_os
    return per / host.update_elems_per_s + per * (train.grad_bytes / host.d2h_gbs + train.param_bytes / host.h2d_gbs) / 1e9


def exposed_seconds(units: list, k: int, layout: Layout, train: TrainingSpec, host: HostSpec,
                    forward_s: float) -> float:
    """What a step waits for the host: the offloaded units' transfers and updates, one after another in forward
    order, less what the next forward hides (``hides_behind_forward``): the first units run their forward
    meanwhile, and an offloaded unit's forward waits only for its own update."""
    off = offloaded(units, k)
    if not off:
        return 0.0
    s_os = layout.os.size
    times = [unit_seconds(n, s_os, train, host) for n in off]
    if not hides_behind_forward(layout):
        return sum(times)
    total = sum(units)
    per_unit_fwd = [forward_s * n / total for n in units]
    t = sum(per_unit_fwd[:len(units) - k])  # the resident units' forward runs while the host works
    done = 0.0
    for upd, fwd in zip(times, per_unit_fwd[len(units) - k:]):
        done += upd
        t = max(t, done) + fwd
    return max(0.0, t - forward_s)
