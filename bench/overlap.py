"""What a kernel running beside the training step costs it, on one GPU (``python -m bench overlap``).

The 2-GPU Lins runs pay 0.88 of the time of the communication the executor overlaps with compute
(``overlap_factor``, bench/results/simulate/shapes/README.md). Two causes would do that: the overlapped kernels
slowing each other (NCCL's kernels hold SMs and move data through HBM beside the GEMMs), or the overlap falling short.
One GPU cannot run NCCL between two ranks, but it can run the first cause's stand-in: a copy kernel that holds a
fixed number of SMs (NCCL runs one CTA per channel) on a side stream, beside the forward and backward of a LLaMA
model, as the executor's boundary AllReduce runs beside the backward. Each stand-in is timed alone, the step alone,
and the two together; the share of the stand-in's time the step still pays is

    (together - step alone) / stand-in alone        0: hidden, 1: as if run one after the other

Stand-ins: a persistent Triton copy kernel with 8, 16 and 32 CTAs of 16 warps (NCCL's channel count on NVLink
lies in that range), and ``Tensor.copy_`` (a device-to-device memcpy, as fast as the GPU copies). Each copies as many bytes as take it about
``--side-share`` of the step alone.
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
    p.add_argument("--side-share", type=float, default=0.4, help="the stand-in's time alone over the step's (the "
                   "7B boundary AllReduce is 45 ms beside a 120 ms backward)")
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


def _timed(torch, streams_work) -> float:
    """Seconds from a common start to the last of ``streams_work``'s ends: (stream, callable) pairs."""
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    ends = []
    for stream, work in streams_work:
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            work()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        ends.append(end)
    torch.cuda.synchronize()
    return max(start.elapsed_time(e) for e in ends) / 1e3


def _median(torch, streams_work, repeats: int) -> float:
    _timed(torch, streams_work)  # warm-up
    return statistics.median(_timed(torch, streams_work) for _ in range(repeats))


def main(args) -> int:
    import torch
    import transformers

    from lins_ds.tools.llama import llama_config

    if not torch.cuda.is_available():
        raise SystemExit("python -m bench overlap: needs a CUDA GPU (it times kernels on two streams)")
    device = torch.device("cuda")
    model = transformers.LlamaForCausalLM(llama_config(args.model, args.seq_len)).to(device, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (args.micro_batch_size, args.seq_len), device=device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=False)

    main_stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
    step_s = _median(torch, [(main_stream, step)], args.repeats)
    try:
        kernel = _copy_kernel()
    except ImportError:
        kernel = None
    rows = []
    for ctas in CTAS + (None,):
        if ctas is not None and kernel is None:
            continue
        total = 1 << 26  # elements to copy: 128 MiB of bf16 first, then scaled to the wanted time
        for _ in range(2):
            numel, times = min(total, BUFFER), -(-total // BUFFER)  # a long copy repeats over one buffer
            src = torch.empty(numel, dtype=torch.bfloat16, device=device)
            dst = torch.empty_like(src)

            def copy(src=src, dst=dst, ctas=ctas, n=numel, times=times):
                for _ in range(times):
                    if ctas is None:
                        dst.copy_(src)
                    else:
                        kernel[(ctas,)](src, dst, n, BLOCK=4096, num_warps=16)

            side_s = _median(torch, [(side, copy)], args.repeats)
            moved = 2 * numel * times  # bytes copied
            total = max(1 << 20, int(numel * times * args.side_share * step_s / side_s))
        together_s = _median(torch, [(side, copy), (main_stream, step)], args.repeats)
        rows.append({"side": f"Triton copy, {ctas} CTAs" if ctas else "Tensor.copy_", "bytes": moved,
                     "side_s": side_s, "side_gb_s": 2 * moved / side_s / 1e9, "step_s": step_s,
                     "together_s": together_s, "paid_share": paid_share(step_s, side_s, together_s)})
        del src, dst
    print(f"{torch.cuda.get_device_name()}: {args.model}, seq {args.seq_len}, micro-batch {args.micro_batch_size}, "
          f"forward + backward alone {1e3 * step_s:.1f} ms (median of {args.repeats})")
    print(f"{'beside the step':<28}{'GB':>7}{'alone ms':>10}{'GB/s':>8}{'together ms':>13}{'share paid':>12}")
    for r in rows:
        print(f"{r['side']:<28}{r['bytes'] / 1e9:>7.2f}{1e3 * r['side_s']:>10.1f}{r['side_gb_s']:>8.0f}"
              f"{1e3 * r['together_s']:>13.1f}{r['paid_share']:>12.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model": args.model, "seq_len": args.seq_len,
                       "micro_batch_size": args.micro_batch_size, "rows": rows}, f, indent=1)
    return 0
