"""Issue 60's baseline: DeepSpeed's Arctic Long Sequence Training (ALST) recipe for one GPU, applied to the bench's
Hugging Face LLaMA (``python -m bench.train --alst --deepspeed_config ds_configs/alst_offload.json``).

The recipe (ArcticTraining projects/sequence-parallelism/run-h100-sp1-llama-8b.yml; the DeepSpeed tutorial
"ulysses-alst-sequence-parallelism"), with ``sequence_parallel_size`` 1, so no Ulysses attention:

* ZeRO-3 with parameters and optimizer states offloaded to pinned host memory (the config file);
* ``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP`` as each decoder layer's MLP forward, in
  ceil(seq / hidden) sequence tiles (ArcticTraining's ``tiled_mlp_forward_common``);
* ``ulysses_sp.TiledFusedLogitsLoss``: the loss from the last hidden state in sequence tiles of about 1 GiB of fp32
  logits, so the seq x vocab logits never exist whole (ArcticTraining's ``SFTTrainer.loss`` without Liger-Kernel);
* Hugging Face gradient checkpointing (non-reentrant) on every decoder layer;
* ``deepspeed.runtime.activation_checkpointing.offload_activations.CheckpointHiddenStatesOffload``: each checkpointed
  layer input to pinned host memory in the forward, back for its recompute; wrap every forward+backward in
  ``offload(model)``.

Where DeepSpeed 0.19.8's pieces do not fit as shipped: its checkpoint offload marks the wrong tensor under ZeRO-3
and keeps what it brought back until the step ends (``CheckpointOffload`` fixes both); TiledMLP and
TiledFusedLogitsLoss need a tile count torch.chunk can make (``exact_shards``); TiledMLP computes only gated MLPs
(``patch`` refuses others). A tied lm_head (not LLaMA-3-8B's) would be marked ready by the tiled loss before the
embedding adds its part: untested here.

Not here: Liger-Kernel (the recipe's ``model.type: liger``: fused RMSNorm/RoPE kernels, its fused linear
cross-entropy in place of the tiled loss) and FlashAttention-2 (the bench runs SDPA for every part).
"""

from __future__ import annotations

import math
import types

import torch
from deepspeed.runtime.activation_checkpointing.offload_activations import (CheckpointHiddenStatesOffload,
                                                                            _OffloadedTensorRef)
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
# Imported before the model is built, as ALST patches its classes then: importing transformers' modeling (and with
# it torch._dynamo) for the first time inside deepspeed.zero.Init fails (seen on CPU, torch 2.13: dynamo's signature
# check of Tensor.__new__ meets zero.Init's replacement).
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama import modeling_llama  # noqa: F401

LOGITS_TILE_BYTES = 2**30  # ArcticTraining: shards of about 1 GiB of fp32 logits


def exact_shards(rows: int, shards: int) -> int:
    """The tile count torch.chunk really makes: 6 rows in 4 tiles are 3 of 2. TiledMLP and TiledFusedLogitsLoss
    mark the weights' gradients ready for ZeRO only in tile number ``shards``; with fewer tiles ZeRO never reduces
    them (ZeRO-3's step then fails: "unknown parameter type"), so they must be asked for exactly as many."""
    shards = max(1, min(int(shards), rows))
    return math.ceil(rows / math.ceil(rows / shards))


def _tiled_mlp_forward(self, x):
    """ArcticTraining's ``tiled_mlp_forward_common``: only for ``down(act(gate(x)) * up(x))`` MLPs (LLaMA's)."""
    rows = x.numel() // x.shape[-1]
    # ceil(seq / hidden) tiles; ArcticTraining takes the maximum over the ranks as their lengths may differ, here
    # every rank trains the same length
    shards = math.ceil(x.shape[-2] / x.shape[-1]) if self.alst_shards == "auto" else self.alst_shards
    self.alst_last_shards = shards = exact_shards(rows, shards)

    def mlp(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    return TiledMLP.apply(mlp, self, x, shards, [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight])


def tiled_loss(model, hidden: torch.Tensor, labels: torch.Tensor, shards="auto") -> torch.Tensor:
    """The causal LM loss of ``labels`` from the last hidden state, in sequence tiles (ArcticTraining's
    ``SFTTrainer.loss``): the mean over the labels not -100, as Hugging Face's loss. Each tile's sum is divided by
    the whole batch's count, so the tiles' sum is that mean and no tile needs weighting afterwards. The tiles' backward
    runs inside this forward (TiledFusedLogitsLoss), so it must be the last thing before the backward."""
    head = model.get_output_embeddings()
    vocab = model.config.vocab_size
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)  # pre-shifted: a tile needs its next token
    count = (shift != -100).sum().clamp(min=1)
    if shards == "auto":
        shards = math.ceil(shift.numel() * vocab * 4 / LOGITS_TILE_BYTES)
    shards = exact_shards(shift.numel(), shards)
    model.alst_loss_shards = shards

    def loss(model, h, y):
        return model.loss_function(logits=head(h), labels=None, vocab_size=vocab, shift_labels=y,
                                   num_items_in_batch=count)

    return TiledFusedLogitsLoss.apply(loss, model, hidden, shift, None, shards, [head.weight], "sum")


def _tiled_loss_forward(self, input_ids=None, labels=None, **kwargs):
    """The causal LM's forward with the tiled loss; with labels the output has the loss and no logits."""
    kwargs["use_cache"] = False
    hidden = getattr(self, self.base_model_prefix)(input_ids=input_ids, **kwargs).last_hidden_state
    if labels is None:
        return CausalLMOutputWithPast(logits=self.get_output_embeddings()(hidden))
    return CausalLMOutputWithPast(loss=tiled_loss(self, hidden, labels, self.alst_loss_shards_asked))


class CheckpointOffload(CheckpointHiddenStatesOffload):
    """DeepSpeed's offload of checkpointed layer inputs, with two changes that make it offload and save memory:

    * it marks the input to be offloaded in ``GradientCheckpointingLayer.__call__``, before the module's forward
      pre-hooks; ZeRO-3's pre-hook hands the layer a new tensor (``PostBackwardFunctionModule``), so the tensor the
      checkpoint saves never matches the mark and nothing is offloaded. ``mark_inputs`` marks in the layer's forward,
      after the hooks, the tensor the checkpoint saves;
    * it keeps every input it brought back until the context exits (for retain_graph), so by the end of the backward
      all of them are on the device again: the same peak as no offload, at the other end of the step. One backward
      per context here: each is handed over once and freed with its layer's recompute.
    """

    active = False

    def __enter__(self):
        out = super().__enter__()
        self.active = True
        return out

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def _unpack_tensor(self, maybe_ref):
        if isinstance(maybe_ref, _OffloadedTensorRef):
            return self._restore_tensor(maybe_ref.tensor_id, cache=False)
        return maybe_ref

    def mark_inputs(self, layer: torch.nn.Module) -> None:
        forward = layer.forward

        def marked(hidden_states, *args, **kwargs):
            on = self.active and layer.gradient_checkpointing and layer.training and torch.is_grad_enabled()
            if on:
                self.mark(hidden_states)
            try:
                return forward(hidden_states, *args, **kwargs)
            finally:
                if on:
                    self._consume_mark(hidden_states)  # the checkpoint's save consumed it; else drop it (ids recycle)

        layer.forward = marked


def patch(model, mlp_shards="auto", loss_shards="auto", offload_cls=CheckpointOffload):
    """ALST on a built LLaMA-like causal LM (``model.model.layers[i].mlp``, ``lm_head``), before
    deepspeed.initialize: TiledMLP in every layer, the tiled loss in the forward, gradient checkpointing on every
    layer, their inputs marked for ``offload(model)``."""
    layers = getattr(getattr(model, model.base_model_prefix, None), "layers", None)
    if layers is None:
        raise SystemExit(f"--alst: {type(model).__name__} has no decoder layers at .{model.base_model_prefix}.layers")
    for layer in layers:
        mlp = layer.mlp
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            # TiledMLP recomputes the MLP as down(act(gate(x)) * up(x)); another MLP would be computed wrong
            raise SystemExit(f"--alst: {type(mlp).__name__} is not a gated MLP (gate_proj, up_proj, down_proj); "
                             "DeepSpeed's TiledMLP recipe computes only those")
        mlp.alst_shards = mlp_shards
        mlp.forward = types.MethodType(_tiled_mlp_forward, mlp)
    model.alst_loss_shards_asked = loss_shards
    model.forward = types.MethodType(_tiled_loss_forward, model)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24 deprecates the older name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.alst_offload = offload_cls()
    for layer in layers:
        model.alst_offload.mark_inputs(layer)
    return model


def offload(model) -> CheckpointOffload:
    """The context every forward+backward of a patched model runs in (the backward must be inside it)."""
    return model.alst_offload


def report(model) -> dict:
    """Tiles and the last step's checkpoint offload (a CPU device offloads nothing: its marked inputs are skipped)."""
    layers = getattr(model, model.base_model_prefix).layers
    s = model.alst_offload.stats
    return {"mlp_shards": getattr(layers[0].mlp, "alst_last_shards", None),
            "loss_shards": getattr(model, "alst_loss_shards", None),
            "checkpoint_inputs": s.offloaded_tensors + s.kept_last_tensors + s.skipped_marked_tensors,
            "offloaded": s.offloaded_tensors, "offloaded_gb": s.offloaded_bytes / 2**30,
            "kept_on_device": s.kept_last_tensors, "skipped": s.skipped_marked_tensors}
