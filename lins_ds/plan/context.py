"""What the solver is given, and the rules that fill it in, in one place for every caller: the engine at start-up and
for a new sequence length, the memory guard, the tuner, and ``lins-ds plan``. The same inputs give the same plan
whoever asks: the defaults (reserve, compute model) are not written twice, and the offload policy is
``plan.offload.ladder`` walked by ``plan.offload.walk``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .clusters import get_cluster
from .memory import ActivationProfile
from .offload import RESIDENT, OffloadSpec, Placement
from .profile_table import ProfileTable
from .solver import ComputeSpec, Evaluation, evaluate, fewest_offloaded_placed, solve
from .spec import MemorySpec, TrainingSpec
from .topology import PlanError, Topology

DEFAULT_CLUSTER = "h200-emulated"  # lins.cluster's default: the compute model of a measured profile too
RESERVED_GB = {"cuda": 2.0}  # memory outside the allocator (CUDA context, communicator buffers); 0 elsewhere


def reserved_gb(given: Optional[float], device_type: str) -> float:
    """lins.reserved_gb / --reserved-gb where given, else what the device holds outside the allocator."""
    return given if given is not None else RESERVED_GB.get(device_type, 0.0)


def compute_for(table: ProfileTable, cluster: str) -> ComputeSpec:
    """The compute the solver prices recompute and the update with: a table that records it (``peak_tflops`` in its
    meta), else the built-in cluster ``cluster``'s (lins.cluster / --cluster)."""
    meta, base = table.meta, get_cluster(cluster).compute()
    if "peak_tflops" not in meta:
        return base
    return ComputeSpec(float(meta["peak_tflops"]), float(meta.get("achievable_mfu", base.achievable_mfu)),
                       float(meta.get("memory_bandwidth_gbs", base.memory_bandwidth_gbs)))


def check_placement(spec: OffloadSpec, layout, topo: Topology) -> None:
    """A fixed placement the layout cannot carry: one error naming the key."""
    if spec.mode == "off":
        return
    if not spec.grad_choices(layout, topo.world_size):
        raise PlanError(f"lins.offload.g: \"cpu\" keeps gradients on the host, which needs G sharded over every rank "
                        f"(no replica AllReduce after the ReduceScatter); {layout} shards G {layout.g.size} ways on "
                        f"{topo.world_size} ranks")
    if not spec.param_choices(layout):
        raise PlanError(f"lins.offload.p: \"cpu\" keeps parameters on the host, which needs s_p = s_os (the host "
                        f"optimizer writes the P chunk; no P-sync); {layout} has s_p {layout.p.size}, s_os "
                        f"{layout.os.size}")


@dataclass(frozen=True)
class SolveContext:
    """Everything the solver is given (the engine keeps its start-up one: the memory guard re-solves with it, the
    tuner's candidates come from its ``solution``)."""

    model: object
    topo: Topology
    train: TrainingSpec
    mem: MemorySpec
    table: ProfileTable
    compute: ComputeSpec
    layouts: list
    objective: str
    activations: Optional[ActivationProfile]
    activations_note: str = "formula"
    offload: OffloadSpec = OffloadSpec()
    solution: object = None  # the Solution it gave (every feasible plan: the tuner's candidates)

    def solve(self, capacity_gb: Optional[float] = None):
        mem = self.mem if capacity_gb is None else MemorySpec(capacity_gb, self.mem.reserved_gb, self.mem.fragmentation)
        return solve(self.model, self.topo, self.train, mem, self.table, self.compute, layouts=self.layouts,
                     objective=self.objective, activations=self.activations, offload=self.offload)

    def placements(self, layout) -> list:
        """The placements this offload allows under ``layout``, each of one unit (``Placement.with_units``; a fixed
        one it cannot carry: an error naming the key)."""
        check_placement(self.offload, layout, self.topo)
        return self.offload.placements(layout, self.topo.world_size)

    def allows(self, layout, placement: Placement) -> bool:
        """Whether this offload may put ``placement``'s units where it says under ``layout``."""
        return not placement.n_units or placement.with_units(1) in self.placements(layout)

    def evaluate(self, layout, ckpt_units: int, placement: Placement = RESIDENT) -> Evaluation:
        """The plan of ``layout`` with ``ckpt_units`` checkpointed and its units' states where ``placement`` says."""
        return evaluate(self.topo, layout, ckpt_units, self.model, self.train, self.mem, self.table, self.compute,
                        self.objective, self.activations, placement=placement, offload=self.offload)

    def fewest_offloaded(self, layout, ckpt_units: int) -> Evaluation:
        """The fastest of the fewest offloaded units that fit, per placement of their gradients and parameters."""
        e, _ = fewest_offloaded_placed(lambda placement: self.evaluate(layout, ckpt_units, placement),
                                       self.offload.choices(len(self.model.unit_params())), self.placements(layout))
        return e
