"""Model descriptions for the planner: parameters per unit and activation widths.

A unit is one decoder layer; everything else (embeddings, final norm, untied LM head, position
embeddings) forms the root unit. Built-ins are the LLaMA-1 shapes; Hugging Face ``config.json`` files of
LLaMA-style (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3, phi3), MoE (mixtral, qwen2_moe, qwen3_moe)
and GPT-2 models are read (``SUPPORTED``). Any other model is described by the engine from the model itself
(``measured``): its parameter counts per unit are exact, its activations measured by the memory probe where
the device allows, else estimated from its widths (``ModelSpec.unmodelled`` says what was not modelled).
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
    head_dim: int = 0  # attention head width where it is not hidden / heads (gemma); 0: hidden // heads
    norms_per_layer: int = 2  # RMSNorms in a layer (gemma2/3: 4)
    qk_norm: bool = False  # RMSNorm of each head's queries and keys (qwen3, gemma3)
    fused_projections: bool = False  # one QKV and one gate-up linear layer, their outputs sliced (phi3)
    experts: int = 0  # MoE: routed experts per layer (0: a dense MLP of ``intermediate``)
    experts_per_token: int = 0  # MoE: top-k
    shared_intermediate: int = 0  # MoE: a shared expert's width (qwen2_moe), with its own gate
    attention: str = "sdpa"  # the attention implementation: "eager" keeps seq x seq tensors (formula_activations)
    attn_softcap: bool = False  # eager attention soft-caps its scores (gemma2): one seq x seq tensor more
    attention_masks: int = 1  # causal masks an eager model builds (gemma2: full and sliding-window)
    measured_units: tuple = ()  # a model the reader does not know: (root params, layer params...) counted on it
    unmodelled: str = ""  # what this description could not model (said in the plan's summary)

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden", "intermediate", "vocab", "heads", "kv_heads"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"model {self.name}: {key} {value!r} is not a positive integer")
        if self.hidden % self.heads and not self.head_dim:
            raise PlanError(f"model {self.name}: hidden {self.hidden} not divisible by heads {self.heads}")

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    @property
    def q_dim(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    def _mlp_params(self, active: bool) -> int:
        """The MLP's parameters: all of them, or (``active``) those one token uses (top-k experts)."""
        h, i = self.hidden, self.intermediate
        if not self.experts:
            return 3 * h * i
        routed = (self.experts_per_token if active else self.experts) * 3 * h * i
        shared = 3 * h * self.shared_intermediate + h if self.shared_intermediate else 0
        return h * self.experts + routed + shared

    def layer_params(self, active: bool = False) -> int:
        """One decoder layer's parameters (the average over layers for a measured model); ``active``: those one
        token computes with (an MoE layer's top-k experts, not all of them)."""
        if self.measured_units:
            return sum(self.measured_units[1:]) // max(1, len(self.measured_units) - 1)
        h, i, kv, q = self.hidden, self.intermediate, self.kv_dim, self.q_dim
        if self.arch == "gpt2":
            return (2 * h) + (3 * h * h + 3 * h) + (h * h + h) + (2 * h) + (h * i + i) + (i * h + h)
        attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if self.attention_bias else 0)
        attn += 2 * (self.head_dim or h // self.heads) if self.qk_norm else 0
        return attn + self._mlp_params(active) + self.norms_per_layer * h

    def root_params(self) -> int:
        if self.measured_units:
            return self.measured_units[0]
        h = self.hidden
        embed = self.vocab * h
        head = 0 if self.tied_embeddings else self.vocab * h
        if self.arch == "gpt2":
            return embed + head + self.max_positions * h + 2 * h
        return embed + head + h

    def unit_params(self) -> list[int]:
        """Parameters per unit: the root unit first, then one entry per decoder layer."""
        if self.measured_units:
            return list(self.measured_units)
        return [self.root_params()] + [self.layer_params()] * self.num_layers

    def total_params(self) -> int:
        return sum(self.unit_params())

    def activation_width(self) -> int:
        """Elements per token a layer keeps for backward without checkpointing (FlashAttention-style:
        no seq x seq scores). LLaMA: inputs of both norms and projections, q, k, v, attention output
        (8 h-wide for MHA) plus gate, up, act(gate) and act*up (4 i-wide), ~37.5 x h for LLaMA shapes.
        GPT-2: 8 h-wide plus the fc output and GELU output (2 i-wide)."""
        h, i, kv, q = self.hidden, self.intermediate, self.kv_dim, self.q_dim
        if self.arch == "gpt2":
            return 8 * h + 2 * i
        attention = 4 * h + 2 * q + 2 * kv
        if not self.experts:
            return attention + 4 * i
        # each token's top-k experts keep their four i-wide tensors; the router its logits (and probabilities)
        shared = 4 * self.shared_intermediate if self.shared_intermediate else 0
        return attention + 4 * self.experts_per_token * i + 2 * self.experts + shared

    def eager_score_bytes(self, param_bytes: int) -> int:
        """Bytes per token per key position one layer keeps for backward in eager attention (0 where attention is
        fused, FlashAttention-style): the softmax's fp32 output, its cast to the parameter dtype (which the value
        product saves), and with soft-capping the tanh's output."""
        if self.attention != "eager":
            return 0
        cast = param_bytes if param_bytes != 4 else 0
        return self.heads * (4 + cast + (param_bytes if self.attn_softcap else 0))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, PaLM's MFU convention: 6 x (matmul parameters) + 12 x l x h x s
        (attention scores and values, forward + backward). Embedding lookups are not matmuls."""
        matmul = self.num_layers * self.layer_params(active=True) + self.vocab * self.hidden
        return 6.0 * matmul + 12.0 * self.num_layers * self.hidden * seq_len

    def layer_forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of one decoder layer: what recomputing a checkpointed layer costs."""
        return 2.0 * self.layer_params(active=True) + 4.0 * self.hidden * seq_len

    def to_json(self) -> dict:
        out = dict(self.__dict__)
        out["measured_units"] = list(self.measured_units)
        return out


BUILTIN_MODELS: dict[str, ModelSpec] = {
    "llama-7b": ModelSpec("llama-7b", "llama", 32, 4096, 11008, 32000, 32, 32),
    "llama-13b": ModelSpec("llama-13b", "llama", 40, 5120, 13824, 32000, 40, 40),
    "llama-30b": ModelSpec("llama-30b", "llama", 60, 6656, 17920, 32000, 52, 52),
    "llama-65b": ModelSpec("llama-65b", "llama", 80, 8192, 22016, 32000, 64, 64),
    # The ~1 B LLaMA shape of the GPU baselines (docs/design.md §11) (0.94 B params) and a tiny one for CPU demos and tests.
    "llama-1b": ModelSpec("llama-1b", "llama", 16, 2048, 5632, 32000, 16, 16),
    "llama-tiny": ModelSpec("llama-tiny", "llama", 4, 64, 176, 512, 4, 4),
}

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text")
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED = _LLAMA_LIKE + _MOE + ("gpt2",)


def _llama_like(cfg: dict, name: str, mtype: str, **extra) -> ModelSpec:
    heads = cfg["num_attention_heads"]
    gemma = mtype.startswith("gemma")
    head_dim = int(cfg.get("head_dim") or 0)  # LLaMA and Mistral too may set it (Mistral-NeMo: 128, not 5120 / 32)
    own_width = gemma or mtype.startswith("qwen3") or (head_dim and head_dim * heads != cfg["hidden_size"])
    return ModelSpec(
        name, "llama", cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"],
        heads, cfg.get("num_key_value_heads") or heads,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        attention_bias=bool(cfg.get("attention_bias", mtype in ("qwen2", "qwen2_moe"))),
        head_dim=head_dim if own_width else 0,
        norms_per_layer=4 if mtype in ("gemma2", "gemma3_text") else 2,
        qk_norm=mtype in ("qwen3", "qwen3_moe", "gemma3_text"), fused_projections=mtype == "phi3",
        attention=attention_of(cfg, mtype), attn_softcap=bool(cfg.get("attn_logit_softcapping")),
        attention_masks=2 if cfg.get("sliding_window") and mtype.startswith("gemma") else 1, **extra)


EAGER_ONLY = ("gemma2",)  # transformers has no SDPA path for these: they run eager attention


def attention_of(cfg: dict, mtype: str) -> str:
    """The attention implementation a config runs: its own (the engine passes the model's ``_attn_implementation``;
    a config.json may name ``attn_implementation``), else eager for the types transformers runs no other way, else
    SDPA (transformers' default where torch has it)."""
    named = cfg.get("_attn_implementation") or cfg.get("attn_implementation")
    return str(named) if named else ("eager" if mtype in EAGER_ONLY else "sdpa")


def from_hf_config(cfg: dict, name: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face config dict (``SUPPORTED`` model types)."""
    mtype = cfg.get("model_type")
    try:
        if mtype in _LLAMA_LIKE:
            return _llama_like(cfg, name, mtype)
        if mtype == "mixtral":
            return _llama_like(cfg, name, mtype, experts=cfg["num_local_experts"],
                               experts_per_token=cfg["num_experts_per_tok"])
        if mtype in ("qwen2_moe", "qwen3_moe"):
            spec = _llama_like({**cfg, "intermediate_size": cfg["moe_intermediate_size"]}, name, mtype,
                               experts=cfg.get("num_experts") or cfg["num_local_experts"],
                               experts_per_token=cfg["num_experts_per_tok"],
                               shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0))
            if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
                raise PlanError(f"--model {name}: {mtype} with dense layers among the sparse ones is not modelled")
            return spec
        if mtype == "gpt2":
            h = cfg["n_embd"]
            return ModelSpec(
                name, "gpt2", cfg["n_layer"], h, cfg.get("n_inner") or 4 * h, cfg["vocab_size"],
                cfg["n_head"], cfg["n_head"], tied_embeddings=True, max_positions=cfg["n_positions"],
            )
    except KeyError as e:
        raise PlanError(f"--model {name}: config.json lacks key {e.args[0]!r} needed for {mtype}") from None
    raise PlanError(f"--model {name}: model_type {mtype!r} is not modelled (modelled: {', '.join(SUPPORTED)})")


def measured(name: str, units: list, hidden: int, vocab: int, intermediate: int = 0, heads: int = 1,
             note: str = "") -> ModelSpec:
    """A model the reader does not know, described by the engine from the model itself: ``units`` its exact
    parameter counts (root first, then each layer unit); activations estimated as a LLaMA layer of its widths
    (``intermediate`` 0: 4 x hidden) unless the memory probe measures them."""
    heads = heads if heads > 0 and hidden % heads == 0 else 1  # no config to name them: one head
    return ModelSpec(name, "llama", max(1, len(units) - 1), hidden, intermediate or 4 * hidden, vocab, heads, heads,
                     measured_units=tuple(units), unmodelled=note)


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
