"""Sequence tiling and activation offload as planned dimensions (issue 60; docs/design.md §8): what they save, what
they cost, and the order in which the planner offers them.

Two of the tensors that grow with the sequence are temporaries that tiling keeps from ever being whole
(``runtime/step/tiling.py``): the MLP's seq x intermediate tensors (a gated MLP keeps four — gate, up, the activation
and their product — for its backward) and the head's seq x vocab logits with the loss's fp32 copies. Tiled, each is
made one tile at a time and recomputed in the backward, so a layer keeps only the MLP's input and the head only the
final hidden states; the working set of the MLP's and the loss's backward shrinks by the tile count. The price is one
more forward of every layer's MLP and of the lm_head matmul per micro-batch.

What it saves is modelled with the rest of the activations (``plan.memory.tiled_activations``). The planner offers
tiling only where no plan fits without it (``LADDER``: walked after the offload ladder), so a sequence that fits runs
as before; ``lins.tiling`` fixes it instead (or turns it off).

The third tensor that grows with the sequence stays whole: each checkpointed layer's input (seq x hidden), kept from
its forward to its recompute. Activation offload (``runtime/step/activation_offload.py``) holds it in host memory in
between: down on a copy stream as the layer's forward starts, back one layer ahead of its recompute. The solver offloads
the fewest checkpointed layers that make a plan fit (``solver.evaluate``; the first ones, whose inputs wait longest),
counts their inputs in the host memory beside the offloaded states, and prices the copies the compute cannot hide
(``activation_offload_seconds``). It is offered after every tiling (``rungs``): first the whole ladder without it, then
again with it, so a sequence that fits without host memory never uses any; ``lins.activation_offload: false`` keeps it
off.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from .model import ModelSpec
from .offload import walk as offload_walk
from .spec import TrainingSpec

# (mlp_tiles, logits_tiles), tried in this order where nothing fits untiled: the logits first (the largest tensor of
# a long sequence with a large vocabulary, and the cheapest to tile: one matmul), then both, finer and finer
LADDER = ((1, 1), (1, 8), (4, 8), (8, 16), (16, 32), (32, 64))


def tiled(train: TrainingSpec, mlp_tiles: int, logits_tiles: int, activation_offload=False) -> TrainingSpec:
    return replace(train, mlp_tiles=mlp_tiles, logits_tiles=logits_tiles, activation_offload=activation_offload)


def rungs(choice, supported: bool, offload_activations=False) -> list:
    """The (MLP tiles, logits tiles, activation offload) rungs to try in order: ``choice`` is lins.tiling ("auto",
    False, or (mlp, logits)); ``supported``: the model can be tiled (``runtime.step.tiling`` supports its class);
    "auto" on a model that cannot be tiled, or False: only untiled. ``offload_activations`` is
    lins.activation_offload: "auto" offers every tiling again with activation offload (the fewest layers that fit:
    ``TrainingSpec.activation_offload`` True), after all of them without it; False: never; a number: that many
    layers' on every rung."""
    if choice is False or (choice == "auto" and not supported):
        tilings = [LADDER[0]]
    elif choice == "auto":
        tilings = list(LADDER)
    else:
        tilings = [tuple(choice)]
    if offload_activations == "auto":
        return [(*t, False) for t in tilings] + [(*t, True) for t in tilings]
    return [(*t, offload_activations) for t in tilings]


def walk(tilings: list, attempt: Callable, errors: tuple):
    """``attempt(mlp_tiles, logits_tiles, activation_offload)`` for each rung in order until one returns without one of
    ``errors``; the last rung's error where none does (``plan.offload.walk``, the one ladder driver)."""
    return offload_walk([lambda t=t: t for t in tilings], lambda t: (attempt(*t), True), errors)


# The tiling a plan that keeps optimizer state on the host is compared with (``head_tiling_note``): the logits and
# loss in 8 tiles. A large vocabulary's logits (and their gradient) take memory that units' optimizer state could
# use: on Qwen2.5-3B widths at 40 GiB, 21-23 units' state stayed on the GPU instead of 9, and the step fell 18-26 %
# (bench/results/offload/blocks_h100/). The tiled loss returns empty logits, so this is said, never chosen.
HEAD_TILES = LADDER[1]


def head_tiling(choice, supported: bool, plan, best, solve_tiled: Callable, errors: tuple) -> str:
    """``head_tiling_note`` for ``plan`` (its solver's ``best`` Evaluation), where lins.tiling (``choice``) was left
    "auto" (a user's setting is theirs), the model can be tiled (``supported``), and the plan keeps optimizer state on
    the host on the untiled rung without activation offload: ``solve_tiled()`` (the same offload ladder at
    ``HEAD_TILES``, no activation offload) gives the Evaluation to compare, or raises one of ``errors``. The
    engine's start-up and ``lins-ds plan`` both call this."""
    untiled = plan.mlp_tiles == 1 and plan.logits_tiles == 1 and not plan.activation_offload_units
    step = best.objective == "step"  # objective "comm" prices no step to compare
    if not (choice == "auto" and supported and untiled and step and best.placement.offloads("os")):
        return ""
    try:
        other = solve_tiled()
    except errors:
        return ""
    return head_tiling_note(best.objective_s, best.placement.n_units, other.objective_s,
                            other.placement.n_units if other.placement.offloads("os") else 0)


def head_tiling_note(step_s: float, host_units: int, tiled_step_s: Optional[float], tiled_host_units: int) -> str:
    """The summary's line where the logits in ``HEAD_TILES`` tiles would keep units' optimizer state on the GPU and
    shorten the predicted step (``tiled_step_s`` None: no tiled plan fits); '' otherwise."""
    if tiled_step_s is None or tiled_step_s >= step_s or tiled_host_units >= host_units:
        return ""
    return (f"\n  offload: with the logits and loss in {HEAD_TILES[1]} tiles (lins.tiling: {{\"logits\": "
            f"{HEAD_TILES[1]}}}), {tiled_host_units} units' optimizer state would be on the host instead of "
            f"{host_units}, and a step predicted {tiled_step_s * 1e3:.1f} ms instead of {step_s * 1e3:.1f}; a training "
            "forward with labels then returns the loss and empty logits, so it is not chosen for you")


def with_host(spec, activation_offload, host: Callable):
    """``spec`` (a ``plan.offload.OffloadSpec``) with ``host()`` to hold offloaded activations, where the rung asks for
    activation offload and the offload rung has no host (GPU-resident states); else ``spec``."""
    if not activation_offload or spec.host is not None:
        return spec
    return replace(spec, host=host())


def activation_offload_seconds(layer_bytes: float, layers: int, host, fwd_s: float, bwd_s: float, num_layers: int,
                               grad_accum: int) -> float:
    """What a step waits for activation offload's copies of ``layers`` inputs of ``layer_bytes`` each, on ``host``'s
    link (``plan.offload.HostSpec``), given one micro-batch's forward and backward compute (``fwd_s``, ``bwd_s``) over
    ``num_layers`` layers. One copy stream carries both ways. Down: the copies run beside the forward and nothing
    waits for them but memory; what the forward does not cover delays the first upload of the backward. Up: each
    input comes back while the layer above it recomputes and runs its backward (one layer ahead), so an upload longer
    than that layer's share of the backward is waited for by the difference."""
    down = max(0.0, layers * layer_bytes / (host.d2h_gbs * 1e9) - fwd_s)
    up = layers * max(0.0, layer_bytes / (host.h2d_gbs * 1e9) - bwd_s / max(num_layers, 1))
    return grad_accum * (down + up)


def extra_flops(model: ModelSpec, train: TrainingSpec) -> float:
    """FLOPs one micro-batch adds under ``train``'s tiling: each tiled MLP's forward and the lm_head's again in the
    backward (a checkpointed layer's recompute runs its MLP's forward once more anyway; its tiled backward repeats it)."""
    tokens, flops = train.tokens_per_micro_batch, 0.0
    if train.mlp_tiles > 1:
        flops += model.num_layers * 2.0 * model._mlp_params(active=True) * tokens
    if train.logits_tiles > 1:
        flops += 2.0 * model.vocab * model.hidden * tokens
    return flops
