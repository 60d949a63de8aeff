"""What the solver is given, and the rules that fill it in, in one place for every caller: the engine at start-up and
for a new sequence length, the memory guard, the tuner, and ``lins-ds plan``. The same inputs give the same plan
whoever asks: the defaults (reserve, compute model) are not written twice, and the offload policy is
``plan.offload.ladder`` walked by ``plan.offload.walk``."""

from __future__ import annotations

import json
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


def compute_for(table: ProfileTable, cluster: str, model=None, activations: Optional[ActivationProfile] = None
                ) -> ComputeSpec:
    """The compute the solver prices recompute, overlap and the update with: a table that records it (``peak_tflops``
    in its meta), else the built-in cluster ``cluster``'s (lins.cluster / --cluster); at the rate one layer's forward
    and backward ran on this device where the memory probe timed it (``measured_efficiency``): the cluster's assumed
    fraction of the peak priced a 3B model's backward 1.45x longer than it ran on an H100, and so the host time it
    hides."""
    meta, base = table.meta, get_cluster(cluster).compute()
    spec = base if "peak_tflops" not in meta else ComputeSpec(
        float(meta["peak_tflops"]), float(meta.get("achievable_mfu", base.achievable_mfu)),
        float(meta.get("memory_bandwidth_gbs", base.memory_bandwidth_gbs)))
    efficiency = measured_efficiency(model, activations, spec.peak_tflops)
    return spec if efficiency is None else spec.at(efficiency)


def read_activations(path: str, key: str) -> ActivationProfile:
    """An activation memory profile from a file (``lins.memory_profile`` / ``lins-ds plan --memory-profile``): what
    ``lins-ds profile --memory`` wrote or an engine's start-up cached (``{"key": ..., "profile": ...}``), or the profile
    alone; ``key`` names the setting in the error."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        return ActivationProfile.from_json(obj.get("profile", obj))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise PlanError(f"{key}: {path} is not a memory profile ({e})") from None


MIN_MEASURED_EFFICIENCY = 0.02  # a timing below this share of the peak is a broken one (a busy device), not a rate
MAX_MEASURED_EFFICIENCY = 1.0  # ... and above the peak, a FLOP count that is not the layer's


def measured_efficiency(model, activations: Optional[ActivationProfile], peak_tflops: float) -> Optional[float]:
    """The share of ``peak_tflops`` one layer unit's timed forward and backward ran at (``ActivationProfile.timed``),
    counted in the FLOPs the solver prices a layer with (3 x ``layer_forward_flops_per_token``); None where it was not
    timed or the timing is not believable, and for an MoE layer: the probe's empty weights route every token to the
    same experts, a few large GEMMs where training runs many small ones."""
    if model is None or activations is None or not activations.timed or getattr(model, "experts", 0):
        return None
    seconds, tokens, seq_len = activations.timed
    if seconds <= 0 or tokens <= 0:
        return None
    efficiency = 3 * tokens * model.layer_forward_flops_per_token(seq_len) / (seconds * peak_tflops * 1e12)
    return efficiency if MIN_MEASURED_EFFICIENCY <= efficiency <= MAX_MEASURED_EFFICIENCY else None


def compute_note(model, activations: Optional[ActivationProfile], compute: ComputeSpec, cluster: str) -> str:
    """The start-up summary's words for the rate compute is priced at where the probe timed a layer ("" where not)."""
    assumed = get_cluster(cluster).compute().achievable_mfu
    rate = (f"{compute.flops_per_s / 1e12:.0f} TFLOP/s, {100 * compute.achievable_mfu:.0f} % of "
            f"{compute.peak_tflops:.0f}")
    if activations is None or not activations.timed:
        return ""  # nothing measured: the cluster's model, as ever (no words)
    if measured_efficiency(model, activations, compute.peak_tflops) is None:
        why = ("an MoE layer's timing under the probe's routing is not its rate" if getattr(model, "experts", 0)
               else f"one layer's timing, {activations.timed[0]:.3g} s, is not believable")
        return f"{rate} (the {cluster} model's; {why})"
    seconds, tokens, _ = activations.timed
    return (f"{rate}: one layer's forward and backward ran {1e3 * seconds:.2f} ms for {tokens} tokens on this device "
            f"(the {cluster} model assumes {100 * assumed:.0f} %)")


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
    compute_note: str = ""  # ``compute_note``'s words: the start-up summary's

    def host_update_rate(self, in_backward: bool = False) -> Optional[float]:
        """The host update's elements per second this context prices offload with, with the updates inside the last
        backward or after the step (None: it has no host)."""
        return self.offload.host.update_rate(in_backward) if self.offload.host is not None else None

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
