"""Which chunk each rank owns and how process groups are ordered: a pure function of (layout, topology).

Every unit buffer is cut into s_os equal atoms. State x owns s_x chunks of s_os/s_x consecutive atoms.
A rank's digits (docs/design.md §2, "mixed radix, coarser state's index most significant"):

    local l = q_rep + (L/a_os)*(q_gos + (a_os/a_g)*(q_pg + (a_g/a_p)*q_p))
    node  m = e_rep + (M/b_os)*(e_gos + (b_os/b_g)*(e_pg + (b_g/b_p)*e_p))

    c_p  = e_p*a_p + q_p
    c_g  = c_p*(s_g/s_p)   + e_pg*(a_g/a_p)   + q_pg
    c_os = c_g*(s_os/s_g)  + e_gos*(a_os/a_g) + q_gos

so chunk c_os(r) lies inside chunk c_g(r), which lies inside chunk c_p(r). A group's ranks are listed
in chunk order, so that a plain AllGather / ReduceScatter lands every chunk where it belongs. The
coarser digit is the more significant one in l and in m too, so within one node (or with one GPU per
node) chunk order is global-rank order; only when a partial intra-node P meets a cross-node G or OS
(P = 2x1, G = 2x2) do the orders differ, and such groups are created with ``sort_ranks=False``.

Groups (each kind partitions the world):
- ``p``:         ranks holding the s_p different P chunks of one replica        (mesh a_p x b_p)
- ``g``:         ranks holding the s_g different G chunks of one replica        (mesh a_g x b_g)
- ``g_replica``: ranks holding the same G chunk; AllReduce at the boundary      (mesh L/a_g x M/b_g)
- ``p_sync``:    ranks holding the OS chunks of one P chunk; AllGather after the step (mesh os/p)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .topology import Factor, Layout, Topology

GROUP_KINDS = ("p", "g", "g_replica", "p_sync")


@dataclass(frozen=True)
class RankDigits:
    q_p: int
    q_pg: int
    q_gos: int
    q_rep: int
    e_p: int
    e_pg: int
    e_gos: int
    e_rep: int


def _split(x: int, radices: tuple[int, ...]) -> list[int]:
    out = []
    for r in radices:
        out.append(x % r)
        x //= r
    out.append(x)
    return out


def digits(topo: Topology, layout: Layout, rank: int) -> RankDigits:
    p, g, os = layout.p, layout.g, layout.os
    m, l = divmod(rank, topo.gpus_per_node)
    q_rep, q_gos, q_pg, q_p = _split(l, (topo.gpus_per_node // os.intra, os.intra // g.intra, g.intra // p.intra))
    e_rep, e_gos, e_pg, e_p = _split(m, (topo.nodes // os.inter, os.inter // g.inter, g.inter // p.inter))
    return RankDigits(q_p, q_pg, q_gos, q_rep, e_p, e_pg, e_gos, e_rep)


def is_first_replica(topo: Topology, layout: Layout, rank: int) -> bool:
    """Whether ``rank`` belongs to the first replica of the OS chunks (its replica digits are 0): the
    ranks that hold each OS chunk exactly once between them (what a checkpoint writes)."""
    d = digits(topo, layout, rank)
    return d.q_rep == 0 and d.e_rep == 0


@dataclass(frozen=True)
class RankChunks:
    p: int
    g: int
    os: int


def chunks(topo: Topology, layout: Layout, rank: int) -> RankChunks:
    p, g, os = layout.p, layout.g, layout.os
    d = digits(topo, layout, rank)
    c_p = d.e_p * p.intra + d.q_p
    c_g = c_p * (g.size // p.size) + d.e_pg * (g.intra // p.intra) + d.q_pg
    c_os = c_g * (os.size // g.size) + d.e_gos * (os.intra // g.intra) + d.q_gos
    return RankChunks(c_p, c_g, c_os)


def group_mesh(topo: Topology, layout: Layout, kind: str) -> Factor:
    p, g, os = layout.p, layout.g, layout.os
    return {
        "p": p,
        "g": g,
        "g_replica": Factor(topo.gpus_per_node // g.intra, topo.nodes // g.inter),
        "p_sync": os / p,
    }[kind]


def _group_key(d: RankDigits, c: RankChunks, kind: str) -> tuple:
    """Ranks with equal keys form one group of ``kind``."""
    if kind == "p":
        return (d.q_pg, d.q_gos, d.q_rep, d.e_pg, d.e_gos, d.e_rep)
    if kind == "g":
        return (d.q_gos, d.q_rep, d.e_gos, d.e_rep)
    if kind == "g_replica":
        return (c.g,)
    if kind == "p_sync":
        return (c.p, d.q_rep, d.e_rep)
    raise ValueError(f"unknown group kind {kind!r}; expected one of {GROUP_KINDS}")


def _order_key(c: RankChunks, rank: int, kind: str) -> tuple:
    return {"p": (c.p,), "g": (c.g,), "g_replica": (rank,), "p_sync": (c.os,)}[kind]


@lru_cache(maxsize=256)
def all_groups(topo: Topology, layout: Layout, kind: str) -> tuple[tuple[int, ...], ...]:
    """Every group of ``kind``, each listed in chunk order, groups sorted by their first rank.

    Every rank must create every group in this same order (collective group creation).
    """
    buckets: dict[tuple, list[tuple[tuple, int]]] = {}
    for r in range(topo.world_size):
        d, c = digits(topo, layout, r), chunks(topo, layout, r)
        buckets.setdefault(_group_key(d, c, kind), []).append((_order_key(c, r, kind), r))
    groups = [tuple(r for _, r in sorted(members)) for members in buckets.values()]
    return tuple(sorted(groups, key=lambda g: min(g)))


def group_of(topo: Topology, layout: Layout, kind: str, rank: int) -> tuple[int, ...]:
    for grp in all_groups(topo, layout, kind):
        if rank in grp:
            return grp
    raise AssertionError(f"rank {rank} in no {kind} group")  # groups partition the world


def needs_unsorted_groups(topo: Topology, layout: Layout) -> bool:
    """Whether some group's chunk order differs from global-rank order (process groups must then be
    created with ``sort_ranks=False``, torch >= 2.13). Only when both dimensions are split."""
    return any(list(g) != sorted(g) for kind in GROUP_KINDS for g in all_groups(topo, layout, kind))
