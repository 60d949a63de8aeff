"""Solver: the fastest plan that fits (docs/design.md §7). Enumerate every valid layout — a few hundred even at
1024 GPUs — and, unless the user fixed it, how many layer units to checkpoint (0..N: selective activation
checkpointing); drop what does not fit in memory; minimise the objective. ``"step"`` (the default) is what the
user waits for: the communication left exposed after the executor's overlap, the recompute, and the optimizer
update (each rank updates 1/s_os of the model); ``"comm"`` (the paper's, to reproduce its Table III) is all
predicted communication plus recompute. Per layout the fewest checkpointed units that fit win (recompute only
grows with them). Deterministic: ties go to fewer offloaded units, then to the less sharded layout, then to the
smaller layout in sort order, so every rank picks the same plan.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from . import cost
from .memory import UPLOADED_LAYERS, ActivationProfile, MemoryBreakdown, memory
from .model import ModelSpec
from .offload import (RESIDENT, HostSpec, OffloadSpec, Placement, exposed_seconds as offload_exposed,
                      host_optimizer_of, updates_in_backward)
from .profile_table import ProfileTable
from .sequence import activation_offload_seconds, extra_flops
from .spec import MemorySpec, TrainingSpec
from .topology import Layout, PlanError, Topology, candidates, check_layout


def _gib(x: float) -> str:
    return f"{x:.2f}" if x >= 0.1 else f"{x:.3g}"


class NoFeasiblePlan(PlanError):
    def __init__(self, message: str, smallest: "Evaluation", capacity_gb: float):
        super().__init__(message)
        self.smallest = smallest
        self.capacity_gb = capacity_gb


@dataclass(frozen=True)
class ComputeSpec:
    """How fast the GPU computes and streams memory: prices the recompute of activation
    checkpointing and the optimizer update, which shrinks as OS is sharded further."""

    peak_tflops: float = 312.0
    achievable_mfu: float = 0.5
    memory_bandwidth_gbs: float = 1200.0  # achieved by the element-wise optimizer update
    # a device's measured compute table (bench/compute_model.py's ``ComputeTable``, whose ``step_compute`` prices
    # compute from the model's shape), ``achievable_mfu`` then the fraction of the table's rates a whole step
    # achieves (1: as fast as measured). The simulator's; the engine prices by FLOPs.
    table: Optional[object] = None

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.achievable_mfu

    def at(self, efficiency: float) -> "ComputeSpec":
        """The same GPU at another achievable fraction of its peak."""
        return replace(self, achievable_mfu=efficiency)


def optimizer_seconds(model: ModelSpec, train: TrainingSpec, s_os: int, compute: ComputeSpec,
                      os_off_device: int = 0) -> float:
    """The element-wise update of this rank's OS chunk on the GPU (of the units but the last ``os_off_device``,
    whose OS is elsewhere) is memory-bound: it reads the gradient (fp32), reads and writes master and moments, and
    writes the parameter."""
    touched = 4 + 2 * train.optimizer_bytes + (train.param_bytes if train.param_dtype != "fp32" else 0)
    units = model.unit_params()
    return touched * sum(units[:len(units) - os_off_device]) / s_os / (compute.memory_bandwidth_gbs * 1e9)


@dataclass(frozen=True)
class Evaluation:
    layout: Layout
    ckpt_units: int  # layer units checkpointed (the first ones)
    memory: MemoryBreakdown
    collectives: tuple
    recompute_s: float
    capacity_gb: float
    optimizer_s: float = 0.0
    objective: str = "step"
    exposed_s: float = 0.0  # communication left after overlap
    num_layers: int = 0
    placement: Placement = RESIDENT  # the last k units' OS off the device, and their G and P where it says
    offload_s: float = 0.0  # what the step waits for the host (transfers and updates the forward does not hide)
    host_capacity_gb: float = float("inf")
    num_units: int = 0
    host_optimizer: str = "torch"  # what updates the OS chunks on the host: "torch" or "deepspeed" (DeepSpeedCPUAdam)
    act_offload_units: int = 0  # checkpointed layer units whose inputs wait on the host (activation offload)
    act_offload_s: float = 0.0  # what the step waits for their copies

    @property
    def checkpointing(self) -> bool:
        return self.ckpt_units > 0

    @property
    def comm_s(self) -> float:
        return sum(c.total_s for c in self.collectives)

    @property
    def objective_s(self) -> float:
        if self.objective == "comm":
            return self.comm_s + self.recompute_s
        return self.exposed_s + self.recompute_s + self.optimizer_s + self.offload_s + self.act_offload_s

    @property
    def fits_gpu(self) -> bool:
        return self.memory.total_gb <= self.capacity_gb

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.memory.host_gb <= self.host_capacity_gb

    def sort_key(self) -> tuple:
        s_p, s_g, s_os = self.layout.sharding()
        return (self.objective_s, self.placement.n_units, s_os * s_g * s_p, s_p, s_g, s_os, self.layout,
                self.ckpt_units, self.placement.order())


@dataclass(frozen=True)
class Plan:
    """What the runtime executes. Pure data: JSON round-trips, and every rank must hold the same one."""

    topology: Topology
    layout: Layout
    activation_checkpointing_units: int = 0  # the first k layer units are checkpointed
    param_dtype: str = "bf16"
    grad_dtype: str = "fp32"
    model: str = ""
    profile_source: str = ""
    predicted_comm_s: float = 0.0
    memory_gb: float = 0.0  # what the GPU must hold: allocated peak, margin and reserve
    predicted_peak_gb: float = 0.0  # the allocator's peak (torch.cuda.max_memory_allocated's quantity)
    memory_profile: str = ""  # where the activation memory came from ("measured:...", "formula", a path)
    num_layers: int = 0
    placement: Placement = RESIDENT  # which units (the last k, root first) keep which states off the device
    host_gb: float = 0.0  # host memory the offloaded OS chunks pin on this rank
    host_optimizer: str = "torch"  # what updates the OS chunks on the host: "torch" or "deepspeed" (DeepSpeedCPUAdam)
    mlp_tiles: int = 1  # sequence tiling (``plan.sequence``): the MLPs computed this many sequence tiles at a time
    logits_tiles: int = 1  # ... and the logits with their loss
    activation_offload_units: int = 0  # of the checkpointed layer units, the first this many keep their inputs on the host
    host_update_in_backward: bool = False  # the offloaded units' host updates start inside the window's last backward

    @property
    def activation_checkpointing(self) -> bool:
        return self.activation_checkpointing_units > 0

    def to_json(self) -> dict:
        return {
            "nodes": self.topology.nodes, "gpus_per_node": self.topology.gpus_per_node,
            **self.layout.to_json(), "activation_checkpointing": self.activation_checkpointing,
            "activation_checkpointing_units": self.activation_checkpointing_units, "num_layers": self.num_layers,
            "param_dtype": self.param_dtype, "grad_dtype": self.grad_dtype, "model": self.model,
            "profile_source": self.profile_source, "predicted_comm_s": self.predicted_comm_s,
            "memory_gb": self.memory_gb, "predicted_peak_gb": self.predicted_peak_gb,
            "memory_profile": self.memory_profile, **self.placement.legacy_json(), "host_gb": self.host_gb,
            "host_optimizer": self.host_optimizer, **self._placement_json(), **self._tiling_json(),
            **({"host_update_in_backward": True} if self.host_update_in_backward else {}),
        }

    def _tiling_json(self) -> dict:
        """The sequence tiling and the activation offload, where there are (a plan without them has the JSON and
        digest it had before they existed)."""
        tiled = self.mlp_tiles > 1 or self.logits_tiles > 1
        out = {"mlp_tiles": self.mlp_tiles, "logits_tiles": self.logits_tiles} if tiled else {}
        return {**out, "activation_offload_units": self.activation_offload_units} if self.activation_offload_units \
            else out

    def _placement_json(self) -> dict:
        """The placement itself, where something is offloaded: the legacy keys above say it for the host tier (and
        every reader of a plan's JSON reads those), but not which tier. A GPU-resident plan writes none, so its JSON,
        and its digest, are as before the type."""
        return {"placement": self.placement.to_json()} if self.placement.n_units else {}

    @classmethod
    def from_json(cls, obj: dict) -> "Plan":
        topo = Topology(int(obj["nodes"]), int(obj["gpus_per_node"]))
        layout = Layout.from_json(obj)
        check_layout(topo, layout)
        layers = int(obj.get("num_layers", 0))
        units = int(obj.get("activation_checkpointing_units", layers if obj["activation_checkpointing"] else 0))
        return cls(topo, layout, units, obj["param_dtype"], obj["grad_dtype"], obj.get("model", ""),
                   obj.get("profile_source", ""), float(obj.get("predicted_comm_s", 0)),
                   float(obj.get("memory_gb", 0)), float(obj.get("predicted_peak_gb", 0)),
                   obj.get("memory_profile", ""), layers, _placement_of(obj), float(obj.get("host_gb", 0.0)),
                   str(obj.get("host_optimizer", "torch")), int(obj.get("mlp_tiles", 1)),
                   int(obj.get("logits_tiles", 1)), int(obj.get("activation_offload_units", 0)),
                   bool(obj.get("host_update_in_backward", False)))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def _placement_of(obj: dict) -> Placement:
    """A plan JSON's placement: its "placement" where it has one, else the keys every plan has written
    (``offload_units``, ``offload_grads``, ``offload_params``: a plan written before the type, or by a tool). Where
    it has both they must agree: an edit of one alone is refused, not half read."""
    legacy = Placement.from_legacy(obj)
    if "placement" not in obj:
        return legacy
    placement = Placement.from_json(obj["placement"])
    if placement.legacy_json() != legacy.legacy_json():
        raise PlanError(f"plan: its placement {placement.to_json()} and its offload keys "
                        f"{ {k: obj.get(k) for k in legacy.legacy_json()} } disagree")
    return placement


@dataclass(frozen=True)
class Solution:
    plan: Plan
    best: Evaluation
    runner_up: Optional[Evaluation]
    fastest_infeasible: Optional[Evaluation]  # faster than the best but did not fit
    considered: int
    feasible: int
    elapsed_s: float
    inputs: dict = field(default_factory=dict)
    fitting: tuple = ()  # every feasible plan found, best first (the tuner's candidates come from it)


OBJECTIVES = ("step", "comm")


def compute_seconds(model: ModelSpec, train: TrainingSpec, compute: ComputeSpec, ckpt_units: int) -> tuple:
    """(forward, backward) compute of one micro-batch; backward is twice the forward plus the recompute of
    the checkpointed units and, under sequence tiling, of the tiled MLPs' and lm_head's forward."""
    tiling = extra_flops(model, train) / compute.flops_per_s  # a tiled MLP's and lm_head's forward again
    if compute.table is not None:  # the shape model (bench/compute_model.py)
        one = compute.table.step_compute(model, replace(train, grad_accum=1), ckpt_units)
        return (one.forward_s / compute.achievable_mfu,
                (one.total_s - one.forward_s) / compute.achievable_mfu + tiling)
    tokens = train.tokens_per_micro_batch
    fwd = tokens * model.flops_per_token(train.seq_len) / 3 / compute.flops_per_s
    recompute = ckpt_units * tokens * model.layer_forward_flops_per_token(train.seq_len) / compute.flops_per_s
    return fwd, 2 * fwd + recompute + tiling


def evaluate(topo: Topology, layout: Layout, ckpt_units: int, model: ModelSpec, train: TrainingSpec,
             mem: MemorySpec, table: ProfileTable, compute: ComputeSpec, objective: str = "step",
             activations: Optional[ActivationProfile] = None, colls: Optional[tuple] = None,
             placement: Placement = RESIDENT, offload: OffloadSpec = OffloadSpec()) -> Evaluation:
    if colls is None:
        colls = tuple(cost.timed(cost.schedule(topo, layout, cost.model_units(model), train), table))
    fwd, bwd = compute_seconds(model, train, compute, ckpt_units)
    recompute = train.grad_accum * (bwd - 2 * fwd)
    exposed = cost.exposed_seconds(list(colls), fwd, bwd, train.grad_accum)
    units = model.unit_params()
    host = offload.host
    in_backward = updates_in_backward(train, layout, topo.world_size, placement)
    off_s = (offload_exposed(units, placement, layout, replace(train, host_update_in_backward=in_backward), host,
                             fwd, train.grad_accum * (fwd + bwd) - fwd, backward_s=bwd) if placement.n_units else 0.0)

    def at(act_units: int) -> Evaluation:
        mb = memory(model, train, mem, topo, layout, ckpt_units, activations, placement, act_units)
        act_s = (activation_offload_seconds(mb.activation_host_gb * 2**30 / act_units, act_units, host, fwd, bwd,
                                            model.num_layers, train.grad_accum) if act_units else 0.0)
        return Evaluation(layout, ckpt_units, mb, colls, recompute, mem.capacity_gb,
                          optimizer_seconds(model, train, layout.os.size, compute, placement.units_of("os")),
                          objective, exposed, model.num_layers, placement, off_s,
                          host.capacity_gb if host is not None else float("inf"), len(units),
                          act_offload_units=act_units, act_offload_s=act_s)

    wanted = train.activation_offload
    if host is None or not wanted or not ckpt_units:
        return at(0)
    if wanted is not True:  # a number: that many, of the checkpointed units there are
        return at(min(wanted, ckpt_units))
    if ckpt_units <= UPLOADED_LAYERS:  # fewer than that save nothing: every one is back on the device at the peak
        return at(0)
    return fewest_offloaded(at, [0, *range(UPLOADED_LAYERS + 1, ckpt_units + 1)])[0]


def check_profile_covers(topo: Topology, layouts, table: ProfileTable) -> None:
    missing = sorted(m for m in cost.required_meshes(topo, layouts)
                     if not all(table.has(op, m) for op in ("all_gather", "reduce_scatter", "all_reduce")))
    if missing:
        raise PlanError(f"profile {table.source} lacks meshes {', '.join(map(str, missing))} "
                        f"needed for {topo.nodes} nodes x {topo.gpus_per_node} GPUs; re-run lins-ds profile")


def _describe_ckpt(e: Evaluation) -> str:
    ck = f" with {e.ckpt_units} of {e.num_layers} layer units checkpointed" if e.checkpointing else ""
    p = e.placement
    off = (f"{' and' if ck else ' with'} the {p.placed()} of {p.n_units} of {e.num_units} units {p.where()}"
           if p.n_units else "")
    act = f", the inputs of {e.act_offload_units} of them on the host" if e.act_offload_units else ""
    return ck + act + off


def best_placement(evals: list) -> Evaluation:
    """Of the same plan under several placements (its offloaded units' G and P on the GPU or off it): the faster of
    those that fit the GPU, else the smaller."""
    fitting = [e for e in evals if e.fits] or [e for e in evals if e.fits_gpu]
    if fitting:
        return min(fitting, key=Evaluation.sort_key)
    return min(evals, key=lambda e: (e.memory.total_gb, e.sort_key()))


def fewest_offloaded(ev, choices: list) -> tuple:
    """(evaluation, how many evaluated): the fewest offloaded units whose plan fits the GPU (GPU memory only falls
    as units leave it; host memory only grows), or the most offloaded when none does."""
    first = ev(choices[0])
    if first.fits_gpu or len(choices) == 1:
        return first, 1
    lo, hi, best, n = 1, len(choices) - 1, None, 1
    while lo <= hi:
        mid = (lo + hi) // 2
        e, n = ev(choices[mid]), n + 1
        if e.fits_gpu:
            best, hi = e, mid - 1
        else:
            lo = mid + 1
    return (best, n) if best is not None else (ev(choices[-1]), n + 1)


def fewest_offloaded_placed(ev, choices: list, placements: list, seen: Optional[list] = None) -> tuple:
    """(evaluation, how many evaluated): ``ev(placement)`` for each of ``placements`` (``OffloadSpec.placements``:
    the tiers of the offloaded units' states) with the fewest offloaded units that fit (``fewest_offloaded`` over
    ``choices``: within one placement more offload only costs time and only saves memory); then the faster of those
    that fit. Across placements fewer is not faster: G or P on the host lets fewer units fit, but adds the host's
    sums during backward, or the uploads before each use. ``seen``: gets each placement's evaluation too (what the
    error names where no plan fits the host: the placement that needs the least of it, not the fastest)."""
    found, count = [], 0
    for shape in placements:
        e, n = fewest_offloaded(lambda o: ev(shape.with_units(o)), choices)
        found.append(e)
        count += n
    if seen is not None:
        seen.extend(found)
    return best_placement(found), count


def _no_plan(smallest: Evaluation, mem: MemorySpec) -> NoFeasiblePlan:
    if smallest.fits_gpu:  # host memory is what is short
        return NoFeasiblePlan(
            f"no plan fits: of those that fit the GPU, the one that needs the least host memory, "
            f"{smallest.layout}{_describe_ckpt(smallest)}, needs "
            f"{_gib(smallest.memory.host_gb)} GiB of host memory per rank for its offloaded optimizer state, "
            f"{_gib(smallest.host_capacity_gb)} GiB available (lins.host_memory_gb / --host-memory-gb)",
            smallest, mem.capacity_gb)
    lack = smallest.memory.total_gb - mem.capacity_gb
    reserve = (f", {mem.reserved_gb:g} GiB of it the reserve outside the allocator (lins.reserved_gb / "
               f"--reserved-gb)" if mem.reserved_gb else "")
    return NoFeasiblePlan(
        f"no plan fits in {mem.capacity_gb:g} GiB per GPU (lins.gpu_memory_gb / --gpu-memory-gb): the "
        f"smallest, {smallest.layout}{_describe_ckpt(smallest)}, needs {_gib(smallest.memory.total_gb)} GiB"
        f"{reserve} ({_gib(lack)} GiB more than available)", smallest, mem.capacity_gb)


def plan_of(e: Evaluation, topo: Topology, model: ModelSpec, train: TrainingSpec, table: ProfileTable,
            host: Optional[HostSpec] = None) -> Plan:
    """The plan an evaluation describes (what the runtime executes); ``host``: the offload's host, whose optimizer
    updates the offloaded units."""
    return Plan(topo, e.layout, e.ckpt_units, train.param_dtype, train.grad_accum_dtype or train.param_dtype,
                model.name, table.source, e.comm_s, e.memory.total_gb, e.memory.allocated_gb,
                e.memory.activation_source, model.num_layers, e.placement, e.memory.host_gb,
                host_optimizer_of(host, e.placement), train.mlp_tiles, train.logits_tiles, e.act_offload_units,
                updates_in_backward(train, e.layout, topo.world_size, e.placement))


def solve(model: ModelSpec, topo: Topology, train: TrainingSpec, mem: MemorySpec, table: ProfileTable,
          compute: ComputeSpec = ComputeSpec(), layouts: Optional[list] = None, objective: str = "step",
          activations: Optional[ActivationProfile] = None, offload: OffloadSpec = OffloadSpec()) -> Solution:
    """The fastest fitting plan under exactly ``offload``; raises NoFeasiblePlan naming the smallest plan and its
    deficit. Per layout and checkpointing choice, the fewest offloaded units that fit (none unless ``offload`` allows).
    Which offload to try, and in which order, is ``plan.offload.ladder``'s, walked by ``plan.offload.walk``."""
    if objective not in OBJECTIVES:
        raise PlanError(f"objective: {objective!r} is not one of {OBJECTIVES}")
    t0 = time.perf_counter()
    layouts = candidates(topo) if layouts is None else layouts
    check_profile_covers(topo, layouts, table)
    choices = train.checkpoint_choices(model.num_layers)
    offload_choices = offload.choices(len(model.unit_params()))
    evals, smallest, least_host, considered = [], None, None, 0
    for lay in layouts:
        colls = tuple(cost.timed(cost.schedule(topo, lay, cost.model_units(model), train), table))

        places = offload.placements(lay, topo.world_size)
        if not places:
            continue  # this offload keeps G (or P) on the host, which this layout does not allow

        def ev(k, placement):
            return evaluate(topo, lay, k, model, train, mem, table, compute, objective, activations, colls, placement,
                            offload)

        for k in choices:  # ascending: the first that fits without more offload than needed is this layout's best
            placed: list = []
            e, n = fewest_offloaded_placed(lambda placement: ev(k, placement), offload_choices, places, placed)
            considered += n
            if k == choices[0] or e.fits:
                evals.append(e)
            if smallest is None or (e.memory.total_gb, e.sort_key()) < (smallest.memory.total_gb, smallest.sort_key()):
                smallest = e
            for p in placed:  # of every placement, not only the fastest: the host the least demanding one needs
                if p.fits_gpu and (least_host is None or p.memory.host_gb < least_host.memory.host_gb):
                    least_host = p
            if e.fits and e.placement.n_units == offload_choices[0]:
                break  # more checkpointing only costs more
    if smallest is None:
        g_ok = any(offload.grad_choices(lay, topo.world_size) for lay in layouts)
        raise PlanError("lins.offload.g: \"cpu\" keeps gradients on the host, which needs a layout whose G is sharded "
                        "over every rank (no replica AllReduce); none of the layouts considered is" if not g_ok else
                        "lins.offload.p: \"cpu\" keeps parameters on the host, which needs a layout with s_p = s_os "
                        "(no P-sync) and the gradient placement asked for; none of the layouts considered is")
    fitting = sorted((e for e in evals if e.fits), key=Evaluation.sort_key)
    if not fitting:
        raise _no_plan(least_host or smallest, mem)
    best = fitting[0]
    faster = [e for e in evals if not e.fits and e.objective_s < best.objective_s]
    return Solution(plan_of(best, topo, model, train, table, offload.host), best, fitting[1] if len(fitting) > 1 else None,
                    min(faster, key=Evaluation.sort_key) if faster else None,
                    considered, len(fitting), time.perf_counter() - t0, fitting=tuple(fitting))
