"""Topology, sharding factors and the candidate set (docs/design.md §2).

A data-parallel world of N = L x M ranks: M nodes of L GPUs. Each state x in (p, g, os) is
sharded over a mesh of ``intra`` GPUs per node times ``inter`` nodes. A triple of factors is
*valid* when every factor divides its dimension, the states nest (p | g | os in each dimension)
and every factor that crosses nodes first fills the node (inter > 1 implies intra == L).
"""

from __future__ import annotations

from dataclasses import dataclass

STATES = ("p", "g", "os")


class PlanError(ValueError):
    """Invalid planner input. The message names the key, the value and the rule."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, order=True)
class Topology:
    nodes: int  # M
    gpus_per_node: int  # L

    def __post_init__(self) -> None:
        for key, value in (("nodes", self.nodes), ("gpus_per_node", self.gpus_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{key}: {value!r} is not a positive integer")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, order=True)
class Factor:
    """Sharding factor of one state: ``intra`` GPUs per node x ``inter`` nodes."""

    intra: int
    inter: int

    @property
    def size(self) -> int:
        return self.intra * self.inter

    def divides(self, other: "Factor") -> bool:
        return other.intra % self.intra == 0 and other.inter % self.inter == 0

    def __truediv__(self, other: "Factor") -> "Factor":
        """The quotient mesh ``self / other`` (``other`` must divide ``self``)."""
        return Factor(self.intra // other.intra, self.inter // other.inter)

    def __str__(self) -> str:
        return f"{self.intra}x{self.inter}"

    def to_json(self) -> dict:
        return {"intra": self.intra, "inter": self.inter}


@dataclass(frozen=True, order=True)
class Layout:
    """The (p, g, os) factor triple: what a plan decides about placement."""

    p: Factor
    g: Factor
    os: Factor

    def factors(self) -> dict[str, Factor]:
        return {"p": self.p, "g": self.g, "os": self.os}

    def sharding(self) -> tuple[int, int, int]:
        return (self.p.size, self.g.size, self.os.size)

    def to_json(self) -> dict:
        return {s: f.to_json() for s, f in self.factors().items()}

    @classmethod
    def from_json(cls, obj: dict) -> "Layout":
        """From ``to_json``'s form (extra keys, such as a Plan record's, are ignored)."""
        return cls(*(Factor(int(obj[s]["intra"]), int(obj[s]["inter"])) for s in STATES))

    def __str__(self) -> str:
        return f"P={self.p} G={self.g} OS={self.os}"


def check_factor(topo: Topology, state: str, f: Factor) -> None:
    """Raise PlanError naming the rule that a single factor breaks."""
    key = f"lins.plan.{state}"
    for dim, value, bound, what in (
        ("intra", f.intra, topo.gpus_per_node, "gpus_per_node"),
        ("inter", f.inter, topo.nodes, "nodes"),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"{key}: {dim} factor {value!r} is not a positive integer")
        if bound % value:
            raise PlanError(f"{key}: {dim} factor {value} does not divide {what} {bound}")
    if f.inter > 1 and f.intra != topo.gpus_per_node:
        raise PlanError(
            f"{key}: factor {f} crosses nodes without filling one "
            f"(inter {f.inter} > 1 needs intra == gpus_per_node {topo.gpus_per_node})"
        )


def check_layout(topo: Topology, layout: Layout) -> None:
    """Raise PlanError unless ``layout`` is valid on ``topo`` (docs/design.md §2)."""
    for state, f in layout.factors().items():
        check_factor(topo, state, f)
    for fine, coarse in (("p", "g"), ("g", "os")):
        a, b = getattr(layout, fine), getattr(layout, coarse)
        if not a.divides(b):
            raise PlanError(
                f"lins.plan.{fine}: factor {a} must divide lins.plan.{coarse} factor {b} "
                "in both dimensions (nesting p | g | os)"
            )


def is_valid(topo: Topology, layout: Layout) -> bool:
    try:
        check_layout(topo, layout)
    except PlanError:
        return False
    return True


def state_factors(topo: Topology) -> list[Factor]:
    """Factors one state may take after the pre-filter: (a, 1) for a | L, then (L, b) for b | M."""
    L, M = topo.gpus_per_node, topo.nodes
    return [Factor(a, 1) for a in divisors(L)] + [Factor(L, b) for b in divisors(M) if b > 1]


def candidates(topo: Topology) -> list[Layout]:
    """Every valid layout, generated directly from the pre-filtered factor list (sorted)."""
    fs = state_factors(topo)
    out = []
    for p in fs:
        gs = [g for g in fs if p.divides(g)]
        for g in gs:
            out.extend(Layout(p, g, os) for os in fs if g.divides(os))
    return sorted(out)
