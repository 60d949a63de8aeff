"""Activation offload of checkpointed layer inputs (lins_ds/runtime/step/activation_offload.py, recompute.py; issue 60):
the round trip is exact (loss and gradients bitwise those of checkpointing without it), the offloaded layers' inputs
are held only on the host between the forward and the recompute, each comes back one layer ahead of its recompute,
the host buffers are reused step after step, and with no layer offloaded nothing is installed."""

import weakref

import pytest
import torch
import transformers
from torch import nn

from lins_ds.runtime.step import recompute
from lins_ds.runtime.step.activation_offload import ActivationOffload, OffloadedCheckpoint

HIDDEN, VOCAB, BATCH, SEQ, LAYERS = 32, 96, 2, 24, 4


def llama(attn: str = "eager") -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=64, attention_dropout=0.1)  # dropout: RNG in the recompute
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


class Block(nn.Module):
    """A plain (not Hugging Face) residual block: recompute wraps its forward."""

    def __init__(self):
        super().__init__()
        self.norm, self.ff, self.drop = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Dropout(0.1)

    def forward(self, x, scale):
        return x + self.drop(torch.tanh(self.ff(self.norm(x)))) * scale


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.layers = nn.Embedding(VOCAB, HIDDEN), nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        scale = torch.full((1,), 0.5)  # a constant input, not requiring grad: stays where it is
        for layer in self.layers:
            x = layer(x, scale)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def units(model) -> list:
    layers = model.model.layers if hasattr(model, "model") else model.layers
    return [[layer] for layer in layers]


def ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def step(model, between=None, watch: bool = False):
    """One seeded forward and backward: the loss, every gradient, and (``watch``) whether each layer's input was still
    alive as the forward ended; ``between()`` runs after the forward, before the backward."""
    model.zero_grad(set_to_none=True)
    inputs = []
    hooks = [u[0].register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
             for u in units(model)] if watch else []
    torch.manual_seed(7)
    batch = ids()
    loss = model(input_ids=batch, labels=batch)
    loss = loss if torch.is_tensor(loss) else loss.loss
    for h in hooks:
        h.remove()
    held = [r() is not None for r in inputs]
    if between is not None:
        between()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, held


def assert_bitwise(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and len(a[1]) > 0
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize("make", [llama, lambda: llama("sdpa"), Plain], ids=["llama-eager", "llama-sdpa", "plain"])
@pytest.mark.parametrize("offloaded", [{0, 1, 2, 3}, {1, 3}])
def test_offload_round_trips_exactly_and_holds_the_inputs_on_the_host_only(make, offloaded):
    model = make()
    assert recompute.apply(units(model), LAYERS) is None
    want = step(model, watch=True)
    assert want[2] == [True] * LAYERS  # checkpointing keeps every layer's input on the device
    offload = recompute.apply(units(model), LAYERS, offload_layers=offloaded)
    during = []
    got = step(model, between=lambda: during.append(offload.stats()), watch=True)
    assert_bitwise(got, want)
    # between the forward and the backward: an offloaded layer's input is gone from the device, its copy on the host
    assert got[2] == [i not in offloaded for i in range(LAYERS)]
    input_bytes = BATCH * SEQ * HIDDEN * 4
    assert (during[0].offloaded, during[0].host_bytes) == (len(offloaded), len(offloaded) * input_bytes)
    after = offload.stats()
    assert after.host_bytes == 0 and after.pool_bytes == during[0].pool_bytes  # freed with the graph, kept for reuse
    # every offloaded layer but the topmost came back ahead of its recompute
    assert (after.on_demand, after.prefetched) == (1, len(offloaded) - 1)


def test_the_topmost_layer_comes_back_ahead_when_its_owner_says_the_backward_starts():
    model = llama()
    offload = recompute.apply(units(model), LAYERS, offload_layers=range(LAYERS))
    torch.manual_seed(7)
    batch = ids()
    loss = model(input_ids=batch, labels=batch).loss
    offload.prefetch_newest()
    loss.backward()
    assert (offload.stats().on_demand, offload.stats().prefetched) == (0, LAYERS)


def test_host_buffers_are_reused_and_trimmed():
    model = llama()
    offload = recompute.apply(units(model), LAYERS, offload_layers={0, 1})
    step(model)
    pool = offload.stats().pool_bytes
    assert pool == 2 * BATCH * SEQ * HIDDEN * 4
    step(model)
    assert offload.stats().pool_bytes == pool  # the second step took the first one's buffers
    offload.trim()
    assert offload.stats().pool_bytes == 0
    step(model)
    assert offload.stats().pool_bytes == pool


def test_a_second_backward_over_one_forward_uploads_again():
    model = llama()
    recompute.apply(units(model), LAYERS)
    want = step(model)
    recompute.apply(units(model), LAYERS, offload_layers={0, 2})
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    batch = ids()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward(retain_graph=True)
    loss.backward()
    for name, g in want[1].items():
        assert torch.equal(dict(model.named_parameters())[name].grad, 2 * g), name


def test_the_model_s_reentrant_checkpoint_function_is_offloaded_too():
    """transformers' own checkpoint function (reentrant here: the inputs saved by ctx.save_for_backward) stays the
    layer's function, wrapped."""
    model = llama()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    func = recompute.model_function(units(model))
    want = step(model, watch=True)
    assert want[2] == [True] * LAYERS
    offload = recompute.apply(units(model), LAYERS, keep_own=True, offload_layers=range(LAYERS))
    layer_funcs = [u[0]._gradient_checkpointing_func for u in units(model)]
    assert all(isinstance(f, OffloadedCheckpoint) and f.inner is func for f in layer_funcs)
    assert recompute.model_function(units(model)) is func
    got = step(model, watch=True)
    assert got[2] == [False] * LAYERS and offload.stats().offloaded == LAYERS
    assert_bitwise(got, want)


def _checkpoint_funcs(model) -> list:
    return [u[0]._gradient_checkpointing_func if recompute._is_hf_layer(u[0]) else
            u[0].__dict__.get(recompute._FUNC) for u in units(model)]


def _saved_outside(model) -> int:
    """How many tensors autograd saves in one forward under hooks of the caller's: a checkpointed layer's inputs among
    them, unless an offload's hooks (nearer the checkpoint) take them."""
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
        torch.manual_seed(7)
        batch = ids()
        model(input_ids=batch, labels=batch)
    return len(packed)


@pytest.mark.parametrize("make,inputs", [(llama, 1), (Plain, 2)], ids=["llama", "plain"])
def test_without_offloaded_layers_nothing_is_installed(make, inputs):
    """``inputs``: the tensors a layer's checkpoint saves (a Block's scale too, which its offload leaves as it is)."""
    model = make()
    recompute.apply(units(model), LAYERS)
    before, saved = _checkpoint_funcs(model), _saved_outside(model)
    assert not any(isinstance(f, OffloadedCheckpoint) for f in before)
    assert recompute.apply(units(model), LAYERS, offload_layers={0, 3}) is not None
    assert sum(isinstance(f, OffloadedCheckpoint) for f in _checkpoint_funcs(model)) == 2
    assert _saved_outside(model) == saved - 2 * inputs
    assert recompute.apply(units(model), LAYERS, offload_layers=()) is None
    assert _checkpoint_funcs(model) == before
    assert _saved_outside(model) == saved


def test_the_memory_probe_s_disabled_block_keeps_the_offload():
    for model in (llama(), Plain()):
        offload = recompute.apply(units(model), 2, offload_layers={1})
        first = units(model)[1][0]
        with recompute.disabled(first):
            step(model)
        assert offload.stats().offloaded == 0  # layer 1 ran plainly: nothing saved for a recompute
        step(model)
        assert offload.stats().offloaded == 1


def test_offloading_a_layer_that_is_not_checkpointed_is_refused():
    model = llama()
    with pytest.raises(ValueError, match=r"layer units \[3\], which are not checkpointed"):
        recompute.apply(units(model), 2, offload_layers={1, 3})
    with pytest.raises(ValueError, match=r"layer units \[4\]: the model has 4"):
        recompute.apply(units(model), 4, offload_layers={4})


def test_one_offload_serves_several_plans():
    """A plan that changes the offloaded layers keeps the owner's ActivationOffload (its pool and counts)."""
    model = llama()
    offload = ActivationOffload()
    assert recompute.apply(units(model), LAYERS, offload_layers={0}, offload=offload) is offload
    step(model)
    assert recompute.apply(units(model), LAYERS, offload_layers={0, 1}, offload=offload) is offload
    step(model)
    assert offload.stats().offloaded == 3
