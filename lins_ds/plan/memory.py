"""Per-GPU memory of a layout and an activation-checkpointing choice (docs/design.md §8).

The peak is the persistent state plus the larger of two phases; every term is kept separately so the
summary can show it:

    persistent   params        the P storage: every unit whole (s_p = 1) or this rank's P chunk
                 grads         the G accumulator, g_bytes x Phi / s_g
                 optimizer     fp32 master (unless params are fp32) + Adam moments, k_os x Phi / s_os
    backward     activations   what the layers and the head keep for backward, and the largest transient
                               on top (``ActivationProfile``: measured on the device, or the formula)
                 gathered      s_p > 1: the root unit + GATHERED_LAYERS layer units, gathered
                 grad_buffers  gradients as autograd makes them before they reach the accumulator (none
                               when each .grad is a view into it), ReduceScatter staging and outputs in
                               flight, the reduce-dtype copies of the replica AllReduce
    step         optimizer_step  the update runs unit by unit (torch's optimizers; else all at once): one
                               unit's OS chunk of fp32 gradient (when accumulated in another dtype) and
                               OPTIMIZER_TEMP_COPIES fp32 temporaries
    fixed        reserved      CUDA context and communicator buffers, outside the allocator
                 margin        allocator fragmentation, a fraction of the peak the allocator holds

Activations are measured, not assumed, where a device is at hand (``lins_ds.runtime.memory_probe``): one
layer unit's forward + backward on one micro-batch, with and without checkpointing, and the model outside
the layers (embedding, final norm, logits and the loss's fp32 upcast). The executor and this model share
the constants below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .model import ModelSpec
from .spec import GIB, MemorySpec, TrainingSpec
from .topology import Layout, Topology

GATHERED_LAYERS = 2  # layer units whose full parameters exist at once: the current one and the prefetched one
IN_FLIGHT_REDUCE_SCATTERS = 2  # ReduceScatters in flight before the oldest is completed
IN_FLIGHT_REPLICA_COPIES = 2  # replica AllReduces on reduce-dtype copies in flight before the oldest completes
OPTIMIZER_TEMP_COPIES = 1  # fp32 temporaries of torch's foreach Adam(W) per updated element (sqrt(v))

PERSISTENT = ("params", "grads", "optimizer")
BACKWARD = ("activations", "gathered", "grad_buffers")
STEP = ("optimizer_step",)
TERMS = PERSISTENT + BACKWARD + STEP + ("reserved", "margin")


@dataclass(frozen=True)
class ActivationProfile:
    """Activation memory of one micro-batch, in bytes (docs/design.md §8).

    layer_saved       what one layer unit keeps for backward, not checkpointed
    layer_saved_ckpt  the same with the layer checkpointed (its inputs)
    layer_transient   the extra peak while one layer's backward runs (recompute excluded)
    head_peak         the peak of everything outside the layers over forward and backward (embedding output,
                      final norm, logits, the loss's fp32 copies, their gradients)
    """

    source: str
    tokens: int
    layer_saved: float
    layer_saved_ckpt: float
    layer_transient: float
    head_peak: float

    def scaled(self, tokens: int) -> "ActivationProfile":
        """The same model at another micro-batch size x sequence length (activations scale with tokens)."""
        f = tokens / self.tokens
        return ActivationProfile(self.source, tokens, self.layer_saved * f, self.layer_saved_ckpt * f,
                                 self.layer_transient * f, self.head_peak * f)

    def peak(self, num_layers: int, ckpt_units: int) -> float:
        """Activation peak with the first ``ckpt_units`` of ``num_layers`` layer units checkpointed: at the head
        (every layer's saved tensors alive), in the top layer's backward, or in a checkpointed layer's
        backward (its recompute, once the layers above are freed)."""
        k, n = ckpt_units, num_layers
        kept = (n - k) * self.layer_saved + k * self.layer_saved_ckpt
        phases = [kept + self.head_peak]
        if k < n:
            phases.append(kept + self.layer_transient)
        if k > 0:
            phases.append(k * self.layer_saved_ckpt + self.layer_saved + self.layer_transient)
        return max(phases)

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, obj: dict) -> "ActivationProfile":
        return cls(str(obj["source"]), int(obj["tokens"]), float(obj["layer_saved"]),
                   float(obj["layer_saved_ckpt"]), float(obj["layer_transient"]), float(obj["head_peak"]))


def formula_activations(model: ModelSpec, train: TrainingSpec) -> ActivationProfile:
    """The profile without a device: FlashAttention-style layers (``ModelSpec.activation_width``), the
    layer input when checkpointed, one layer's worth of backward workspace, and a head that keeps the
    embedding output and the logits with the loss's fp32 copy and gradient."""
    tokens = train.tokens_per_micro_batch
    a = train.param_bytes
    layer = tokens * model.activation_width() * a
    head = tokens * (model.hidden * a + model.vocab * (a + 4 + 4))
    return ActivationProfile("formula", tokens, layer, tokens * model.hidden * a, layer, head)


def _grad_buffers(train: TrainingSpec, layout: Layout, replicas: int, max_unit: int, root: int, phi: float) -> float:
    """Gradient memory of the backward beyond the accumulator (docs/design.md §8)."""
    s_g = layout.g.size
    pb, rb = train.param_bytes, train.reduce_bytes
    accum, reduce = train.grad_accum_dtype or train.param_dtype, train.grad_reduce_dtype or train.param_dtype
    out = 0.0
    if not (s_g == 1 and accum == train.param_dtype):  # else each .grad is a view into the accumulator
        # autograd's .grad of the unit being reduced and of the root (reduced when the backward ends), the
        # staging buffers (one per ReduceScatter in flight and one being filled) and the ReduceScatter outputs
        staging = IN_FLIGHT_REDUCE_SCATTERS + 1 if s_g > 1 else 1
        out += (max_unit + root) * pb + staging * max_unit * rb
        out += staging * max_unit / s_g * rb if s_g > 1 else 0.0
    if replicas > 1 and accum != reduce:  # the boundary AllReduce runs on reduce-dtype copies of G chunks
        out += (IN_FLIGHT_REPLICA_COPIES + 1) * max_unit / s_g * rb
    return out


def memory(model: ModelSpec, train: TrainingSpec, mem: MemorySpec, topo: Topology, layout: Layout,
           ckpt_units: int, activations: Optional[ActivationProfile] = None) -> "MemoryBreakdown":
    phi = model.total_params()
    units = model.unit_params()
    pb, gb = train.param_bytes, train.grad_bytes
    s_p, s_g, s_os = layout.sharding()
    max_unit, max_layer = max(units), max(units[1:], default=0)
    acts = (activations or formula_activations(model, train)).scaled(train.tokens_per_micro_batch)
    step_grad = 4 if gb != 4 else 0  # the optimizer reads fp32 gradients
    terms = {
        "params": pb * phi / s_p,
        "grads": gb * phi / s_g,
        "optimizer": train.optimizer_bytes * phi / s_os,
        "activations": acts.peak(model.num_layers, ckpt_units),
        "gathered": (units[0] + GATHERED_LAYERS * max_layer) * pb if s_p > 1 else 0.0,
        "grad_buffers": _grad_buffers(train, layout, topo.world_size // s_g, max_unit, units[0], phi),
        "optimizer_step": (max_unit if train.optimizer_per_unit else phi) / s_os * (step_grad + 4 * OPTIMIZER_TEMP_COPIES),
    }
    terms = {k: v / GIB for k, v in terms.items()}
    peak = sum(terms[k] for k in PERSISTENT) + max(sum(terms[k] for k in BACKWARD), terms["optimizer_step"])
    terms["reserved"] = mem.reserved_gb
    terms["margin"] = mem.fragmentation * peak
    return MemoryBreakdown(terms, peak, acts.source)


@dataclass(frozen=True)
class MemoryBreakdown:
    terms: dict  # term -> GiB, in TERMS order
    allocated_gb: float  # the allocator's predicted peak (torch.cuda.max_memory_allocated's quantity)
    activation_source: str = "formula"

    @property
    def total_gb(self) -> float:
        """What the GPU must hold: the allocated peak, the allocator's margin and the fixed reserve."""
        return self.allocated_gb + self.terms["margin"] + self.terms["reserved"]

    @property
    def phase(self) -> str:
        """Which phase sets the peak: "backward" or "step"."""
        back = sum(self.terms[k] for k in BACKWARD)
        return "step" if self.terms["optimizer_step"] > back else "backward"

    def to_json(self) -> dict:
        return {k: round(v, 4) for k, v in self.terms.items()}
