"""Collective timing table: t(op, bytes, mesh), pure data plus interpolation (docs/design.md §7, §11).

``bytes`` follows nccl-tests: the output of AllGather, the input of ReduceScatter, the buffer of
AllReduce and Broadcast. The effective bandwidth w = bytes / t ("algbw") is what the paper calls
w(op, volume, mesh). A mesh is ``Factor(intra, inter)``: ``intra`` ranks per node on ``inter`` nodes,
timed with every group of that shape running at once, as in training.

Interpolation (one rule for measured and synthetic tables): times are first made monotone in size
(a running maximum), then interpolated linearly in (log bytes, log time). Below the smallest measured
size the smallest measured time applies (latency floor); above the largest, the largest size's
bandwidth (time grows linearly).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field

from .topology import Factor, PlanError

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
FORMAT = "lins_ds.profile/1"


def bus_factor(op: str, n: int) -> float:
    """busbw = algbw x this factor (nccl-tests' convention), for display and synthetic tables."""
    if n <= 1:
        return 0.0
    return {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}[op]


@dataclass(frozen=True)
class Series:
    """Measured points of one (op, mesh): sizes ascending, times (median) and relative spread."""

    sizes: tuple[int, ...]
    times: tuple[float, ...]
    spread: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.times):
            raise PlanError("profile series: sizes and times must be non-empty and of equal length")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] <= 0:
            raise PlanError("profile series: sizes must be positive and strictly increasing")
        if any(not (t > 0 and math.isfinite(t)) for t in self.times):
            raise PlanError("profile series: times must be positive and finite")

    def monotone_times(self) -> list[float]:
        out, best = [], 0.0
        for t in self.times:
            best = max(best, t)
            out.append(best)
        return out

    def time(self, nbytes: float) -> float:
        sizes, times = self.sizes, self.monotone_times()
        if nbytes <= sizes[0]:
            return times[0]
        if nbytes >= sizes[-1]:
            return times[-1] * nbytes / sizes[-1]
        k = bisect.bisect_right(sizes, nbytes)
        if sizes[k - 1] == nbytes:
            return times[k - 1]
        x0, x1 = math.log(sizes[k - 1]), math.log(sizes[k])
        y0, y1 = math.log(times[k - 1]), math.log(times[k])
        return math.exp(y0 + (y1 - y0) * (math.log(nbytes) - x0) / (x1 - x0))


@dataclass(frozen=True)
class ProfileTable:
    meta: dict
    series: dict = field(default_factory=dict)  # (op, intra, inter) -> Series

    @property
    def source(self) -> str:
        return str(self.meta.get("source", "unknown"))

    def meshes(self) -> set[Factor]:
        return {Factor(i, j) for (_, i, j) in self.series}

    def has(self, op: str, mesh: Factor) -> bool:
        return mesh.size == 1 or (op, mesh.intra, mesh.inter) in self.series

    def time(self, op: str, nbytes: float, mesh: Factor) -> float:
        """Seconds for one ``op`` of ``nbytes`` over ``mesh`` (0 for a group of one)."""
        if mesh.size == 1 or nbytes <= 0:
            return 0.0
        try:
            return self.series[(op, mesh.intra, mesh.inter)].time(nbytes)
        except KeyError:
            raise PlanError(
                f"profile {self.source}: no measurement of {op} on mesh {mesh} "
                f"(measured meshes: {', '.join(sorted(map(str, self.meshes()))) or 'none'})"
            ) from None

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "meta": self.meta,
            "measurements": [
                {"op": op, "intra": i, "inter": j, "bytes": list(s.sizes), "time_s": list(s.times),
                 "spread": list(s.spread)}
                for (op, i, j), s in sorted(self.series.items())
            ],
        }

    @classmethod
    def from_json(cls, obj: dict, origin: str = "profile") -> "ProfileTable":
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise PlanError(f"{origin}: not a lins_ds profile (expected \"format\": \"{FORMAT}\")")
        series = {}
        try:
            for m in obj["measurements"]:
                if m["op"] not in OPS:
                    raise PlanError(f"{origin}: unknown op {m['op']!r} (expected one of {OPS})")
                key = (m["op"], int(m["intra"]), int(m["inter"]))
                series[key] = Series(tuple(int(b) for b in m["bytes"]), tuple(float(t) for t in m["time_s"]),
                                     tuple(float(s) for s in m.get("spread", ())))
            meta = dict(obj["meta"])
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{origin}: malformed profile ({type(e).__name__}: {e})") from None
        return cls(meta, series)

    @classmethod
    def load(cls, path: str, key: str = "--profile") -> "ProfileTable":
        """``key``: how the user named the file (``--profile``, ``lins.profile``), for the error message."""
        try:
            with open(path, encoding="utf-8") as f:
                obj = json.load(f)
        except UnicodeDecodeError as e:
            raise PlanError(f"{key} {path}: not a profile: the file is not UTF-8 text ({e.reason} at byte "
                            f"{e.start})") from None
        except (OSError, ValueError) as e:
            raise PlanError(f"{key} {path}: cannot read profile: {e}") from None
        return cls.from_json(obj, origin=f"{key} {path}")
