"""What a kernel running beside the training step costs it, on one GPU (``python -m bench overlap``).

The 2-GPU Lins runs are fitted with 0.88-1.18 of the time of the boundary AllReduce and P-sync the executor hides
behind compute (``overlap_factor``, bench/results/simulate/shapes/README.md). If the overlap costs that much, two causes
would do it: the overlapped kernels slowing each other (NCCL's kernels hold SMs and move data through HBM beside the
GEMMs), or the overlap falling short. One GPU cannot run NCCL between two ranks, but it can run a stand-in for the
first: a copy kernel that holds a fixed number of SMs (NCCL runs one CTA per channel) on a side stream, launched
as the backward of a LLaMA model starts, as the executor's boundary AllReduce runs beside the backward. Each
stand-in is timed alone, and the step alone and with it (alternately, so that the GPU's clock drifts into both
alike); the share of the stand-in's time the step still pays is

    (with it - step alone) / stand-in alone        0: hidden, 1: as if run one after the other

Stand-ins: a persistent Triton copy kernel with 8, 16 and 32 CTAs of 16 warps (NCCL's channel count on NVLink
lies in that range), and ``Tensor.copy_`` (a device-to-device memcpy, as fast as the GPU copies). Each copies as
many bytes as take it ``--side-share`` of the step alone (0.25: the 7B's boundary AllReduce on 2 H200s, 45 ms, over
its forward and backward of one micro-batch, about 180 ms).
"""

from __future__ import annotations

import argparse
import json
import statistics

CTAS = (8, 16, 32)
BUFFER = 1 << 30  # elements (2 GiB of bf16) a copy runs over, repeated where it must last longer


def paid_share(step_s: float, side_s: float, together_s: float) -> float:
    """The share of the side kernel's time that the step still pays when the two run together."""
    return (together_s - step_s) / side_s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bench/models/llama-7b-width-8-layers.json")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--side-share", type=float, default=0.25, help="the stand-in's time alone over the step's (the "
                   "7B's boundary AllReduce on 2 H200s, 45 ms, over its forward and backward, about 180 ms)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="write the table as JSON here")


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        pid, programs = tl.program_id(0), tl.num_programs(0)
        for start in range(pid * BLOCK, n, programs * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return copy


def _step(torch, model, ids, side=None, copy=None) -> float:
    """Seconds of one forward and backward, with ``copy`` (if given) launched on ``side`` as the backward starts:
    from the start to the later of the two ends."""
    start, ends = torch.cuda.Event(enable_timing=True), []
    start.record()
    loss = model(input_ids=ids, labels=ids).loss
    if copy is not None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            copy()
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record()
    loss.backward()
    ends.append(torch.cuda.Event(enable_timing=True))
    ends[-1].record()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=False)
    return max(start.elapsed_time(e) for e in ends) / 1e3


def _alone(torch, copy, repeats: int) -> float:
    """Median seconds of ``copy`` on its own."""
    out = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return statistics.median(out[1:])


def main(args) -> int:
    import torch
    import transformers

    from lins_ds.tools.llama import llama_config

    if not torch.cuda.is_available():
        raise SystemExit("python -m bench overlap: needs a CUDA GPU (it times kernels on two streams)")
    device = torch.device("cuda")
    model = transformers.LlamaForCausalLM(llama_config(args.model, args.seq_len)).to(device, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (args.micro_batch_size, args.seq_len), device=device)
    side = torch.cuda.Stream()
    _step(torch, model, ids)  # warm-up
    step_s = statistics.median(_step(torch, model, ids) for _ in range(args.repeats))
    try:
        kernel = _copy_kernel()
    except ImportError:
        kernel = None
    rows = []
    for ctas in CTAS + (None,):
        if ctas is not None and kernel is None:
            continue
        total = 1 << 26  # elements to copy: 128 MiB of bf16 first, then scaled to the wanted time
        for _ in range(3):
            numel = min(total, BUFFER)
            times = max(1, round(total / numel))  # a long copy repeats over one buffer
            src = torch.empty(numel, dtype=torch.bfloat16, device=device)
            dst = torch.empty_like(src)

            def copy(src=src, dst=dst, ctas=ctas, n=numel, times=times):
                for _ in range(times):
                    if ctas is None:
                        dst.copy_(src)
                    else:
                        kernel[(ctas,)](src, dst, n, BLOCK=4096, num_warps=16)

            side_s = _alone(torch, copy, args.repeats)
            total = max(1 << 20, int(numel * times * args.side_share * step_s / side_s))
        alone, beside = [], []
        for _ in range(args.repeats):  # alternately: a drifting clock slows both alike
            alone.append(_step(torch, model, ids))
            beside.append(_step(torch, model, ids, side, copy))
        alone_s, beside_s = statistics.median(alone), statistics.median(beside)
        copied = 2 * numel * times  # bytes read once and written once
        rows.append({"side": f"Triton copy, {ctas} CTAs" if ctas else "Tensor.copy_", "bytes_copied": copied,
                     "side_s": side_s, "side_gb_s": 2 * copied / side_s / 1e9, "step_s": alone_s,
                     "together_s": beside_s, "paid_share": paid_share(alone_s, side_s, beside_s)})
        del src, dst, copy
    print(f"{torch.cuda.get_device_name()}: {args.model}, seq {args.seq_len}, micro-batch {args.micro_batch_size}, "
          f"forward + backward alone {1e3 * step_s:.1f} ms (median of {args.repeats}); each copy launched as the "
          f"backward starts")
    print(f"{'beside the backward':<26}{'GB copied':>10}{'alone ms':>10}{'GB/s r+w':>10}{'step ms':>9}"
          f"{'with it ms':>12}{'share paid':>12}")
    for r in rows:
        print(f"{r['side']:<26}{r['bytes_copied'] / 1e9:>10.2f}{1e3 * r['side_s']:>10.1f}{r['side_gb_s']:>10.0f}"
              f"{1e3 * r['step_s']:>9.1f}{1e3 * r['together_s']:>12.1f}{r['paid_share']:>12.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model": args.model, "seq_len": args.seq_len,
                       "micro_batch_size": args.micro_batch_size, "side_share": args.side_share,
                       "launched": "as the backward starts", "rows": rows}, f, indent=1)
    return 0
