"""What the GPU at hand computes, measured once per device type (issue 27): the table the shape compute model prices
a step with, cached beside the collective profiles.

- **GEMMs**: achieved TFLOP/s of ``(m x k) @ (k x n)`` in the training dtype over a grid of sizes spanning a
  transformer's projections (m: tokens of a micro-batch; n, k: hidden, intermediate and vocabulary widths), forward
  shapes and the two backward ones alike (a table over (m, n, k), read by log-interpolation).
- **Attention**: causal scaled-dot-product attention (the kernel ``torch.nn.functional.scaled_dot_product_attention``
  picks: flash on H100/H200) forward and backward, TFLOP/s by sequence length and head width.
- **Misaligned GEMMs**: the three GEMMs of a linear layer one of whose widths is not a multiple of 8 (GPT-2's LM head
  over a vocabulary of 50257; a LLaMA's with a pad token added, 32001; widths that are multiples of 2 or 4), each
  next to the same GEMM with that width rounded up, in the same run: cuBLAS falls back to kernels of a lower
  alignment there, several times slower.
- **Memory-bound work**: bytes/s of an element-wise kernel over a large tensor (norms, activations, residual adds,
  rotary embeddings and the optimizer are priced by the bytes they move).
- **Whole layers**: a few Hugging Face LLaMA decoder layers' forward and backward, timed as training queues them.
  The shape model prices each from the rest of the table; what the run took over that price is the table's
  **in-training factor** (kernels among other kernels: clocks, caches and launch gaps an isolated kernel does not
  see), which the shape model applies, measured, where it would otherwise be fitted.

Times are CUDA-event medians after warm-up; on a CPU the same code runs small sizes (tests), never a real table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Optional

import torch

from bench.compute_model import ALIGN, LAYER_KEYS, ROLES, ComputeTable, in_training_factor

FORMAT = "lins_ds.compute/1"
GEMM_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
ATTENTION_SEQS = (1024, 2048, 4096, 8192)
HEAD_DIMS = (64, 128)
# reference decoder layers (hidden, intermediate, heads, kv heads, sequence, micro-batch): 1B-, 3B- and 7B-like
# widths at 4096-8192 tokens, large enough that the GPU, not the host, sets their pace
LAYER_SHAPES = ((2048, 5632, 16, 16, 4096, 2), (2560, 6912, 20, 20, 4096, 1), (4096, 11008, 32, 32, 2048, 2))
# linear layers (tokens, out features, in features) with one width not a multiple of ``ALIGN``: LM heads over odd
# vocabularies, and two projections from an odd width; then LM heads and a projection of widths that are multiples
# of 2 or 4 but not of 8 (cuBLAS has kernels for each alignment)
MISALIGNED_SHAPES = ((8192, 50257, 1600), (16384, 50257, 2048), (8192, 32001, 4096), (8192, 4096, 11007),
                     (8192, 2048, 5633), (8192, 50258, 1600), (8192, 32002, 4096), (8192, 50260, 1600),
                     (8192, 32004, 4096), (8192, 2048, 5636))
GEMM_KERNELS = ("gemm", "nvjet", "cutlass", "xmma", "matmul")
ATTENTION_KERNELS = ("flash", "fmha", "sdpa", "attention", "attn")


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn, reps: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(reps):
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)
    else:
        def run(fn, reps: int) -> float:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
    return run


def gemm_table(device: torch.device, dtype: torch.dtype, sizes=GEMM_SIZES, reps: int = 5,
               max_flops: float = 2e13, inner: int = 1) -> list:
    """[{"m", "n", "k", "tflops"}] for every (m, n, k) of ``sizes`` whose FLOPs stay under ``max_flops``, each GEMM
    timed alone (``inner`` > 1: that many back to back between the events)."""
    timed = _timer(device)
    out = []
    for m in sizes:
        for k in sizes:
            for n in sizes:
                flops = 2.0 * m * n * k
                if flops > max_flops:
                    continue
                a = torch.randn(m, k, device=device, dtype=dtype)
                b = torch.randn(k, n, device=device, dtype=dtype)
                fn = lambda a=a, b=b: [torch.matmul(a, b) for _ in range(inner)]  # noqa: E731
                fn()
                s = timed(fn, reps) / inner
                out.append({"m": m, "n": n, "k": k, "tflops": flops / s / 1e12})
    return out


def _linear_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict:
    """The GEMMs of ``torch.nn.functional.linear(x, w)`` (``x``: tokens x in features, ``w``: out x in) with the
    output's gradient ``dy``, in the layouts autograd runs them: the forward, the input's gradient and the weight's."""
    return {"forward": lambda: x @ w.t(), "input_grad": lambda: dy @ w, "weight_grad": lambda: dy.t() @ x}


def _random_linear(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype) -> dict:
    """``_linear_gemms`` of random tensors: ``m`` tokens, ``k`` in and ``n`` out features."""
    return _linear_gemms(*(torch.randn(*shape, device=device, dtype=dtype) for shape in ((m, k), (n, k), (m, n))))


def misaligned_table(device: torch.device, dtype: torch.dtype, shapes=MISALIGNED_SHAPES, reps: int = 5) -> list:
    """[{"m", "n", "k", "role", "tflops", "aligned_tflops"}]: each GEMM of a linear layer of ``shapes`` (``m``
    tokens, ``n`` out and ``k`` in features, one of them not a multiple of ``ALIGN``) by ``role`` ("forward",
    "input_grad", "weight_grad"), next to the same GEMM with that width rounded up to a multiple of 64, timed in the
    same run. The shape model prices the measured rate (``ComputeTable.misaligned_tflops``); the twin's is kept to
    show the share, which the profiler prints."""
    timed = _timer(device)
    up = lambda x: x if x % ALIGN == 0 else -(-x // 64) * 64  # noqa: E731
    out = []
    for m, n, k in shapes:
        odd, even = _random_linear(m, n, k, device, dtype), _random_linear(m, up(n), up(k), device, dtype)
        for role in odd:
            rates = []
            for fn, (nn, kk) in ((odd[role], (n, k)), (even[role], (up(n), up(k)))):
                fn()
                rates.append(2.0 * m * nn * kk / timed(fn, reps) / 1e12)
            out.append({"m": m, "n": n, "k": k, "role": role, "tflops": rates[0], "aligned_tflops": rates[1]})
        odd = even = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def attention_table(device: torch.device, dtype: torch.dtype, seqs=ATTENTION_SEQS, head_dims=HEAD_DIMS,
                    tokens: int = 16384, reps: int = 5) -> list:
    """[{"seq", "head_dim", "tflops"}]: causal attention forward and backward over ``tokens`` tokens (batch x seq)
    of a 2048-wide layer's heads, at the FLOPs MFU counts: 2 x s^2 x d per head forward (the causal half of
    QK^T and PV), the backward twice that (flash's recompute not counted)."""
    timed = _timer(device)
    out = []
    for d in head_dims:
        heads = max(1, 2048 // d)  # a 2048-wide layer's heads
        for s in seqs:
            batch = max(1, tokens // s)
            q, k, v = (torch.randn(batch, heads, s, d, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            grad = torch.randn(batch, heads, s, d, device=device, dtype=dtype)

            def fn(q=q, k=k, v=v, grad=grad):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(grad)

            fn()
            secs = timed(fn, reps)
            flops = 3 * 2.0 * batch * heads * s * s * d  # fwd 4sd^2/2 (causal) x 3 (fwd + 2 x bwd)
            out.append({"seq": s, "head_dim": d, "tflops": flops / secs / 1e12})
    return out


def bandwidth_gbs(device: torch.device, dtype: torch.dtype, elems: int = 1 << 28, reps: int = 5) -> float:
    """Bytes per second of ``y = x * 2 + 1`` (read one, write one) over ``elems`` elements."""
    timed = _timer(device)
    x = torch.randn(elems, device=device, dtype=dtype)
    y = torch.empty_like(x)
    fn = lambda: torch.add(x, 1.0, alpha=2.0, out=y)  # noqa: E731
    fn()
    s = timed(fn, reps)
    return 2 * elems * x.element_size() / s / 1e9


def _decoder_layer(device: torch.device, dtype: torch.dtype, shape: tuple):
    """``run(n)``: one ``LlamaDecoderLayer`` of ``shape`` and its input, its forward and backward run ``n`` times back
    to back (gradients set to none first, as an optimizer step leaves them)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    h, i, heads, kv_heads, seq, mb = shape
    cfg = LlamaConfig(hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      num_hidden_layers=1, max_position_embeddings=max(seq, 4096), vocab_size=32000)
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0).to(device=device, dtype=dtype)
    x = torch.randn(mb, seq, h, device=device, dtype=dtype, requires_grad=True)
    with torch.no_grad():
        pos = LlamaRotaryEmbedding(cfg).to(device)(x, torch.arange(seq, device=device)[None])
    grad = torch.randn_like(x)

    def run(n: int) -> None:
        for _ in range(n):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            out = layer(x, position_embeddings=pos)
            (out[0] if isinstance(out, tuple) else out).backward(grad)
    return run


def kernel_split(device: torch.device, fn) -> dict:
    """Seconds of GPU kernels of one call of ``fn`` by kind (``gemm``, ``attention``, ``other``), from
    torch.profiler's kernel events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    split = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for e in prof.events():  # the kernels (and copies, memsets) as the device ran them; not the annotations
        if e.device_type != torch.autograd.DeviceType.CUDA or e.is_user_annotation:
            continue
        name = e.name.lower()
        kind = ("attention" if any(k in name for k in ATTENTION_KERNELS) else  # first: fmha_cutlass is attention
                "gemm" if any(k in name for k in GEMM_KERNELS) else "other")
        split[kind] += e.self_device_time_total / 1e6  # microseconds
    return split


def layer_table(device: torch.device, dtype: torch.dtype, shapes=LAYER_SHAPES, reps: int = 5, inner: int = 4,
                split: bool = False) -> list:
    """[{"hidden", "intermediate", "heads", "kv_heads", "seq", "micro_batch", "seconds"}]: one Hugging Face LLaMA
    decoder layer's forward and backward (eager, SDPA attention) per shape, ``inner`` times back to back between two
    events (the kernels queue as in training: no launch gap is timed), median of ``reps``; with ``split``, also its
    kernels' seconds by kind (``kernel_split``). Empty where transformers is not installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return []
    timed = _timer(device)
    out = []
    for shape in shapes:
        run = _decoder_layer(device, dtype, shape)
        run(2)
        row = dict(zip(LAYER_KEYS, shape))  # the table's layer fields, "seconds" added below
        row["seconds"] = timed(lambda run=run: run(inner), reps) / inner
        if split and device.type == "cuda":
            row["kernels_s"] = kernel_split(device, lambda run=run: run(1))
        out.append(row)
        run = None  # the layer's memory goes before the next one's
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def measure(device: torch.device, dtype: torch.dtype = torch.bfloat16, quick: bool = False) -> dict:
    """The whole table for ``device`` (``quick``: tiny sizes, for CPUs and tests)."""
    t0 = time.perf_counter()
    if quick:
        gemms = gemm_table(device, dtype, sizes=(32, 64), reps=2)
        attn = attention_table(device, dtype, seqs=(32, 64), head_dims=(16,), tokens=128, reps=2)
        bw = bandwidth_gbs(device, dtype, elems=1 << 16, reps=2)
        layers = layer_table(device, dtype, shapes=((64, 128, 4, 2, 32, 1),), reps=2, inner=1)
        odd = misaligned_table(device, dtype, shapes=((64, 33, 32), (64, 32, 33), (64, 36, 32)), reps=2)
    else:
        gemms, attn, bw = gemm_table(device, dtype), attention_table(device, dtype), bandwidth_gbs(device, dtype)
        layers, odd = layer_table(device, dtype), misaligned_table(device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"format": FORMAT, "device": name, "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
            "gemm": gemms, "attention": attn, "bandwidth_gbs": bw, "layers": layers, "misaligned": odd,
            "measured_s": time.perf_counter() - t0,
            "source": f"measured on {name}"}


def default_path(directory: str) -> str:
    """Where ``python -m bench profile --compute`` caches this device's table (beside the collective profiles)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return os.path.join(directory, "compute-" + "".join(c if c.isalnum() else "-" for c in name).lower() + ".json")


def save(table: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, path)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compute_profile", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="where to write the compute table (JSON)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    table = measure(device, quick=args.quick or device.type != "cuda")
    save(table, args.out)
    rates = [g["tflops"] for g in table["gemm"]]
    attn = ", ".join("%d: %.0f" % (a["seq"], a["tflops"]) for a in table["attention"])
    read = ComputeTable.from_json(table)
    factor = in_training_factor(read)
    layers = (f"{len(table['layers'])} whole layers at {factor:.3f} of their price (the in-training factor)"
              if table["layers"] else "no whole layers timed (transformers not installed)")
    odd = ", ".join("%s %.0f TFLOP/s (x%.2f)" % (role, statistics.median(r["tflops"] for r in rows),
                                                   statistics.median(r["tflops"] / r["aligned_tflops"] for r in rows))
                    for role in ROLES if (rows := [r for r in table["misaligned"] if r["role"] == role]))
    print(f"compute table of {table['device']}: {len(rates)} GEMMs ({min(rates):.0f}-{max(rates):.0f} TFLOP/s), "
          f"attention by seq {attn} TFLOP/s, {table['bandwidth_gbs']:.0f} GB/s, {layers}; "
          f"misaligned linear layers' GEMMs (x their aligned twins' rate): {odd or 'none measured'}; "
          f"{table['measured_s']:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
