"""Train a LLaMA-shaped model on synthetic tokens under any DeepSpeed config: Lins or a baseline.

    deepspeed lins_ds/train_llama.py --deepspeed_config ds_configs/lins.json --model 1b --steps 30
    torchrun --nproc_per_node 2 -m lins_ds.train_llama --deepspeed_config ds_configs/zero1.json
    lins-ds demo      # 4 CPU processes as 2 nodes x 2, tiny LLaMA, the plan printed, loss falling

The tokens follow learnable arithmetic progressions (x_t = start + stride * t mod vocab), so the loss
falls within a few dozen steps. Rank 0 prints a line per step and, with --out, writes a JSON summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

import lins_ds  # noqa: F401  (routes deepspeed.initialize to LinsEngine for lins configs)

PRESETS = {  # LLaMA shapes: hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": (64, 4, 4, 4, 176, 512),
    "small": (256, 4, 8, 8, 688, 4096),
    "1b": (2048, 16, 16, 16, 5632, 32000),
    "7b": (4096, 32, 32, 32, 11008, 32000),
}
H200_BF16_TFLOPS = 989.0


def build_model(preset: str, seq_len: int):
    import transformers

    h, layers, heads, kv, inter, vocab = PRESETS[preset]
    cfg = transformers.LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                                   max_position_embeddings=max(seq_len, 128), attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def batches(vocab: int, seq_len: int, micro_batch: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(seq_len)
    while True:
        start = torch.randint(0, vocab, (micro_batch, 1), generator=g)
        stride = torch.randint(1, 8, (micro_batch, 1), generator=g)
        yield ((start + stride * t) % vocab).to(device)


def parse_args(argv=None):
    import deepspeed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=3, help="steps left out of the timing summary")
    p.add_argument("--gpus-per-node", type=int, help="emulate nodes of this many GPUs on one host")
    p.add_argument("--micro-batch-size", type=int, help="override train_micro_batch_size_per_gpu")
    p.add_argument("--grad-accum", type=int, help="override gradient_accumulation_steps")
    p.add_argument("--lins-memory-gb", type=float, help="override lins.gpu_memory_gb (the solver's budget)")
    p.add_argument("--trace-summary", help="write a torch.profiler summary of two steps after warm-up here")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", help="write a JSON summary here (rank 0)")
    p.add_argument("--local_rank", type=int, default=-1)
    deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


def load_config(path) -> dict:
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(path)


def main(argv=None) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    from .integrations.baselines import emulate_nodes, model_init_context, zero_stage

    args = parse_args(argv)
    if not args.deepspeed_config:
        raise SystemExit("train_llama: --deepspeed_config is required")
    ds_config = load_config(args.deepspeed_config)
    if args.micro_batch_size:
        ds_config["train_micro_batch_size_per_gpu"] = args.micro_batch_size
        ds_config.pop("train_batch_size", None)
    if args.grad_accum:
        ds_config["gradient_accumulation_steps"] = args.grad_accum
        ds_config.pop("train_batch_size", None)
    if args.lins_memory_gb and isinstance(ds_config.get("lins"), dict):
        ds_config["lins"] = {**ds_config["lins"], "gpu_memory_gb": args.lins_memory_gb}
    if args.gpus_per_node:
        ds_config = emulate_nodes(ds_config, args.gpus_per_node)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(args.seed)
    with model_init_context(ds_config), (device if zero_stage(ds_config) < 3 else contextlib.nullcontext()):
        model = build_model(args.model, args.seq_len)  # built on the device: fast, same values per seed
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    mb, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    data = batches(model.config.vocab_size, args.seq_len, mb, args.seed + rank, device)

    losses, times = [], []
    tracer = trace(args, rank, cuda)
    for step in range(args.steps):
        if tracer is not None and step == args.warmup_steps:
            tracer.__enter__()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for _ in range(gas):
            x = next(data)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / gas
        dist.all_reduce(total)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(total.item() / world)
        if rank == 0:
            print(f"step {step + 1:4d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:8.1f} ms", flush=True)
        if tracer is not None and step == args.warmup_steps + 1:
            tracer.__exit__(None, None, None)
            write_trace_summary(tracer, args.trace_summary, cuda)
            tracer = None

    summary = summarize(args, engine, model, losses, times, world, mb * gas, cuda)
    if rank == 0 and args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    engine.destroy()
    return summary


def trace(args, rank, cuda):
    if not args.trace_summary or rank != 0 or args.steps < args.warmup_steps + 2:
        return None
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    return torch.profiler.profile(activities=acts)


def write_trace_summary(prof, path: str, cuda: bool) -> None:
    """Top operators of two profiled steps by device (or CPU) time: where a step's time goes,
    NCCL kernels included, to explain a missed target from a measurement rather than a guess."""
    key = "cuda_time_total" if cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(table)


def summarize(args, engine, model, losses, times, world, samples_per_gpu, cuda) -> dict:
    from .plan.model import from_hf_config

    timed = times[args.warmup_steps:] or times
    step_s = statistics.median(timed)
    tokens_per_gpu_s = samples_per_gpu * args.seq_len / step_s
    flops = from_hf_config(model.config.to_dict(), args.model).flops_per_token(args.seq_len)
    lins = getattr(engine, "lins", None)
    return {
        "config": os.path.basename(str(args.deepspeed_config)), "model": args.model, "world_size": world,
        "gpus_per_node": args.gpus_per_node, "seq_len": args.seq_len, "samples_per_gpu_per_step": samples_per_gpu,
        "steps": args.steps, "median_step_s": step_s, "tokens_per_gpu_s": tokens_per_gpu_s,
        "mfu": tokens_per_gpu_s * flops / (H200_BF16_TFLOPS * 1e12) if cuda else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": losses, "step_times_s": times,
        "plan": lins.plan.to_json() if lins is not None else None,
    }


if __name__ == "__main__":
    main()
