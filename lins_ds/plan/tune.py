"""Which plans ``"plan": "tune"`` times (docs/design.md §14). Pure: evaluations in, candidates out.

The solver ranks every feasible plan by its cost model; the tuner measures a few of them on real training steps.
The candidates are, in order: the solver's best; the best of every other *kind* of layout it found feasible (the
replicated one, ZeRO-1's, ZeRO-2's, hpZ/MiCS-like partial P sharding, ZeRO-3's), since the cost model is least sure
*between* kinds (a different collective mix, different links); then, on the best layout, the neighbours of its
activation checkpointing depth and offload fraction (one GPU has no other kind to try). Only plans predicted to fit
are candidates: one predicted over budget is never tried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .offload import RESIDENT, Placement
from .solver import Evaluation, compute_seconds, fewest_offloaded
from .topology import Layout

KINDS = ("replicated", "ZeRO-1-like", "ZeRO-2-like", "hpZ/MiCS-like", "ZeRO-3-like")


def kind(layout: Layout, world_size: int) -> str:
    """The layout in ZeRO's words: what it shards, and whether P is sharded over all ranks or a part."""
    s_p, s_g, s_os = layout.sharding()
    if s_os == 1:
        return "replicated"
    if s_g == 1:
        return "ZeRO-1-like"
    if s_p == 1:
        return "ZeRO-2-like"
    return "ZeRO-3-like" if s_p == world_size else "hpZ/MiCS-like"


@dataclass(frozen=True)
class Candidate:
    evaluation: Evaluation
    kind: str
    why: str  # "solver's best", "best <kind>", "checkpointing", "offload"
    predicted_step_s: float

    @property
    def label(self) -> str:
        e = self.evaluation
        return label(e.layout, e.ckpt_units, e.num_layers, e.placement, e.num_units)


def label(layout: Layout, ckpt: int, layers: int, placement: Placement = RESIDENT, units=None) -> str:
    """A plan in one line: its layout, checkpointed layer units, units whose OS (and G: "+G", P: "+P") is off the
    device."""
    out = str(layout)
    if ckpt:
        out += f" ckpt {ckpt}/{layers}"
    if placement.n_units:
        out += (f" offload {placement.n_units}" + (f"/{units}" if units else "")
                + "".join(f" +{state.upper()}" for state in placement.states() if state != "os"))
    return out


def predicted_step_s(e: Evaluation, model, train, compute) -> float:
    """The whole step the solver predicts: the window's compute (forward and backward) plus what its objective
    adds (exposed communication, recompute, update, exposed host work)."""
    fwd, _ = compute_seconds(model, train, compute, 0)
    return train.grad_accum * 3 * fwd + e.exposed_s + e.recompute_s + e.optimizer_s + e.offload_s


def _neighbour_depths(k: int, n: int) -> list:
    """Checkpointing depths around ``k`` of ``n`` layer units (a step of about an eighth of the layers, each way),
    and every layer: the other end of the trade against offload."""
    d = max(1, round(n / 8))
    return list(dict.fromkeys(x for x in (k + d, k - d, n, k + 2 * d, k - 2 * d) if 0 <= x <= n and x != k))


def neighbours(best: Evaluation, evaluate: Callable[[int, int], Evaluation], depth_choices: list,
               offload_choices: list) -> list:
    """Feasible plans of the best layout along the trade between checkpointing and offload: other depths, each with
    the fewest offloaded units that fit, and other offloads, each with the fewest checkpointed units that fit."""
    out = []
    for k in _neighbour_depths(best.ckpt_units, best.num_layers):
        if k in depth_choices:
            e, _ = fewest_offloaded(lambda o: evaluate(k, o), offload_choices)
            out.append((e, "checkpointing"))
    if len(offload_choices) > 1:
        now = best.placement.n_units
        i = offload_choices.index(now) if now in offload_choices else 0
        for j in (i + 1, i - 1, i + 2, i - 2):
            if 0 <= j < len(offload_choices):
                o = offload_choices[j]
                fit = next((e for e in (evaluate(k, o) for k in depth_choices) if e.fits), None)
                if fit is not None:
                    out.append((fit, "offload"))
    return [(e, why) for e, why in out if e.fits]


def candidates(fitting: list, near: list, count: int, world_size: int,
               step_of: Callable[[Evaluation], float]) -> list:
    """Up to ``count`` candidates: the solver's best (``fitting`` is sorted best first), the best of each other kind,
    then ``near`` (from ``neighbours``), each plan once."""
    if not fitting:
        return []
    best = fitting[0]
    picked: list = [(best, "solver's best")]
    seen_kinds = {kind(best.layout, world_size)}
    for e in fitting[1:]:
        k = kind(e.layout, world_size)
        if k not in seen_kinds:
            seen_kinds.add(k)
            picked.append((e, f"best {k}"))
    for e, why in sorted(near, key=lambda ew: ew[0].sort_key()):
        picked.append((e, why))
    out, keys = [], set()
    for e, why in picked:
        key = (e.layout, e.ckpt_units, e.placement)
        if key not in keys:
            keys.add(key)
            out.append(Candidate(e, kind(e.layout, world_size), why, step_of(e)))
    return out[:count]


CONFIDENCE = 0.95  # of the interval around a candidate's median step time


def median_interval(times: list, confidence: float = CONFIDENCE) -> Optional[tuple]:
    """(low, median, high): the median of ``times`` and a distribution-free interval that holds the true median
    with at least ``confidence`` — the order statistics x(k) and x(n+1-k) for the largest k whose binomial tail
    P(Binomial(n, 1/2) < k) is at most (1 - confidence) / 2 (no assumption on how step times are spread; one slow
    step moves it by one rank, not by its size). None with too few times for that confidence (6 for 95 %)."""
    xs, n = sorted(times), len(times)
    tail, k, p = 0.0, 0, 0.5 ** n
    for i in range(n + 1):  # tail = P(B <= i - 1) as i grows; k = the largest i with P(B < i) <= alpha / 2
        if tail > (1 - confidence) / 2:
            break
        k = i
        tail += p
        p = p * (n - i) / (i + 1)
    if k < 1:
        return None
    mid = xs[(n - 1) // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
    return xs[k - 1], mid, xs[n - k]


def settled(times: list, precision: float) -> bool:
    """Whether the median step time is known to ``precision``: its interval within +-precision of it."""
    iv = median_interval(times)
    return iv is not None and iv[2] - iv[1] <= precision * iv[1] and iv[1] - iv[0] <= precision * iv[1]


def fastest(measured: list, budget_gb: Optional[float], precision: float = 0.0) -> Optional[int]:
    """Index of the candidate to keep: ``measured`` is [(step times or None, peak GiB or None)], the first the
    solver's best. The fastest median within the budget, but the solver's best stays unless the gain is more than
    the noise: the other's whole interval below the solver's (or, without intervals, faster by more than
    ``precision``). None when no candidate was measured within the budget."""
    stats = [None if t is None or not t or (budget_gb is not None and peak is not None and peak > budget_gb)
             else (median_interval(t) or (None, _median(t), None)) for t, peak in measured]
    ok = [(s[1], i) for i, s in enumerate(stats) if s is not None]
    if not ok:
        return None
    best = min(ok)[1]
    first = stats[0]
    if best == 0 or first is None:
        return best
    lo0, mid0, _ = first
    _, mid, hi = stats[best]
    if lo0 is not None and hi is not None:
        return best if hi < lo0 else 0
    return best if mid < mid0 * (1 - precision) else 0


def _median(xs: list) -> float:
    xs, n = sorted(xs), len(xs)
    return xs[(n - 1) // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
