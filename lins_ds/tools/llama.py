"""LLaMA shapes by the planner's built-in names (``lins-ds plan --model``) and learnable synthetic tokens: what the
demo, the example script and the benchmark train."""

from __future__ import annotations

from ..plan import PlanError, load_model


def llama_config(name: str, seq_len: int):
    """A transformers LlamaConfig with the shapes of the planner's built-in model ``name``."""
    import transformers

    spec = load_model(name)
    if spec.arch != "llama":
        raise PlanError(f"--model {name} is a {spec.arch} model; this builds LLaMA shapes")
    return transformers.LlamaConfig(
        hidden_size=spec.hidden, num_hidden_layers=spec.num_layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, intermediate_size=spec.intermediate, vocab_size=spec.vocab,
        tie_word_embeddings=spec.tied_embeddings, max_position_embeddings=max(seq_len, 128),
        attn_implementation="sdpa")


def progressions(vocab: int, seq_len: int, micro_batch: int, seed: int, device=None):
    """Endless micro-batches of token rows x_t = start + stride * t (mod vocab): learnable, so the loss falls
    within a few dozen steps."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t = torch.arange(seq_len)
    while True:
        start = torch.randint(0, vocab, (micro_batch, 1), generator=g)
        stride = torch.randint(1, 8, (micro_batch, 1), generator=g)
        yield ((start + stride * t) % vocab).to(device)
