"""Model descriptions for the planner: parameters per unit and activation widths.

A unit is one decoder layer; everything else (embeddings, final norm, untied LM head, position
embeddings) forms the root unit. Built-ins are the LLaMA-1 shapes; any Hugging Face ``config.json``
of a LLaMA-style (llama, mistral, qwen2) or GPT-2 model works too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .topology import PlanError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # "llama" (gated MLP, RMSNorm) or "gpt2" (GELU MLP, LayerNorm with bias)
    num_layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    tied_embeddings: bool = False
    max_positions: int = 0  # learned position embeddings (gpt2)
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden", "intermediate", "vocab", "heads", "kv_heads"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"model {self.name}: {key} {value!r} is not a positive integer")
        if self.hidden % self.heads:
            raise PlanError(f"model {self.name}: hidden {self.hidden} not divisible by heads {self.heads}")

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    def layer_params(self) -> int:
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        if self.arch == "gpt2":
            return (2 * h) + (3 * h * h + 3 * h) + (h * h + h) + (2 * h) + (h * i + i) + (i * h + h)
        attn = 2 * h * h + 2 * h * kv + ((h + 2 * kv) if self.attention_bias else 0)
        return attn + 3 * h * i + 2 * h

    def root_params(self) -> int:
        h = self.hidden
        embed = self.vocab * h
        head = 0 if self.tied_embeddings else self.vocab * h
        if self.arch == "gpt2":
            return embed + head + self.max_positions * h + 2 * h
        return embed + head + h

    def unit_params(self) -> list[int]:
        """Parameters per unit: the root unit first, then one entry per decoder layer."""
        return [self.root_params()] + [self.layer_params()] * self.num_layers

    def total_params(self) -> int:
        return sum(self.unit_params())

    def activation_width(self) -> int:
        """Elements per token a layer keeps for backward without checkpointing (FlashAttention-style:
        no seq x seq scores). LLaMA: inputs of both norms and projections, q, k, v, attention output
        (8 h-wide for MHA) plus gate, up, act(gate) and act*up (4 i-wide), ~37.5 x h for LLaMA shapes.
        GPT-2: 8 h-wide plus the fc output and GELU output (2 i-wide)."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        if self.arch == "gpt2":
            return 8 * h + 2 * i
        return 6 * h + 2 * kv + 4 * i

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, PaLM's MFU convention: 6 x (matmul parameters) + 12 x l x h x s
        (attention scores and values, forward + backward). Embedding lookups are not matmuls."""
        matmul = self.num_layers * self.layer_params() + self.vocab * self.hidden
        return 6.0 * matmul + 12.0 * self.num_layers * self.hidden * seq_len

    def layer_forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of one decoder layer: what recomputing a checkpointed layer costs."""
        return 2.0 * self.layer_params() + 4.0 * self.hidden * seq_len

    def to_json(self) -> dict:
        return dict(self.__dict__)


BUILTIN_MODELS: dict[str, ModelSpec] = {
    "llama-7b": ModelSpec("llama-7b", "llama", 32, 4096, 11008, 32000, 32, 32),
    "llama-13b": ModelSpec("llama-13b", "llama", 40, 5120, 13824, 32000, 40, 40),
    "llama-30b": ModelSpec("llama-30b", "llama", 60, 6656, 17920, 32000, 52, 52),
    "llama-65b": ModelSpec("llama-65b", "llama", 80, 8192, 22016, 32000, 64, 64),
    # The ~1 B LLaMA shape of the GPU baselines (docs/design.md §11) (0.94 B params) and a tiny one for CPU demos and tests.
    "llama-1b": ModelSpec("llama-1b", "llama", 16, 2048, 5632, 32000, 16, 16),
    "llama-tiny": ModelSpec("llama-tiny", "llama", 4, 64, 176, 512, 4, 4),
}

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")


def from_hf_config(cfg: dict, name: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face config dict (LLaMA-style or GPT-2)."""
    mtype = cfg.get("model_type")
    try:
        if mtype in _LLAMA_LIKE:
            heads = cfg["num_attention_heads"]
            return ModelSpec(
                name, "llama", cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"],
                cfg["vocab_size"], heads, cfg.get("num_key_value_heads") or heads,
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", mtype == "qwen2")),
            )
        if mtype == "gpt2":
            h = cfg["n_embd"]
            return ModelSpec(
                name, "gpt2", cfg["n_layer"], h, cfg.get("n_inner") or 4 * h, cfg["vocab_size"],
                cfg["n_head"], cfg["n_head"], tied_embeddings=True, max_positions=cfg["n_positions"],
            )
    except KeyError as e:
        raise PlanError(f"--model {name}: config.json lacks key {e.args[0]!r} needed for {mtype}") from None
    raise PlanError(
        f"--model {name}: model_type {mtype!r} is not supported "
        f"(supported: {', '.join(_LLAMA_LIKE + ('gpt2',))})"
    )


def load_model(name_or_path: str, key: str = "--model") -> ModelSpec:
    """A built-in name (``llama-7b``, or ``7b`` for short), a ``config.json`` path, or a directory holding one.
    ``key``: how the user named it (``--model``, ``lins.model``), for the error message."""
    for name in (name_or_path, f"llama-{name_or_path}"):
        if name in BUILTIN_MODELS:
            return BUILTIN_MODELS[name]
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise PlanError(
            f"{key} {name_or_path!r}: not a built-in model ({', '.join(sorted(BUILTIN_MODELS))}) "
            "and no such config.json file"
        )
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except UnicodeDecodeError as e:
        raise PlanError(f"{key} {path}: not a config.json: the file is not UTF-8 text ({e.reason} at byte "
                        f"{e.start})") from None
    except (OSError, ValueError) as e:
        raise PlanError(f"{key} {path}: cannot read config.json: {e}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{key} {path}: a config.json holds a JSON object, this file holds a {type(cfg).__name__}")
    return from_hf_config(cfg, name_or_path)
