"""Per-GPU memory of a layout (docs/design.md §8), every term kept separately so the summary can show it.

    params       p_bytes  x Phi / s_p         (the P chunk; the whole model when s_p = 1)
    grads        g_bytes  x Phi / s_g         (accumulation buffer in grad_accum dtype)
    optimizer    k_os     x Phi / s_os        (fp32 master unless params are fp32, Adam moments)
    activations  per micro-batch: layers x seq x mb x width x a_bytes (checkpointing: layer inputs only,
                 plus one layer recomputed), FlashAttention-style (no seq^2 scores)
    logits       seq x mb x vocab x (a_bytes + 4 + 4): logits, their fp32 copy for the loss, its grad
    gathered     s_p > 1: the root unit (kept through the micro-batch) + two layer units (current, prefetch)
    grad_buffers two units of gradients as autograd makes them, plus a copy in the reduce dtype when
                 that differs from the parameter dtype
    reserved     CUDA context and communicator buffers (fixed)
    margin       allocator fragmentation, a fraction of everything the allocator holds
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import ModelSpec
from .spec import GIB, MemorySpec, TrainingSpec
from .topology import Layout

# Named constants the executor (lins_ds/runtime/executor.py) and this model share:
GATHERED_LAYERS = 2  # layer units whose full parameters exist at once: the current one and the prefetched one
IN_FLIGHT_REDUCE_SCATTERS = 2  # ReduceScatters in flight before the oldest is completed

TERMS = ("params", "grads", "optimizer", "activations", "logits", "gathered", "grad_buffers", "reserved", "margin")


@dataclass(frozen=True)
class MemoryBreakdown:
    terms: dict  # term -> GiB, in TERMS order

    @property
    def total_gb(self) -> float:
        return sum(self.terms.values())

    def to_json(self) -> dict:
        return {k: round(v, 4) for k, v in self.terms.items()}


def activation_bytes(model: ModelSpec, train: TrainingSpec, checkpointing: bool) -> float:
    tokens = train.tokens_per_micro_batch
    a_bytes = train.param_bytes
    layer = tokens * model.activation_width() * a_bytes
    if checkpointing:
        return model.num_layers * tokens * model.hidden * a_bytes + layer
    return model.num_layers * layer + tokens * model.hidden * a_bytes  # + embedding output


def memory(model: ModelSpec, train: TrainingSpec, mem: MemorySpec, layout: Layout,
           checkpointing: bool) -> MemoryBreakdown:
    phi = model.total_params()
    units = model.unit_params()
    pb, gb, rb = train.param_bytes, train.grad_bytes, train.reduce_bytes
    s_p, s_g, s_os = layout.sharding()
    max_unit, max_layer = max(units), max(units[1:], default=0)
    terms = {
        "params": pb * phi / s_p,
        "grads": gb * phi / s_g,
        "optimizer": train.optimizer_bytes * phi / s_os,
        "activations": activation_bytes(model, train, checkpointing),
        "logits": train.tokens_per_micro_batch * model.vocab * (pb + 4 + 4),
        "gathered": (units[0] + GATHERED_LAYERS * max_layer) * pb if s_p > 1 else 0.0,
        "grad_buffers": IN_FLIGHT_REDUCE_SCATTERS * max_unit * pb + (max_unit * rb if rb != pb else 0),
    }
    terms = {k: v / GIB for k, v in terms.items()}
    terms["reserved"] = mem.reserved_gb
    terms["margin"] = mem.fragmentation * sum(v for k, v in terms.items() if k != "reserved")
    return MemoryBreakdown(terms)
