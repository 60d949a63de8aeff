"""The longest sequence a budget allows, and which tensor binds there (issue 60; ``lins-ds plan --longest``).

A plan is found per length by the same walk the engine uses (``plan.offload.walk`` over lins.offload's ladder);
feasibility only falls as the sequence grows (every activation term grows with it, nothing else shrinks), so the
longest length that fits is found by doubling from the given one and then bisecting, on multiples of ``ALIGN``.
What binds is read off the smallest plan at the first length that does not fit: its largest memory term and, for
the activations, which of the tensors that grow with the sequence is the largest there — the checkpointed and saved
layer activations (seq x hidden per checkpointed layer), one layer's backward working set (the MLP's seq x
intermediate among it), or the head (the seq x vocab logits with the loss's fp32 copies)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .memory import (UPLOADED_LAYERS, ActivationProfile, formula_activations, offloaded_input_bytes,
                     tiled_activations)
from .model import ModelSpec
from .spec import GIB, TrainingSpec

ALIGN = 128  # lengths tried: multiples of this (tensor-core friendly, as training lengths are)
MAX_SEQ = 1 << 24  # where the search stops: no budget allows more for one micro-batch


@dataclass(frozen=True)
class Longest:
    """``seq_len``: the longest multiple of ``ALIGN`` that fits (0: not even ``ALIGN``); ``capped``: the search
    stopped at ``MAX_SEQ`` (the budget allows more); ``binding``: at the next length tried, the term that binds and
    its GiB; ``short_gb``: how much memory that length lacked."""

    seq_len: int
    capped: bool
    binding: tuple = ()  # ((name, GiB), ...): the tensors that grow with the sequence, largest first, then the rest
    short_gb: float = 0.0
    short_of: str = "GPU"  # the memory that length lacks: "GPU", or "host" (the offloaded state's)

    def describe(self) -> str:
        if self.capped:
            return f"longest sequence: at least {self.seq_len} tokens per sequence (the search stops there)"
        what = ", ".join(f"{name} {gb:.2f} GiB" for name, gb in self.binding)
        return (f"longest sequence: {self.seq_len} tokens per sequence fit; {self.seq_len + ALIGN} lack "
                f"{self.short_gb:.2f} GiB of {self.short_of} memory; on the GPU there: {what}")

    def to_json(self) -> dict:
        return {"seq_len": self.seq_len, "capped": self.capped, "short_gb": round(self.short_gb, 4),
                "short_of": self.short_of,
                "binding": [[name, round(gb, 4)] for name, gb in self.binding]}


def search(fits: Callable[[int], bool], start: int) -> tuple:
    """(longest multiple of ``ALIGN`` for which ``fits``, whether the search stopped at ``MAX_SEQ``), given that
    ``fits`` only falls as the length grows; ``start`` is where to begin (any length)."""
    n = max(ALIGN, start // ALIGN * ALIGN)
    if fits(n):
        lo, hi = n, None
        while hi is None:
            nxt = min(2 * lo, MAX_SEQ)
            if nxt == lo:
                return lo, True
            if fits(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        lo, hi = 0, n
    while hi - lo > ALIGN:
        mid = (lo + hi) // 2 // ALIGN * ALIGN
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, False


def activation_tensors(model: ModelSpec, train: TrainingSpec, ckpt_units: int,
                       activations: Optional[ActivationProfile] = None, act_offload_units: int = 0) -> dict:
    """GiB of the activation tensors that grow with the sequence, at ``train``'s length, for a plan checkpointing
    ``ckpt_units`` of the model's layer units: what the layers keep for backward, one layer's backward working set,
    and the head (embedding output, logits, the loss's fp32 copies and their gradients), under ``train``'s tiling,
    less the inputs of ``act_offload_units`` checkpointed layers held on the host (all but ``UPLOADED_LAYERS``)."""
    acts = (activations or formula_activations(model, train)).scaled(train.tokens_per_micro_batch, train.seq_len)
    acts = tiled_activations(acts, model, train)
    n, k = model.num_layers, ckpt_units
    away = max(0, min(act_offload_units, k) - UPLOADED_LAYERS) * offloaded_input_bytes(acts, model, train)
    return {"layer activations kept for backward": ((n - k) * acts.layer_saved + k * acts.layer_saved_ckpt - away) / GIB,
            "one layer's backward working set": acts.layer_transient / GIB,
            "logits and loss (seq x vocab)": acts.head_peak / GIB}


def binding(memory_terms: dict, tensors: dict) -> tuple:
    """What binds at a length that does not fit, largest first: the tensors that grow with the sequence
    (``activation_tensors``), then, as one entry, the smallest plan's state and buffers that do not (parameters,
    optimizer state, gradients, gathered units, communication buffers)."""
    fixed = sum(v for k, v in memory_terms.items() if k not in ("activations", "reserved", "margin"))
    grown = sorted(tensors.items(), key=lambda kv: -kv[1])
    return (*grown, ("state and buffers that do not grow with the sequence", fixed))
