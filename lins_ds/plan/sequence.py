"""Sequence tiling as a planned dimension (issue 60; docs/design.md §8): what it saves, what it costs, and the order in
which the planner offers it.

Two of the tensors that grow with the sequence are temporaries that tiling keeps from ever being whole
(``runtime/step/tiling.py``): the MLP's seq x intermediate tensors (a gated MLP keeps four — gate, up, the activation
and their product — for its backward) and the head's seq x vocab logits with the loss's fp32 copies. Tiled, each is
made one tile at a time and recomputed in the backward, so a layer keeps only the MLP's input and the head only the
final hidden states; the working set of the MLP's and the loss's backward shrinks by the tile count. The price is one
more forward of every layer's MLP and of the lm_head matmul per micro-batch.

What it saves is modelled with the rest of the activations (``plan.memory.tiled_activations``). The planner offers tiling only where no plan fits without it (``LADDER``: walked after the offload ladder), so a
sequence that fits runs as before; ``lins.tiling`` fixes it instead (or turns it off).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .model import ModelSpec
from .offload import walk as offload_walk
from .spec import TrainingSpec

# (mlp_tiles, logits_tiles), tried in this order where nothing fits untiled: the logits first (the largest tensor of
# a long sequence with a large vocabulary, and the cheapest to tile: one matmul), then both, finer and finer
LADDER = ((1, 1), (1, 8), (4, 8), (8, 16), (16, 32), (32, 64))


def tiled(train: TrainingSpec, mlp_tiles: int, logits_tiles: int) -> TrainingSpec:
    return replace(train, mlp_tiles=mlp_tiles, logits_tiles=logits_tiles)


def rungs(choice, supported: bool) -> list:
    """The tilings to try in order: ``choice`` is lins.tiling ("auto", False, or (mlp, logits)); ``supported``: the
    model can be tiled (``runtime.step.tiling`` supports its class). "auto" on a model that cannot be tiled, or False:
    only untiled."""
    if choice is False or (choice == "auto" and not supported):
        return [LADDER[0]]
    if choice == "auto":
        return list(LADDER)
    return [tuple(choice)]


def walk(tilings: list, attempt: Callable, errors: tuple):
    """``attempt(mlp_tiles, logits_tiles)`` for each tiling in order until one returns without one of ``errors``; the
    last rung's error where none does (``plan.offload.walk``, the one ladder driver)."""
    return offload_walk([lambda t=t: t for t in tilings], lambda t: (attempt(*t), True), errors)


def extra_flops(model: ModelSpec, train: TrainingSpec) -> float:
    """FLOPs one micro-batch adds under ``train``'s tiling: each tiled MLP's forward and the lm_head's again in the
    backward (a checkpointed layer's recompute runs its MLP's forward once more anyway; its tiled backward repeats it)."""
    tokens, flops = train.tokens_per_micro_batch, 0.0
    if train.mlp_tiles > 1:
        flops += model.num_layers * 2.0 * model._mlp_params(active=True) * tokens
    if train.logits_tiles > 1:
        flops += 2.0 * model.vocab * model.hidden * tokens
    return flops
