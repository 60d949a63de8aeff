"""Per-GPU memory of a layout and an activation-checkpointing choice (docs/design.md §8).

The peak is the persistent state plus the larger of two phases; every term is kept separately so the
summary can show it:

    persistent   params        the P storage: every unit whole (s_p = 1) or this rank's P chunk
                 optimizer     fp32 master (unless params are fp32) + Adam moments, k_os x Phi / s_os (of the
                               units whose OS is on the GPU; the offloaded ones' is host memory, ``host_gb``)
    backward     the largest of its phases (``backward_phases``: the loss's backward, a layer's backward, a
                 checkpointed layer's recompute, the root's reduction at the end), each split into
                 grads         the G accumulators that exist then: a unit's is allocated when its first gradient
                               arrives and freed after the optimizer step, so a window's first backward holds
                               only the units it has reached (all of them from its second micro-batch on)
                 activations   what the layers and the head keep for backward, and the transient on top
                               (``ActivationProfile``: measured on the device, or the formula)
                 gathered      s_p > 1: the root unit and the layer units gathered then
                 grad_buffers  gradients as autograd makes them before they reach the accumulator (none
                               when each .grad is a view into it), ReduceScatter staging and outputs in
                               flight, the reduce-dtype copies of the replica AllReduce
    step         grads         every G accumulator, g_bytes x Phi / s_g
                 optimizer_step  the update runs unit by unit (torch's optimizers; else all at once): one
                               unit's OS chunk of fp32 gradient (when accumulated in another dtype) and
                               OPTIMIZER_TEMP_COPIES fp32 temporaries
    fixed        reserved      CUDA context and communicator buffers, outside the allocator
                 margin        allocator fragmentation, a fraction of the peak the allocator holds

Activations are measured, not assumed, where a device is at hand (``lins_ds.runtime.memory.memory_probe``): one
layer unit's forward + backward on one micro-batch, with and without checkpointing, and the model outside
the layers (embedding, final norm, logits and the loss's fp32 upcast). The executor and this model share
the constants below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .model import ModelSpec
from .offload import RESIDENT, Placement, host_gb
from .spec import GIB, MemorySpec, TrainingSpec
from .topology import Layout, Topology

PREFETCHED_LAYERS = 1  # layer units gathered ahead of the one running (the executor's prefetch depth)
# activation offload: the offloaded layers whose inputs are on the device at once in the backward (the one recomputing,
# one uploaded ahead: ``runtime.step.activation_offload.PREFETCHED_LAYERS``)
UPLOADED_LAYERS = 2
GATHERED_LAYERS = 1 + PREFETCHED_LAYERS  # layer units whose full parameters exist at once
IN_FLIGHT_REDUCE_SCATTERS = 2  # ReduceScatters in flight before the oldest is completed
IN_FLIGHT_REPLICA_COPIES = 2  # replica AllReduces on reduce-dtype copies in flight before the oldest completes
OPTIMIZER_TEMP_COPIES = 1  # fp32 temporaries of torch's foreach Adam(W) per updated element (sqrt(v))

PERSISTENT = ("params", "optimizer")
BACKWARD = ("grads", "activations", "gathered", "grad_buffers")
STEP = ("optimizer_step",)
TERMS = PERSISTENT + BACKWARD + STEP + ("reserved", "margin")


FIELDS = ("layer_saved", "layer_saved_ckpt", "layer_transient", "head_peak")


@dataclass(frozen=True)
class ActivationProfile:
    """Activation memory of one micro-batch, in bytes (docs/design.md §8).

    layer_saved       what one layer unit keeps for backward, not checkpointed
    layer_saved_ckpt  the same with the layer checkpointed (its inputs)
    layer_transient   the extra peak while one layer's backward runs (recompute excluded)
    head_peak         the peak of everything outside the layers over forward and backward (embedding output,
                      final norm, logits, the loss's fp32 copies, their gradients)

    Each is the value at ``tokens`` (= micro-batch x ``seq_len``). Most of it grows with the tokens; what eager
    attention keeps (its seq x seq weights, the soft-capping and softmax intermediates) and an eager causal mask
    grow with micro-batch x seq_len squared. ``quadratic`` holds, per field, the bytes of that second kind at the
    measured point (the probe fits both from two lengths; the formula models eager attention), so ``scaled`` never
    stretches a quadratic term linearly (``seq_len`` 0: unknown, every term scales with the tokens).

    ``tiled_head`` (measured on a GPU where the model can be tiled; empty otherwise): the head under logits tiling,
    as (bytes that grow with the tokens, at ``tokens``; bytes per logit of one tile), the lm_head gradient the tiles
    accumulate not included (``tiled_head_bytes``).

    ``timed`` (measured on a GPU; empty otherwise): one layer unit's forward and backward, no recompute, as (seconds,
    tokens, sequence length) of the run timed; not scaled with the profile (``plan.context.compute_for`` turns it into
    the rate the solver prices compute at).
    """

    source: str
    tokens: int
    layer_saved: float
    layer_saved_ckpt: float
    layer_transient: float
    head_peak: float
    seq_len: int = 0
    quadratic: tuple = (0.0, 0.0, 0.0, 0.0)  # bytes of each of FIELDS that grow as micro-batch x seq_len^2
    tiled_head: tuple = ()  # (base bytes at ``tokens``, bytes per logit of one tile): the tiled loss, measured
    timed: tuple = ()  # (seconds, tokens, seq_len): one layer's forward + backward, measured

    def scaled(self, tokens: int, seq_len: int = 0) -> "ActivationProfile":
        """The same model at another micro-batch size x sequence length: the linear part of each term scales with
        the tokens, the quadratic part with the tokens times the length (where both lengths are known)."""
        f = tokens / self.tokens
        g = seq_len / self.seq_len if seq_len and self.seq_len else 1.0
        values = [(getattr(self, k) - q) * f + q * f * g for k, q in zip(FIELDS, self.quadratic)]
        tiled = (self.tiled_head[0] * f, self.tiled_head[1]) if self.tiled_head else ()
        return ActivationProfile(self.source, tokens, *values, seq_len=seq_len or self.seq_len,
                                 quadratic=tuple(q * f * g for q in self.quadratic), tiled_head=tiled,
                                 timed=self.timed)

    def to_json(self) -> dict:
        out = dict(self.__dict__)
        out["quadratic"] = list(self.quadratic)
        if self.tiled_head:  # else written as before it existed
            out["tiled_head"] = list(self.tiled_head)
        else:
            del out["tiled_head"]
        if self.timed:
            out["timed"] = list(self.timed)
        else:
            del out["timed"]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "ActivationProfile":
        quad = tuple(float(q) for q in obj.get("quadratic", (0.0,) * len(FIELDS)))
        if len(quad) != len(FIELDS):
            raise ValueError(f"quadratic: {len(quad)} values, expected {len(FIELDS)}")
        tiled = tuple(float(v) for v in obj.get("tiled_head", ()))
        if tiled and len(tiled) != 2:
            raise ValueError(f"tiled_head: {len(tiled)} values, expected 2")
        timed = tuple(obj.get("timed", ()))
        if timed and len(timed) != 3:
            raise ValueError(f"timed: {len(timed)} values, expected 3 (seconds, tokens, seq_len)")
        timed = (float(timed[0]), int(timed[1]), int(timed[2])) if timed else ()
        return cls(str(obj["source"]), int(obj["tokens"]), *(float(obj[k]) for k in FIELDS),
                   seq_len=int(obj.get("seq_len", 0)), quadratic=quad, tiled_head=tiled, timed=timed)


def fitted(longer: "ActivationProfile", shorter: "ActivationProfile") -> "ActivationProfile":
    """One profile from two measurements at the same micro-batch and two sequence lengths L1 > L2: each term split
    into a part linear in the length and a quadratic one. Per sequence, v(L) = a L + b L^2, so v/L is linear in L:
    b = (v1/L1 - v2/L2) / (L1 - L2), and the quadratic part at L1 is b L1^2. A quadratic part below
    ``QUADRATIC_NOISE`` of its term (allocator rounding, a constant buffer) is taken as none: it would be stretched
    by the square of the ratio."""
    l1, l2 = longer.seq_len, shorter.seq_len
    mb = longer.tokens // l1 if l1 else 0
    if not (l1 > l2 > 0) or shorter.tokens != mb * l2 or longer.tokens != mb * l1:
        raise ValueError(f"fitted: {longer.tokens} tokens at length {l1} and {shorter.tokens} at {l2} are not one "
                         "micro-batch at two lengths, the first longer")
    quad = []
    for k in FIELDS:
        v1, v2 = getattr(longer, k), getattr(shorter, k)
        q = min(max(0.0, (v1 / l1 - v2 / l2) / (l1 - l2) * l1 * l1), v1)
        quad.append(q if q > QUADRATIC_NOISE * v1 else 0.0)
    return ActivationProfile(longer.source, longer.tokens, *(getattr(longer, k) for k in FIELDS), seq_len=l1,
                             quadratic=tuple(quad), tiled_head=longer.tiled_head, timed=longer.timed)


QUADRATIC_NOISE = 0.01
MLP_SAVED = {"llama": 4, "gpt2": 2}  # seq x intermediate tensors an MLP keeps for its backward, by architecture
LOSS_BYTES = 4 + 4  # per logit, beyond the logits' own dtype: the loss's fp32 copy and its fp32 gradient
# The tiled head without a measurement (the formula; a model the probe cannot tile): per logit of one tile, and per
# element of the final hidden states (seq x hidden, in units of the parameters' bytes) what grows with the tokens
# alone. Both as the probe measured them on an H100 (``memory_probe._tiled_head``, bench/results/long_context/
# measured_tiled_head/): 12.0 bytes per logit and 5.0 x 2 bytes per hidden element on Llama-3-8B widths (16384 and
# 12288 tokens) and on Llama-3 widths h2048 x 16 (16384 tokens), where they predicted the peaks of three runs within
# 0.4-3.3 %. (20 and 2 before, derived from one run's peak less its other terms: 10 % over on the second model.)
# Measured with bf16 parameters only: fp32 ones scale the hidden states' term by their bytes, unmeasured.
TILED_LOSS_BYTES = 12
TILED_HIDDEN_COPIES = 5


def mlp_bytes(model: ModelSpec, train: TrainingSpec) -> float:
    """What one layer's MLP keeps for its backward beyond its input, at ``train``'s tokens (the seq x intermediate
    tensors; a MoE layer's routed experts see a top-k share of the tokens each, their sum as a dense MLP's)."""
    width = model.intermediate * max(1, model.experts_per_token if model.experts else 1) + model.shared_intermediate
    return train.tokens_per_micro_batch * width * train.param_bytes * MLP_SAVED.get(model.arch, 4)


def logits_bytes(model: ModelSpec, train: TrainingSpec) -> float:
    """The head's seq x vocab tensors at their peak: the logits, the loss's fp32 copy and its gradient."""
    return train.tokens_per_micro_batch * model.vocab * (train.param_bytes + LOSS_BYTES)


def offloaded_input_bytes(acts: ActivationProfile, model: ModelSpec, train: TrainingSpec) -> float:
    """What activation offload moves to the host per checkpointed layer unit: its input, the residual stream (seq x
    hidden); never more than the layer keeps checkpointed (``acts``: at ``train``'s tokens)."""
    return min(acts.layer_saved_ckpt, train.tokens_per_micro_batch * model.hidden * train.param_bytes)


def tiled_head_bytes(model: ModelSpec, train: TrainingSpec, measured: tuple = ()) -> float:
    """The head's peak under logits tiling: what grows with the tokens (the final hidden states and their gradient),
    one tile's logits, and the lm_head gradient the tiles accumulate. ``measured``: the probe's (base bytes at
    ``train``'s tokens, bytes per logit of one tile, ``ActivationProfile.tiled_head``), else ``TILED_HIDDEN_COPIES``
    of the hidden states and ``TILED_LOSS_BYTES`` per logit."""
    tokens = train.tokens_per_micro_batch
    tile = -(-tokens // train.logits_tiles)
    base, per_logit = measured if measured else (TILED_HIDDEN_COPIES * tokens * model.hidden * train.param_bytes,
                                                TILED_LOSS_BYTES)
    return base + tile * model.vocab * per_logit + model.vocab * model.hidden * train.param_bytes


def tiled_activations(acts: ActivationProfile, model: ModelSpec, train: TrainingSpec) -> ActivationProfile:
    """``acts`` (at ``train``'s tokens) under ``train``'s tiling: a layer keeps no MLP intermediates and its backward
    works on one tile of them; the head keeps the final hidden states and works on one tile of logits
    (``tiled_head_bytes``, with what the model builds beside the logits that grows as the square of the length, an
    eager model's causal masks). Never below what stays: a layer's input."""
    if train.mlp_tiles == 1 and train.logits_tiles == 1:
        return acts
    floor = train.tokens_per_micro_batch * model.hidden * train.param_bytes
    saved, transient, head = acts.layer_saved, acts.layer_transient, acts.head_peak
    if train.mlp_tiles > 1:
        mlp = mlp_bytes(model, train)
        saved = max(floor, saved - mlp)
        transient = max(0.0, transient - mlp * (1 - 1 / train.mlp_tiles))
    if train.logits_tiles > 1:
        head = tiled_head_bytes(model, train, acts.tiled_head) + acts.quadratic[3]
    return replace(acts, layer_saved=saved, layer_transient=transient, head_peak=head)


def formula_activations(model: ModelSpec, train: TrainingSpec) -> ActivationProfile:
    """The profile without a device: FlashAttention-style layers (``ModelSpec.activation_width``) plus, in eager
    attention, the seq x seq tensors each layer keeps (``ModelSpec.eager_score_bytes``, quadratic in the length), the
    layer input when checkpointed, one layer's worth of backward workspace, and a head that keeps the embedding output
    and the logits with the loss's fp32 copy and gradient (and an eager model's causal masks)."""
    tokens, seq = train.tokens_per_micro_batch, train.seq_len
    a = train.param_bytes
    scores = tokens * seq * model.eager_score_bytes(a)  # eager attention's seq x seq tensors, per layer
    mask = tokens * seq * a * model.attention_masks if scores else 0.0  # the causal masks the model builds once
    layer = tokens * model.activation_width() * a + scores
    head = tokens * (model.hidden * a + model.vocab * (a + 4 + 4)) + mask
    return ActivationProfile("formula", tokens, layer, tokens * model.hidden * a, layer, head, seq_len=seq,
                             quadratic=(scores, 0.0, scores, mask))


def backward_phases(model: ModelSpec, train: TrainingSpec, topo: Topology, layout: Layout, ckpt_units: int,
                    acts: ActivationProfile, host_grad_units: int = 0, host_param_units: int = 0,
                    act_offload_units: int = 0) -> dict:
    """Bytes beyond the persistent state at each moment of a backward that can hold its peak, per term:

    head       the loss's backward: every layer's saved tensors, the head's peak, the root gathered and the top
               layer prefetched (s_p > 1). Not the output embedding's .grad: autograd makes it after the loss's
               fp32 tensors are gone (the probe's head peak holds its making); it is held until the root is
               reduced, so the later phases count it
    layers     the top layer's backward (k < N): its transient, GATHERED_LAYERS layers gathered, one unit's
               .grad, the staging buffers and ReduceScatter outputs in flight, the replica AllReduce copies
    recompute  a checkpointed layer's backward (k > 0): its recompute on top of the checkpointed inputs
    end        the root's reduction when the backward ends: its .grad, its own staging buffer and output

    ``host_grad_units``: the last units (forward order) whose G accumulators live on the host
    (``lins_ds.plan.offload``): none of theirs on the GPU; their gradients come as autograd makes them (one
    unit's), staged, and a staged copy on its way down (two staging buffers). ``host_param_units``: the last units
    whose P lives on the host: gathered (uploaded) before each use like a sharded unit's, none of it otherwise.
    ``act_offload_units``: of the ``ckpt_units`` checkpointed layer units, those whose inputs wait on the host for
    their recompute (``offloaded_input_bytes`` each); ``UPLOADED_LAYERS`` of them are back on the device at any
    moment of the backward, counted in every phase."""
    n, k = model.num_layers, ckpt_units
    units = model.unit_params()
    root, layer = units[0], max(units[1:], default=0)
    pb, rb, gb = train.param_bytes, train.reduce_bytes, train.grad_bytes
    s_p, s_g = layout.p.size, layout.g.size
    accum, reduce = train.grad_accum_dtype or train.param_dtype, train.grad_reduce_dtype or train.param_dtype
    # each .grad a view into the accumulator; not for the units whose P is on the host (an empty parameter, outside
    # its use, cannot hold a full-size .grad: theirs are staged)
    in_place = s_g == 1 and accum == train.param_dtype
    in_flight = IN_FLIGHT_REDUCE_SCATTERS + 1 if s_g > 1 else 1
    host_layers = min(host_grad_units, n)  # the layer units whose G is on the host (the last ones)
    root_on_host = host_grad_units > n
    head_grads = 0.0 if in_place and not root_on_host and host_param_units <= n else model.vocab * model.hidden * pb
    reducing = 0.0 if in_place else layer * pb + in_flight * layer * rb + (in_flight * layer / s_g * rb if s_g > 1 else 0)
    if host_layers and s_g == 1:  # those layers' gradients are staged: autograd's, the staging, a copy going down
        reducing = layer * pb + 2 * layer * rb
    elif host_param_units and in_place:  # P on the host, G on the device: autograd's .grad and the staging
        reducing = layer * pb + layer * rb
    copies = ((IN_FLIGHT_REPLICA_COPIES + 1) * max(root, layer) / s_g * rb
              if topo.world_size // s_g > 1 and accum != reduce else 0.0)
    gathered_root = root * pb if s_p > 1 or host_param_units > n else 0.0
    gathered_layer = layer * pb if s_p > 1 or host_param_units else 0.0
    away = max(0, min(act_offload_units, k) - UPLOADED_LAYERS) * offloaded_input_bytes(acts, model, train)
    kept = (n - k) * acts.layer_saved + k * acts.layer_saved_ckpt - away

    on_gpu = (0 if root_on_host else root) + (n - host_layers) * layer  # what has a G accumulator on the GPU

    def grads(layers_reached: int) -> float:
        """The G accumulators held once the backward has reached the root and ``layers_reached`` layer units (a
        window's first backward: the last layers first, whose G may be on the host); every one of them from the
        second on."""
        if train.grad_accum > 1:
            return on_gpu * gb / s_g
        reached = (0 if root_on_host else root) + max(0, layers_reached - host_layers) * layer
        return reached * gb / s_g

    phases = {"head": {"grads": grads(0), "activations": kept + acts.head_peak,
                       "gathered": gathered_root + gathered_layer, "grad_buffers": 0.0}}
    busy = {"gathered": gathered_root + GATHERED_LAYERS * gathered_layer, "grad_buffers": head_grads + reducing + copies}
    if k < n:
        phases["layers"] = {"grads": grads(1), "activations": kept + acts.layer_transient, **busy}
    if k > 0:
        phases["recompute"] = {"grads": grads(n - k + 1),
                               "activations": k * acts.layer_saved_ckpt - away + acts.layer_saved
                               + acts.layer_transient,
                               **busy}
    end = 0.0 if in_place and not root_on_host else root * pb + root * rb + (root / s_g * rb if s_g > 1 else 0)
    phases["end"] = {"grads": grads(n), "activations": 0.0, "gathered": gathered_root, "grad_buffers": end + copies}
    return phases


def memory(model: ModelSpec, train: TrainingSpec, mem: MemorySpec, topo: Topology, layout: Layout,
           ckpt_units: int, activations: Optional[ActivationProfile] = None,
           placement: Placement = RESIDENT, act_offload_units: int = 0) -> "MemoryBreakdown":
    """``placement``: the last k units keep their OS off the device (``lins_ds.plan.offload``): the GPU holds none of
    their optimizer state and runs none of their update; with their G off it none of their G either, with their P
    off it none of their P but while gathered for use. ``act_offload_units``: the checkpointed layer units whose
    inputs are held on the host between their forward and their recompute (``backward_phases``); host memory."""
    phi = model.total_params()
    units = model.unit_params()
    resident = units[:len(units) - placement.units_of("os")]
    on_gpu = sum(resident)
    pb, gb = train.param_bytes, train.grad_bytes
    s_p, s_g, s_os = layout.sharding()
    acts = (activations or formula_activations(model, train)).scaled(train.tokens_per_micro_batch, train.seq_len)
    acts = tiled_activations(acts, model, train)
    host_g, host_p = placement.units_of("g"), placement.units_of("p")
    phases = backward_phases(model, train, topo, layout, ckpt_units, acts, host_g, host_p, act_offload_units)
    worst = max(phases, key=lambda p: sum(phases[p].values()))
    step_grad = 4 if gb != 4 else 0  # the optimizer reads fp32 gradients
    piece = max(resident, default=0) if train.optimizer_per_unit else on_gpu
    all_grads = gb * (phi - (sum(units) - on_gpu if host_g else 0)) / s_g
    update = piece / s_os * (step_grad + 4 * OPTIMIZER_TEMP_COPIES)
    backward = sum(phases[worst].values())
    stepping = update + all_grads > backward  # the step holds every G accumulator, and the update's temporaries
    terms = {"params": pb * (phi - (sum(units) - on_gpu if host_p else 0)) / s_p,
             "optimizer": train.optimizer_bytes * on_gpu / s_os, **phases[worst],
             "optimizer_step": update}
    if stepping:
        terms["grads"] = all_grads
    terms = {k: terms[k] / GIB for k in PERSISTENT + BACKWARD + STEP}
    peak = sum(terms[k] for k in PERSISTENT) + (terms["grads"] + terms["optimizer_step"] if stepping else
                                                 sum(terms[k] for k in BACKWARD))
    terms["reserved"] = mem.reserved_gb
    terms["margin"] = mem.fragmentation * peak
    phase = "optimizer step" if stepping else f"backward ({worst})"
    act_host = min(act_offload_units, ckpt_units) * offloaded_input_bytes(acts, model, train) / GIB
    return MemoryBreakdown(terms, peak, acts.source, phase,
                           host_gb(units, placement, s_os, train) + act_host, act_host)


@dataclass(frozen=True)
class MemoryBreakdown:
    terms: dict  # term -> GiB, in TERMS order
    allocated_gb: float  # the allocator's predicted peak (torch.cuda.max_memory_allocated's quantity)
    activation_source: str = "formula"
    phase: str = "backward"  # where the peak is: "backward (head | layers | recompute | end)" or "optimizer step"
    host_gb: float = 0.0  # host memory the offloaded OS chunks pin (``lins_ds.plan.offload.host_gb``), and activations
    activation_host_gb: float = 0.0  # of it, the offloaded layer inputs (activation offload)

    @property
    def total_gb(self) -> float:
        """What the GPU must hold: the allocated peak, the allocator's margin and the fixed reserve."""
        return self.allocated_gb + self.terms["margin"] + self.terms["reserved"]

    def to_json(self) -> dict:
        return {**{k: round(v, 4) for k, v in self.terms.items()}, "host": round(self.host_gb, 4)}
