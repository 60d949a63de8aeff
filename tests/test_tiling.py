"""Sequence tiling (lins_ds/runtime/step/tiling.py, issue 60): the tiled MLP and the tiled logits + loss give
transformers' loss and gradients (fp32, within 1e-6) on tiny LLaMA, Qwen2 and Gemma-2 models, with ignored tokens and
tile counts that do not divide the sequence; no tensor of the whole seq x intermediate or seq x vocab is made; each
parameter's gradient hooks fire once per backward; dropout inside a tiled module gets the forward's masks back."""

import copy
import math

import pytest
import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.loss.loss_utils import ForCausalLMLoss

from lins_ds.runtime.step import recompute, tiling

HIDDEN, INTERMEDIATE, VOCAB, BATCH, SEQ = 32, 72, 101, 2, 30  # distinct sizes: the size probe tells them apart
CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)}
# transformers runs Gemma-2 with eager attention only (it refuses sdpa for it)
MODELS = [("llama", "eager"), ("llama", "sdpa"), ("qwen2", "eager"), ("qwen2", "sdpa"), ("gemma2", "eager")]


def make(kind: str, attn: str = "eager", layers: int = 2, seed: int = 0) -> nn.Module:
    config_cls, model_cls = CLASSES[kind]
    # logits of a few units (initializer_range), where Gemma-2's cap of 1 changes them
    extra = {"head_dim": 8, "query_pre_attn_scalar": 8, "final_logit_softcapping": 1.0} if kind == "gemma2" else {}
    cfg = config_cls(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                     initializer_range=0.2, **extra)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return model_cls(cfg).train()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :9] = -100  # a prompt left out of the loss
    labels[1, 17:] = -100  # padding
    return ids, labels


def loss_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    ids, labels = batch()
    out = model(input_ids=ids, labels=labels, **kwargs)
    loss = out["loss"] if isinstance(out, dict) else out[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind,attn", MODELS)
@pytest.mark.parametrize("mlp_tiles,logits_tiles", [(4, 7), (1, 8), (29, 1)])
def test_a_tiled_model_gives_the_untiled_loss_and_gradients(kind, attn, mlp_tiles, logits_tiles):
    model = make(kind, attn)
    want = loss_and_grads(model)
    installed = tiling.apply_tiling(model, mlp_tiles, logits_tiles)
    assert (installed.mlp_tiles, installed.logits_tiles) == (mlp_tiles, logits_tiles)
    assert_same(loss_and_grads(model), want)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_tiling_under_checkpointing_and_activation_offload_gives_the_same_gradients(kind):
    """The tiled MLP inside a checkpointed layer (its forward runs again in the recompute), with the layer inputs
    offloaded."""
    model = make(kind, layers=3)
    want = loss_and_grads(model)
    units = [[layer] for layer in model.model.layers]
    recompute.apply(units, 3, offload_layers={0, 2})
    tiling.apply_tiling(model, 3, 5)
    assert_same(loss_and_grads(model), want)


class Widest(TorchDispatchMode):
    """The most positions (elements / last dimension) of any tensor an operator makes whose last dimension is one of
    ``dims``; views (no memory of their own) and tensors of a parameter's shape (weights, their gradients) aside."""

    def __init__(self, dims, param_shapes):
        super().__init__()
        self.rows, self.skip = {d: 0 for d in dims}, param_shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] in self.rows \
                        and tuple(t.shape) not in self.skip:
                    self.rows[t.shape[-1]] = max(self.rows[t.shape[-1]], t.numel() // t.shape[-1])
        return out


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_no_tensor_holds_the_whole_intermediate_or_logits(kind):
    model = make(kind)
    ids, labels = batch()
    shapes = {tuple(p.shape) for p in model.parameters()}
    positions = {}
    for tiles in ((1, 1), (4, 7)):
        tiling.apply_tiling(model, *tiles)
        with Widest((INTERMEDIATE, VOCAB), shapes) as probe:
            model(input_ids=ids, labels=labels).loss.backward()
        positions[tiles] = probe.rows
    assert positions[(1, 1)] == {INTERMEDIATE: BATCH * SEQ, VOCAB: BATCH * SEQ}  # the probe sees whole ones
    assert positions[(4, 7)] == {INTERMEDIATE: BATCH * math.ceil(SEQ / 4), VOCAB: math.ceil(BATCH * SEQ / 7)}


def test_the_tiled_loss_is_transformers_loss_with_its_options():
    """num_items_in_batch, shift_labels, another ignore_index, a soft cap, a bias, a tile with no counted token."""
    torch.manual_seed(0)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    head = nn.Linear(HIDDEN, VOCAB)
    labels = batch()[1]
    labels[0, :] = -100  # with 6 tiles over 60 positions, the first tiles count no token
    shifted = torch.roll(batch()[0], 3, dims=1)
    cases = [dict(), dict(num_items_in_batch=torch.tensor(40)), dict(shift_labels=shifted),
             dict(ignore_index=7, labels=batch()[0]), dict(softcap=2.0)]
    for case in cases:
        case = dict(case)
        lab, softcap = case.pop("labels", labels), case.pop("softcap", None)
        logits = head(hidden)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        want = ForCausalLMLoss(logits, lab, VOCAB, **case)
        want_grads = torch.autograd.grad(want, [hidden, head.weight, head.bias])
        got = tiling.tiled_causal_lm_loss(hidden, head.weight, lab, tiles=6, bias=head.bias, softcap=softcap, **case)
        got_grads = torch.autograd.grad(got * 3.0, [hidden, head.weight, head.bias])  # the upstream gradient counts
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=str(case))
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, 3.0 * w, rtol=1e-6, atol=1e-6, msg=str(case))


def test_gemma2_s_soft_cap_is_what_makes_its_loss():
    """The Gemma-2 comparisons above can fail: without the cap the tiled loss is another loss."""
    model = make("gemma2")
    ids, labels = batch()
    want = model(input_ids=ids, labels=labels).loss
    hidden = model.model(input_ids=ids).last_hidden_state
    uncapped = tiling.tiled_causal_lm_loss(hidden, model.lm_head.weight, labels, tiles=3)
    capped = tiling.tiled_causal_lm_loss(hidden, model.lm_head.weight, labels, tiles=3, softcap=1.0)
    torch.testing.assert_close(capped, want, rtol=1e-6, atol=1e-6)
    assert abs(uncapped.item() - want.item()) > 0.1


def test_positional_labels_tuples_and_num_items_in_batch_as_transformers_gives_them():
    model = make("qwen2")
    ids, labels = batch()
    n = torch.tensor(25)
    want_n, want = loss_and_grads(model, num_items_in_batch=n), loss_and_grads(model)
    tiling.apply_tiling(model, 3, 4)
    assert_same(loss_and_grads(model, num_items_in_batch=n), want_n)
    model.zero_grad(set_to_none=True)
    out = model(ids, None, None, None, None, labels, return_dict=False)  # labels by position, a tuple back
    out[0].backward()
    assert_same((out[0].detach(), {k: p.grad.clone() for k, p in model.named_parameters()}), want)
    assert out[1].shape == (BATCH, 0, VOCAB)  # the logits that were never made


def test_evaluation_and_kept_logits_run_untouched():
    model = make("llama")
    ids, labels = batch()
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels)
    tiling.apply_tiling(model, 4, 4)
    with torch.no_grad():
        got = model(input_ids=ids, labels=labels)
    assert got.logits.shape == (BATCH, SEQ, VOCAB)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    last = model(input_ids=ids, logits_to_keep=1)  # generation's call: no labels
    assert last.logits.shape == (BATCH, 1, VOCAB) and last.loss is None


class FlatMLP(nn.Module):
    """A gate/up/down MLP with dropout, its parameters views into one flat buffer (as a Lins unit's are)."""

    def __init__(self, p_drop: float = 0.0):
        super().__init__()
        self.gate, self.up = nn.Linear(HIDDEN, INTERMEDIATE), nn.Linear(HIDDEN, INTERMEDIATE)
        self.down = nn.Linear(INTERMEDIATE, HIDDEN)
        self.drop = nn.Dropout(p_drop)
        self.flat = torch.zeros(sum(p.numel() for p in self.parameters()))
        offset = 0
        for p in self.parameters():
            view = self.flat[offset:offset + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
            offset += p.numel()

    def forward(self, x):
        return self.down(self.drop(nn.functional.silu(self.gate(x)) * self.up(x)))


def test_every_parameter_gets_its_whole_gradient_once_per_backward():
    """Lins counts a unit's gradients in by their hooks: a tiled module fires each once, with the whole gradient,
    into ``.grad`` views of a flat accumulator too (DeepSpeed's TiledMLP fires once per tile)."""
    torch.manual_seed(0)
    mlp = FlatMLP()
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    upstream = torch.randn(BATCH, SEQ, HIDDEN)
    (mlp(x) * upstream).sum().backward()
    want = ({n: p.grad.clone() for n, p in mlp.named_parameters()}, x.grad.clone())
    acc = torch.zeros_like(mlp.flat)
    offset = 0
    for p in mlp.parameters():  # .grad a view into one accumulator, as Lins' in-place units hold it
        p.grad = acc[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    calls = {}
    for n, p in mlp.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
    x.grad = None
    tiling.tile_module(mlp, 3)
    (mlp(x) * upstream).sum().backward()
    assert calls == {n: 1 for n, _ in mlp.named_parameters()}
    got_acc = torch.cat([want[0][n].reshape(-1) for n, _ in mlp.named_parameters()])
    torch.testing.assert_close(acc, got_acc, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, want[1], rtol=1e-6, atol=1e-6)


def test_dropout_in_a_tiled_module_gets_the_forward_s_masks_in_the_recompute():
    """The reference runs the same tiles one after another under autograd (the same masks, drawn in the same order):
    the tiled backward recomputes with the RNG state the forward had, so its gradients are those of that forward."""
    torch.manual_seed(0)
    mlp = FlatMLP(p_drop=0.5).train()
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    upstream = torch.randn(BATCH, SEQ, HIDDEN)
    bounds = tiling.tile_bounds(SEQ, 4)
    torch.manual_seed(5)
    want_out = torch.cat([mlp(x[:, a:b]) for a, b in bounds], dim=1)
    after_want = torch.rand(3)  # where the RNG stands after the forward
    (want_out * upstream).sum().backward()
    want = {n: p.grad.clone() for n, p in mlp.named_parameters()}, x.grad.clone()
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    tiling.tile_module(mlp, 4)
    torch.manual_seed(5)
    got_out = mlp(x)
    after_got = torch.rand(3)
    (got_out * upstream).sum().backward()
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=0)
    assert torch.equal(after_got, after_want)  # the forward advanced the RNG as the untiled one does
    for n, p in mlp.named_parameters():
        torch.testing.assert_close(p.grad, want[0][n], rtol=1e-6, atol=1e-6, msg=n)
    torch.testing.assert_close(x.grad, want[1], rtol=1e-6, atol=1e-6)


def _installed(model) -> tuple:
    mlps = [layer.mlp for layer in model.model.layers]
    return (len(model._forward_pre_hooks), len(model._forward_hooks), len(model.lm_head._forward_pre_hooks),
            sum("forward" in m.__dict__ for m in mlps), tiling.tiling_of(model) is not None)


def test_one_tile_installs_nothing_and_removal_takes_everything_off():
    model = make("llama")
    bare = _installed(model)
    assert bare == (0, 0, 0, 0, False)
    assert tiling.apply_tiling(model, 1, 1) is None
    assert _installed(model) == bare
    tiling.apply_tiling(model, 3, 3)
    assert _installed(model) == (1, 1, 1, 2, True)
    tiling.apply_tiling(model, 2, 1)  # replaces: the loss hooks go
    assert _installed(model) == (0, 0, 0, 2, True)
    tiling.remove_tiling(model)
    assert _installed(model) == bare


def test_a_deep_copy_of_a_tiled_model_is_tiled_and_trains_its_own_parameters():
    model = make("llama")
    want = loss_and_grads(copy.deepcopy(model))
    tiling.apply_tiling(model, 3, 1)
    clone = copy.deepcopy(model)
    got = loss_and_grads(clone)
    assert all(p.grad is None for p in model.parameters())
    assert_same(got, want)


def test_unsupported_models_are_refused_by_name():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB))
    with pytest.raises(TypeError, match="GPT2LMHeadModel"):
        tiling.apply_tiling(gpt2, 2, 2)

    class MyLlama(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    with pytest.raises(TypeError, match="MyLlama: it overrides LlamaForCausalLM.forward"):
        tiling.apply_tiling(MyLlama(make("llama").config), 2, 2)
    model = make("llama")
    model.lm_head = nn.Sequential(model.lm_head)
    with pytest.raises(TypeError, match="lm_head is Sequential"):
        tiling.apply_tiling(model, 1, 2)
    assert tiling.apply_tiling(model, 2, 1) is not None  # MLP tiling alone does not read the head
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            tiling.apply_tiling(make("llama"), bad, 1)
