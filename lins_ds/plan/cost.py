"""The collectives one optimizer step issues under a layout, and their predicted time (docs/design.md §3).

This list is the executor's schedule written down; the runtime's collective recorder is tested
against it, so a change to either must change both. Per step of K micro-batches, per unit u of
n_u elements (the root unit first, then each decoder layer):

    P  (s_p > 1)     AllGather  n_u·p_bytes over the P group: forward, K times; backward re-gather,
                     K times for decoder layers (the root unit stays gathered through backward)
    G  (s_g > 1)     ReduceScatter n_u·r_bytes over the G group, K times
    G  (N/s_g > 1)   AllReduce  n_u·r_bytes/s_g over the G replica group, once (accumulation boundary)
(r_bytes: the gradient reduce dtype, by default the parameter dtype; accumulation may be wider.)
    OS (s_os > s_p)  AllGather  n_u·p_bytes/s_p over the P-sync group, once (after the optimizer)
    scalar           AllReduce of the squared gradient norm (clipping, logging, fp16 overflow), once
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import group_mesh
from .model import ModelSpec
from .profile_table import ProfileTable
from .spec import TrainingSpec
from .topology import Factor, Layout, Topology


@dataclass(frozen=True)
class Collective:
    state: str  # "p", "g", "os" or "scalar"
    phase: str  # "forward", "backward", "boundary", "param_sync"
    op: str
    group: str  # a layout group kind, or "world"
    mesh: Factor
    nbytes: int  # per call
    calls: int  # per optimizer step
    seconds: float = 0.0  # per call, from the profile

    @property
    def total_s(self) -> float:
        return self.calls * self.seconds

    def to_json(self) -> dict:
        return {"state": self.state, "phase": self.phase, "op": self.op, "group": self.group,
                "mesh": self.mesh.to_json(), "bytes": self.nbytes, "calls": self.calls,
                "seconds_per_call": self.seconds, "seconds": self.total_s}


def model_units(model: ModelSpec) -> list[tuple[int, bool]]:
    """(numel, is_root) per unit: the root unit, then each decoder layer."""
    params = model.unit_params()
    return [(params[0], True)] + [(n, False) for n in params[1:]]


def schedule(topo: Topology, layout: Layout, units: list, train: TrainingSpec) -> list[Collective]:
    """The collectives of one step for units [(numel, is_root)], untimed. Equal units are merged."""
    s_p, s_g, s_os = layout.sharding()
    K, pb, rb = train.grad_accum, train.param_bytes, train.reduce_bytes
    world = Factor(topo.gpus_per_node, topo.nodes)
    merged: dict[tuple, int] = {}
    for n, is_root in units:
        merged[(n, is_root)] = merged.get((n, is_root), 0) + 1
    units = [(n, c, r) for (n, r), c in sorted(merged.items(), key=lambda kv: (not kv[0][1], kv[0][0]))]

    out: list[Collective] = []

    def add(state, phase, op, group, nbytes, calls):
        mesh = world if group == "world" else group_mesh(topo, layout, group)
        if mesh.size > 1 and calls > 0 and nbytes > 0:
            out.append(Collective(state, phase, op, group, mesh, int(nbytes), int(calls)))

    for n, count, is_root in units:
        if s_p > 1:
            add("p", "forward", "all_gather", "p", n * pb, K * count)
            if not is_root:
                add("p", "backward", "all_gather", "p", n * pb, K * count)
        if s_g > 1:
            add("g", "backward", "reduce_scatter", "g", n * rb, K * count)
        add("g", "boundary", "all_reduce", "g_replica", n * rb // s_g, count)
        if s_os > s_p:
            add("os", "param_sync", "all_gather", "p_sync", n * pb // s_p, count)
    add("scalar", "boundary", "all_reduce", "world", 4, 1)  # squared grad norm; an fp16 overflow shows as inf
    return out


def timed(collectives: list[Collective], table: ProfileTable) -> list[Collective]:
    return [Collective(c.state, c.phase, c.op, c.group, c.mesh, c.nbytes, c.calls,
                       table.time(c.op, c.nbytes, c.mesh)) for c in collectives]


def per_state(collectives: list[Collective]) -> dict[str, float]:
    """Predicted seconds per step for T_p, T_g, T_os (and scalars)."""
    out = {"p": 0.0, "g": 0.0, "os": 0.0, "scalar": 0.0}
    for c in collectives:
        out[c.state] += c.total_s
    return out


PHASES = ("forward", "backward", "boundary", "param_sync")


def per_phase(collectives: list[Collective]) -> dict[str, float]:
    """Predicted seconds per step of the collectives issued in each phase."""
    out = dict.fromkeys(PHASES, 0.0)
    for c in collectives:
        out[c.phase] += c.total_s
    return out


def exposed_seconds(collectives: list[Collective], forward_s: float, backward_s: float, grad_accum: int,
                    overlap_param_sync: bool = True) -> float:
    """The communication a step waits for when it overlaps as the executor does (docs/design.md §3): the
    gathers and ReduceScatters of a phase behind that phase's compute, the boundary AllReduce behind the
    last backward, the P-sync behind the next forward (or all of it, without overlap).
    ``forward_s`` / ``backward_s``: compute of one micro-batch."""
    ph = per_phase(collectives)
    K = grad_accum
    sync = max(0.0, ph["param_sync"] - forward_s) if overlap_param_sync else ph["param_sync"]
    return (max(0.0, ph["forward"] - K * forward_s) + max(0.0, ph["backward"] - K * backward_s)
            + max(0.0, ph["boundary"] - backward_s) + sync)


def required_meshes(topo: Topology, layouts) -> set[Factor]:
    """Every mesh some layout's collectives run on: what a profile must cover."""
    meshes = {Factor(topo.gpus_per_node, topo.nodes)}
    for layout in layouts:
        meshes.update(group_mesh(topo, layout, kind) for kind in ("p", "g", "g_replica", "p_sync"))
    return {m for m in meshes if m.size > 1}
