"""Compute of a training step priced from the model's shape (issue 27), not from a per-model efficiency.

A micro-batch of T = micro-batch x sequence tokens runs, per decoder layer, the GEMMs of its projections (queries,
keys, values, output; gate, up, down), causal attention, and memory-bound element-wise work (norms, rotary
embedding, the gated activation, residual adds); then the LM head's GEMM and the cross-entropy over the vocabulary.
Each GEMM (m x k) @ (k x n) is priced at the rate the device's compute table measured for its sizes (forward
(T, n, k), backward (T, k, n) for the input's gradient and (k, n, T) for the weight's; a linear layer with a width
not a multiple of 8, as GPT-2's LM head over 50257 tokens, at the rate the table measured for such GEMMs, several
times slower), attention at its measured
rate for the sequence length and head width, the element-wise work by the bytes Hugging Face's layers move through
it (``ELEMENTWISE_BYTES``, counted op by op) at the measured bandwidth. A checkpointed layer runs its forward twice.
The table comes from ``python -m bench.compute_profile`` (``python -m bench profile --compute``), which also times a few
whole layers as training queues them: what they took over this model's price is the table's in-training factor
(``in_training_factor``), the share of a step's kernels the isolated rates miss. On one H200 a layer's GEMMs take
0.58-0.93 of their isolated time among other kernels (median 0.79) and its element-wise kernels reach about 63 %
of the streaming bandwidth; the two nearly cancel (the factor is 1.02). One layer of each of 23 shapes whose
kernels set its pace (20 of the grid's, the 2.9B's, the 1B's, the 7B's) took 0.96-1.04 of its price with the
factor; three narrow ones
took 1.42-1.51, presumably waiting for their launches (``python -m bench layer-split``,
bench/results/simulate/shapes/call20). Pure Python here, no torch.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass

from lins_ds.plan.model import ModelSpec
from lins_ds.plan.spec import ALIGN_BYTES, TrainingSpec
from lins_ds.plan.topology import PlanError

FORMAT = "lins_ds.compute/1"
# bytes each token moves through the memory-bound kernels of one layer, per unit of the (hidden, intermediate, kv)
# widths, as Hugging Face's eager layers run them, counted op by op (every input read and output written by the
# aten ops that are not GEMMs or attention) on the installed transformers: tests/test_compute_model.py re-counts
# them. A LLaMA layer's are mostly its two RMSNorms, which run in fp32 (cast, square, mean, scale, cast back, the
# weight: about 36 bytes per hidden unit each, forward), then rotary embedding on queries and keys, the gated
# activation and the residual adds; autograd's backward of the same ops moves about 2.4 times the forward.
# "q": per unit of query width beyond the hidden one, where heads x head_dim is not hidden (Qwen3-0.6B, Gemma): the
# queries' rotary embedding and the attention output (a least-squares count over LLaMAs of eight head widths).
# "qk_norm": Qwen3's (and Gemma 3's) RMSNorm of each head's queries and keys, per unit of the query and key widths
# (q_dim + kv_dim), counted the same way against a LLaMA of the same shapes: an fp32 RMSNorm again.
ELEMENTWISE_BYTES = {
    "llama": {"forward": {"hidden": 106, "intermediate": 10, "kv": 28, "q": 23, "qk_norm": 36},
              "backward": {"hidden": 256, "intermediate": 18, "kv": 32, "q": 32, "qk_norm": 96}},
    # GPT-2 (LayerNorm, tanh GELU, residual dropout), counted without attention dropout: flash attention applies it
    # inside its kernel on a GPU, where the CPU's SDPA materialises the attention matrix for it
    "gpt2": {"forward": {"hidden": 56, "intermediate": 36, "kv": 0},
             "backward": {"hidden": 57, "intermediate": 58, "kv": 0}},
}
# Phi-3's fused QKV and gate-up projections, on top of a LLaMA layer's bytes: their outputs sliced apart (and its
# rotary's cat of rotated and passed-through parts), and in the backward the slices' gradients put back together
# (slice_backward, the adds that sum them, a cat for the gate-up halves). Per token and unit, counted against a
# LLaMA of the same shapes (the same counter; exact over five shapes). Its GEMMs are priced as the separate ones.
FUSED_BYTES = {"forward": {"hidden": 8, "intermediate": 0, "kv": 4},
               "backward": {"hidden": 10, "intermediate": 8, "kv": 48}}
# per token outside the layers (the final norm, the embedding) per hidden unit, and per logit (the loss casts the
# logits to fp32, log-softmax, NLL, and their gradient), (forward, backward)
HEAD_BYTES = {"llama": {"hidden": (38, 97), "logit": (20, 28)}, "gpt2": {"hidden": (31, 24), "logit": (19, 28)}}

# cuBLAS runs a bf16 GEMM on its fastest kernels only where the widths it strides over are multiples of 8 elements
# (16 bytes); a linear layer with an odd width (GPT-2's vocabulary of 50257) falls back to slower ones, priced by the
# table's "misaligned" entries
ALIGN = ALIGN_BYTES // 2  # elements of a bf16 / fp16 GEMM, the tables' dtype
ROLES = ("forward", "input_grad", "weight_grad")  # a linear layer's three GEMMs
LAYER_KEYS = ("hidden", "intermediate", "heads", "kv_heads", "seq", "micro_batch", "seconds")


def _alignment(n: int, k: int) -> int:
    """The largest power of two up to ALIGN dividing both widths of a linear layer (ALIGN: aligned)."""
    return min(ALIGN, n & -n, k & -k)


def _log2(x: float) -> float:
    return math.log2(max(1.0, x))


def _log_distance(a: tuple, b: tuple) -> float:
    """Squared distance between two size tuples in log2 space (nearest-point lookups)."""
    return sum((_log2(x) - _log2(y)) ** 2 for x, y in zip(a, b))


@dataclass(frozen=True)
class ComputeTable:
    device: str
    gemm: tuple  # ((m, n, k, tflops), ...)
    attention: tuple  # ((seq, head_dim, tflops), ...)
    bandwidth_gbs: float
    source: str = ""
    layers: tuple = ()  # ((hidden, intermediate, heads, kv_heads, seq, micro_batch, seconds), ...): whole layers timed
    # ((m, n, k, role, tflops, aligned_tflops), ...): a linear layer's GEMMs (m tokens, n out and k in features, one
    # not a multiple of ALIGN) next to the same GEMM at aligned widths, timed together
    misaligned: tuple = ()

    def step_compute(self, model: ModelSpec, train: TrainingSpec, ckpt_units: int = 0) -> "StepCompute":
        """``step_compute`` with this table: what the solver calls where ``ComputeSpec.table`` is one."""
        return step_compute(model, train, self, ckpt_units)

    @classmethod
    def from_json(cls, obj: dict, origin: str = "compute table") -> "ComputeTable":
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise PlanError(f"{origin}: not a lins_ds compute table (expected \"format\": \"{FORMAT}\")")
        try:
            gemm = tuple((int(g["m"]), int(g["n"]), int(g["k"]), float(g["tflops"])) for g in obj["gemm"])
            attn = tuple((int(a["seq"]), int(a["head_dim"]), float(a["tflops"])) for a in obj["attention"])
            layers = tuple((int(r["hidden"]), int(r["intermediate"]), int(r["heads"]), int(r["kv_heads"]),
                            int(r["seq"]), int(r["micro_batch"]), float(r["seconds"])) for r in obj.get("layers", ()))
            odd = tuple((int(r["m"]), int(r["n"]), int(r["k"]), str(r["role"]), float(r["tflops"]),
                         float(r["aligned_tflops"])) for r in obj.get("misaligned", ()))
            if any(r[3] not in ROLES or r[1] % ALIGN == 0 and r[2] % ALIGN == 0 for r in odd):
                raise ValueError(f"a misaligned GEMM has a role not in {ROLES} or no width off a multiple of {ALIGN}")
            return cls(str(obj["device"]), gemm, attn, float(obj["bandwidth_gbs"]), str(obj.get("source", origin)),
                       layers, odd)
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{origin}: malformed compute table ({type(e).__name__}: {e})") from None

    def to_json(self) -> dict:
        return {"format": FORMAT, "device": self.device, "bandwidth_gbs": self.bandwidth_gbs, "source": self.source,
                "gemm": [{"m": m, "n": n, "k": k, "tflops": t} for m, n, k, t in self.gemm],
                "attention": [{"seq": s, "head_dim": d, "tflops": t} for s, d, t in self.attention],
                "layers": [dict(zip(LAYER_KEYS, row)) for row in self.layers],
                "misaligned": [dict(zip(("m", "n", "k", "role", "tflops", "aligned_tflops"), row))
                               for row in self.misaligned]}

    @classmethod
    def load(cls, path: str) -> "ComputeTable":
        try:
            with open(path, encoding="utf-8") as f:
                return cls.from_json(json.load(f), origin=path)
        except (OSError, ValueError) as e:
            raise PlanError(f"{path}: cannot read compute table ({e})") from None

    def gemm_tflops(self, m: int, n: int, k: int) -> float:
        """Trilinear in (log m, log n, log k) between the measured grid points around it; sizes beyond the grid take
        its edge; corners not measured (the largest GEMMs) leave the weight to those that were."""
        rates = {(gm, gn, gk): t for gm, gn, gk, t in self.gemm}
        corners, total, weight = [], 0.0, 0.0
        for axis, x in zip(zip(*rates), (m, n, k)):
            pts = sorted(set(axis))
            x = min(max(x, pts[0]), pts[-1])
            hi = next(i for i, p in enumerate(pts) if p >= x)
            lo = max(0, hi - 1) if pts[hi] > x else hi
            f = 0.0 if lo == hi else (_log2(x) - _log2(pts[lo])) / (_log2(pts[hi]) - _log2(pts[lo]))
            corners.append(((pts[lo], 1.0 - f), (pts[hi], f)))
        for (a, wa) in corners[0]:
            for (b, wb) in corners[1]:
                for (c, wc) in corners[2]:
                    w = wa * wb * wc
                    if w > 0 and (a, b, c) in rates:
                        total, weight = total + w * rates[(a, b, c)], weight + w
        if weight > 0:
            return total / weight
        return min(rates.items(), key=lambda kv: _log_distance((m, n, k), kv[0]))[1]

    def gemm_s(self, m: int, n: int, k: int) -> float:
        return 2.0 * m * n * k / (self.gemm_tflops(m, n, k) * 1e12)

    def misaligned_tflops(self, role: str, m: int, n: int, k: int):
        """The rate of a linear layer's ``role`` GEMM (``m`` tokens, ``n`` out and ``k`` in features) where ``n`` or
        ``k`` is not a multiple of ALIGN: that of the table's nearest misaligned row of that role (log distance over
        m, n, k), on the same side (out or in features) and of the same alignment (odd, 2, 4) where it has one. None
        where both widths are aligned or the table has no such rows (tables measured before them). Those kernels run
        at a rate of their own (on an H200 about 95-150 TFLOP/s for an odd width, 200-280 for a multiple of 2 or 4,
        whatever the aligned twin's 620-820), so the rate is taken as measured, not as a share of the twin's."""
        if n % ALIGN == 0 and k % ALIGN == 0:
            return None
        rows = [r for r in self.misaligned if r[3] == role]
        rows = [r for r in rows if (r[1] % ALIGN != 0) == (n % ALIGN != 0)] or rows
        rows = [r for r in rows if _alignment(r[1], r[2]) == _alignment(n, k)] or rows
        if not rows:
            return None
        return min(rows, key=lambda r: _log_distance((m, n, k), r[:3]))[4]

    def linear_s(self, m: int, n: int, k: int) -> tuple:
        """(forward, backward) seconds of a linear layer over ``m`` tokens, ``k`` in and ``n`` out features: the
        forward (m, n, k); the input's gradient (m, k, n) and the weight's (k, n, m) as GEMMs. A misaligned one at
        its measured rate (``misaligned_tflops``), never above the aligned rate for its sizes."""
        def seconds(role, dims):
            rate, odd = self.gemm_tflops(*dims), self.misaligned_tflops(role, m, n, k)
            return 2.0 * m * n * k / (min(rate, odd or rate) * 1e12)

        fwd = seconds("forward", (m, n, k))
        return fwd, seconds("input_grad", (m, k, n)) + seconds("weight_grad", (k, n, m))

    def attention_tflops(self, seq: int, head_dim: int) -> float:
        """Linear in log seq between measured lengths (the edge beyond), at the nearest measured head width."""
        widths = sorted({d for _, d, _ in self.attention}, key=lambda d: abs(_log2(d) - _log2(head_dim)))
        pts = sorted((s, t) for s, d, t in self.attention if d == widths[0])
        if seq <= pts[0][0]:
            return pts[0][1]
        for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
            if seq <= s1:
                f = (_log2(seq) - _log2(s0)) / (_log2(s1) - _log2(s0))
                return t0 + f * (t1 - t0)
        return pts[-1][1]


def layer_price_s(table: ComputeTable, hidden: int, intermediate: int, heads: int, kv_heads: int, seq: int,
                  micro_batch: int) -> float:
    """One LLaMA decoder layer's forward and backward as the shape model prices it from ``table``."""
    model = ModelSpec("layer", "llama", 1, hidden, intermediate, 32000, heads, kv_heads)
    one = step_compute(model, TrainingSpec(seq, micro_batch, 1), table)
    return one.layer_forward_s + one.layer_backward_s


def in_training_factor(table: ComputeTable) -> float:
    """How much longer whole layers took than the shape model prices them from the rest of ``table`` (the median
    over its timed layers; ``python -m bench profile --compute`` times them as training queues them): kernels among
    other kernels, not alone. 1.0 for a table without timed layers (measured before they were, or without
    transformers)."""
    if not table.layers:
        return 1.0
    return statistics.median(row[-1] / layer_price_s(table, *row[:-1]) for row in table.layers)


@dataclass(frozen=True)
class StepCompute:
    """One step's compute, by kind (seconds, every micro-batch of the window)."""

    gemm_s: float
    attention_s: float
    memory_s: float
    recompute_s: float  # of the above, the checkpointed layers' second forward
    forward_s: float = 0.0  # of the above, the forward of one micro-batch (the executor's overlap needs it)
    layer_forward_s: float = 0.0  # one decoder layer's forward of one micro-batch (a recompute is another)
    layer_backward_s: float = 0.0  # and its backward

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.memory_s


def _gemms(model: ModelSpec, tokens: int) -> list:
    """A layer's forward GEMMs (m, n, k) for ``tokens`` tokens (dense LLaMA/GPT-2 shapes; an MoE layer's active
    experts as one MLP of their width)."""
    h, q, kv = model.hidden, model.q_dim, model.kv_dim
    i = model.intermediate * max(1, model.experts_per_token) + model.shared_intermediate
    mlp = [(tokens, i, h), (tokens, i, h), (tokens, h, i)] if model.arch == "llama" else [(tokens, i, h), (tokens, h, i)]
    return [(tokens, q, h), (tokens, kv, h), (tokens, kv, h), (tokens, h, q)] + mlp


def _fwd_bwd(table: ComputeTable, shapes: list) -> tuple:
    both = [table.linear_s(m, n, k) for m, n, k in shapes]
    return sum(f for f, _ in both), sum(b for _, b in both)


def _arch(model: ModelSpec) -> str:
    return model.arch if model.arch in ELEMENTWISE_BYTES else "llama"


def _layer_bytes(model: ModelSpec, way: str) -> float:
    """Bytes per token of one layer's memory-bound kernels, ``way`` "forward" or "backward" (an MoE layer's active
    experts as one MLP of their width, as in ``_gemms``)."""
    i = model.intermediate * max(1, model.experts_per_token) + model.shared_intermediate
    c = ELEMENTWISE_BYTES[_arch(model)][way]
    qk = c.get("qk_norm", 0) * (model.q_dim + model.kv_dim) if model.qk_norm else 0
    wide = c.get("q", 0) * (model.q_dim - model.hidden)  # 0 where heads x head_dim = hidden (LLaMA, GPT-2)
    total = c["hidden"] * model.hidden + c["intermediate"] * i + c["kv"] * model.kv_dim + wide + qk
    if model.fused_projections:
        f = FUSED_BYTES[way]
        total += f["hidden"] * model.hidden + f["intermediate"] * i + f["kv"] * model.kv_dim
    return total


def step_compute(model: ModelSpec, train: TrainingSpec, table: ComputeTable, ckpt_units: int = 0) -> StepCompute:
    """Forward and backward of every micro-batch of one optimizer step, with ``ckpt_units`` layers recomputed."""
    tokens = train.micro_batch_size * train.seq_len
    head_dim = model.head_dim or model.hidden // model.heads
    fwd, bwd = _fwd_bwd(table, _gemms(model, tokens))
    attn_flops = 2.0 * train.micro_batch_size * model.heads * train.seq_len ** 2 * head_dim  # causal forward
    attn_fwd = attn_flops / (table.attention_tflops(train.seq_len, head_dim) * 1e12)
    per_byte = tokens / (table.bandwidth_gbs * 1e9)
    mem_fwd, mem_bwd = (per_byte * _layer_bytes(model, way) for way in ("forward", "backward"))
    layer_fwd = fwd + attn_fwd + mem_fwd
    head_fwd, head_bwd = _fwd_bwd(table, [(tokens, model.vocab, model.hidden)])
    head = HEAD_BYTES[_arch(model)]
    head_mem = [per_byte * (head["hidden"][w] * model.hidden + head["logit"][w] * model.vocab) for w in (0, 1)]
    L, k = model.num_layers, min(ckpt_units, model.num_layers)
    gemm = L * (fwd + bwd) + k * fwd + head_fwd + head_bwd
    attention = (L * 3 + k) * attn_fwd
    memory = (L + k) * mem_fwd + L * mem_bwd + sum(head_mem)
    g = train.grad_accum
    forward = L * layer_fwd + head_fwd + head_mem[0]
    layer_bwd = bwd + 2 * attn_fwd + mem_bwd
    return StepCompute(g * gemm, g * attention, g * memory, g * k * layer_fwd, forward, layer_fwd, layer_bwd)
