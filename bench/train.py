"""The benchmark's training run: ``examples/train_llama.py`` with what a measurement needs (``python -m bench run``
and ``memory`` launch it; run it yourself from the repository root):

    torchrun --nproc_per_node 2 -m bench.train --deepspeed_config ds_configs/lins.json --model 1b \
        --micro-batch-size 2 --grad-accum 2 --steps 10 --out run.json [--gpus-per-node 1]

Beyond the example: overrides of the config (micro-batch, accumulation, Lins' budget, plan, checkpointing),
emulated nodes (``--gpus-per-node``: NCCL_HOSTID per virtual node, node-sized settings of every mode), the
host's speed before the engine exists, the median step after warm-up, memory by phase of the first step and
at start-up, an optional torch.profiler summary, and a JSON summary of it all (``--out``, rank 0). ZeRO-3,
ZeRO++ and MiCS build the model under their own init context, Lins under ``lins_ds.init``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

import lins_ds  # noqa: F401  (routes deepspeed.initialize to LinsEngine for configs with a "lins" block)
from lins_ds.plan import load_model
from lins_ds.tools.llama import llama_config, progressions

from .baselines import emulate_nodes, hf_initialise, model_init_context
from .host import seconds_per_module
from .host_memory import HostMemory

H200_BF16_TFLOPS = 989.0


def parse_args(argv=None) -> argparse.Namespace:
    import deepspeed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a planner built-in (tiny, 1b, 7b, 13b, 30b, 65b) or a "
                   "config.json (LLaMA, or any model type the planner models: built as its own Hugging Face class)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--attn", choices=["sdpa", "eager"], help="the attention implementation of a config.json model "
                   "(default: SDPA, eager for the types transformers runs no other way, e.g. gemma2)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=3, help="steps left out of the timing summary")
    p.add_argument("--gpus-per-node", type=int, help="emulate nodes of this many GPUs on one host")
    p.add_argument("--micro-batch-size", type=int, help="override train_micro_batch_size_per_gpu")
    p.add_argument("--grad-accum", type=int, help="override gradient_accumulation_steps")
    p.add_argument("--lins-memory-gb", type=float, help="override lins.gpu_memory_gb (the solver's budget)")
    p.add_argument("--lins-plan", help="override lins.plan with JSON, e.g. '{\"p\": [2, 1], \"g\": [2, 1], \"os\": [2, 1]}'")
    p.add_argument("--lins-checkpointing", help="override lins.activation_checkpointing: true, false or a number of units")
    p.add_argument("--lins-init", choices=["eager", "per_module"], help="override lins.init")
    p.add_argument("--lins-offload", help="override lins.offload with JSON: '\"auto\"', 'false', '{\"os\": \"cpu\"}'")
    p.add_argument("--lins-tune", help="override lins.tune with JSON, e.g. '{\"candidates\": 4, \"steps\": 3}'")
    p.add_argument("--lins-profile-cache", help="override lins.profile_cache (where profiles and tuning decisions live)")
    p.add_argument("--checkpointing", action="store_true",
                   help="Hugging Face gradient checkpointing on every layer (any mode; Lins keeps it as found)")
    p.add_argument("--trace-summary", help="write a torch.profiler summary of two steps after warm-up here")
    p.add_argument("--gpu-cap-gb", type=float, help="emulate a smaller GPU: the caching allocator may hold at most "
                   "this many GiB (torch.cuda.set_per_process_memory_fraction); beyond it, it frees its cache, then fails")
    p.add_argument("--breakdown", action="store_true", help="time forward, backward and step apart (the GPU "
                   "synchronized at each boundary): medians per step in the summary's \"breakdown_s\"")
    p.add_argument("--hold-outputs", action="store_true", help="keep the model's outputs (the logits) until the "
                   "backward is done, as `outputs = model(**batch); loss = outputs.loss; backward(loss)` loops do")
    p.add_argument("--ds-set", action="append", default=[], metavar="KEY=JSON",
                   help="set a key of the DeepSpeed config, dotted, e.g. zero_optimization.offload_optimizer.ratio=0.5")
    p.add_argument("--lins-seq-len", default="from --seq-len", help="lins.seq_len as JSON: 'null' leaves it unset "
                   "(the training batches size the plan, as a config from the hub would); default: --seq-len")
    p.add_argument("--read-after-step", action="store_true", help="after every step read every parameter as an EMA "
                   "does (model.parameters(), at once), then after engine.lins.wait(), and record both sums; a "
                   "partitioned parameter is read inside GatheredParameters, one at a time")
    p.add_argument("--plain", action="store_true", help="no engine: a plain PyTorch loop (bench/plain.py) with the "
                   "config's batch, accumulation, clipping and AdamW; one process, a config without a lins block")
    p.add_argument("--alst", action="store_true", help="DeepSpeed's ALST single-GPU recipe (bench/alst.py): TiledMLP, "
                   "the tiled logits+loss, checkpointing on every layer and its inputs offloaded to the host; with "
                   "ds_configs/alst_offload.json (ZeRO-3, parameters and optimizer on the host)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", help="write a JSON summary here (rank 0)")
    p.add_argument("--local_rank", type=int, default=-1)
    deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    if not args.deepspeed_config:
        p.error("--deepspeed_config is required")
    args.checkpointing = args.checkpointing or args.alst  # ALST checkpoints every layer
    for item in args.ds_set:
        key, eq, value = item.partition("=")
        try:
            json.loads(value)
        except ValueError:
            eq = ""
        if not key or not eq:
            p.error(f"--ds-set {item!r}: expected KEY=JSON, e.g. zero_optimization.offload_optimizer.ratio=0.5 "
                    "or offload_optimizer.device='\"cpu\"'")
    return args


def ds_config_for(args: argparse.Namespace) -> dict:
    """The DeepSpeed config file with this run's overrides applied."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    cfg = load_ds_config(args.deepspeed_config)
    for item in args.ds_set:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = cfg
        for name in parents:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise SystemExit(f"--ds-set {item!r}: {name} is {node!r} in {args.deepspeed_config}, not a section")
        node[leaf] = json.loads(value)
    for key, value in (("train_micro_batch_size_per_gpu", args.micro_batch_size),
                       ("gradient_accumulation_steps", args.grad_accum)):
        if value:
            cfg[key] = value
            cfg.pop("train_batch_size", None)
    if isinstance(cfg.get("lins"), dict):
        seq = args.seq_len if args.lins_seq_len == "from --seq-len" else json.loads(args.lins_seq_len)
        cfg["lins"].setdefault("seq_len", seq)  # what the solver sizes activations for (None: the batches decide)
        if cfg["lins"]["seq_len"] is None:
            del cfg["lins"]["seq_len"]
        keep, parse = (lambda v: v), json.loads
        overrides = (("gpu_memory_gb", args.lins_memory_gb, keep), ("plan", args.lins_plan, parse),
                     ("activation_checkpointing", args.lins_checkpointing, parse), ("init", args.lins_init, keep),
                     ("offload", args.lins_offload, parse), ("tune", args.lins_tune, parse),
                     ("profile_cache", args.lins_profile_cache, keep))
        cfg["lins"] = {**cfg["lins"], **{key: read(value) for key, value, read in overrides if value}}
    return emulate_nodes(cfg, args.gpus_per_node) if args.gpus_per_node else cfg


def setup_device() -> torch.device:
    import deepspeed

    deepspeed.init_distributed()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_model(name: str, seq_len: int, attn: str = None):
    """A LLaMA built-in or LLaMA ``config.json`` as ``LlamaForCausalLM`` with the planner's shapes (as every run of
    the shape grid was built); any other ``config.json`` as its own Hugging Face class (``model_type``: GPT-2, Qwen,
    Mistral, ...), SDPA attention unless ``attn`` says otherwise or the type has only eager attention (gemma2)."""
    import transformers

    from lins_ds.plan.model import EAGER_ONLY

    spec = load_model(name)
    cfg = None
    if os.path.exists(name):
        with open(os.path.join(name, "config.json") if os.path.isdir(name) else name, encoding="utf-8") as f:
            cfg = json.load(f)
    if cfg is None or cfg.get("model_type", "llama") == "llama":
        return transformers.LlamaForCausalLM(llama_config(name, seq_len))
    if spec.max_positions and spec.max_positions < seq_len:
        raise SystemExit(f"--seq-len {seq_len}: {name} learns {spec.max_positions} positions (n_positions); "
                         f"give a sequence no longer")
    cfg = {k: v for k, v in cfg.items() if k != "architectures"}
    mtype = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(mtype, **cfg)
    attn = attn or ("eager" if mtype in EAGER_ONLY else "sdpa")
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def build_engine(args, ds_config: dict, device: torch.device):
    """The model built the way its mode wants (ZeRO-3 and Lins: sharded as it is built), then the engine."""
    import deepspeed

    if args.plain and ("lins" in ds_config or (ds_config.get("zero_optimization") or {}).get("stage", 0)):
        raise SystemExit(f"--plain: {args.deepspeed_config} has a lins block or a ZeRO stage; the plain loop takes a "
                         "config without either (ds_configs/zero0.json)")
    if args.alst:
        from . import alst  # before the model is built: see its imports
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with model_init_context(ds_config, device):
        model = build_model(args.model, args.seq_len, args.attn)
    hf_initialise(model, ds_config)
    if args.checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24 deprecates the older name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.alst:
        alst.patch(model)  # the loss is computed in the forward, tiled: engine(...).loss as for every part
    if args.plain:
        from .plain import PlainLoop

        return PlainLoop(model, ds_config, device), model, time.perf_counter() - t0
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine, model, time.perf_counter() - t0


class Memory:
    """Allocated / peak GiB at the phases of the first step (CUDA), to account for where memory goes."""

    def __init__(self, cuda: bool):
        self.cuda, self.phases = cuda, []

    def mark(self, phase: str) -> None:
        if self.cuda:
            self.phases.append({"phase": phase, "allocated_gb": torch.cuda.memory_allocated() / 2**30,
                                "peak_gb": torch.cuda.max_memory_allocated() / 2**30})


def train(args, engine, model, device) -> tuple:
    """Per step: the mean loss over every rank's micro-batches, the wall time and the wall clock at its end (to line
    the steps up with a GPU clock log); memory by phase of step 1; the breakdown's medians."""
    from deepspeed import comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    data = progressions(model.config.vocab_size, args.seq_len, engine.train_micro_batch_size_per_gpu(),
                        args.seed + rank, device)
    gas = engine.gradient_accumulation_steps()
    losses, times, ends, breakdown, tracer, memory = [], [], [], [], trace(args, rank, cuda), Memory(cuda)
    reads, host_steps = [], []
    memory.mark("after deepspeed.initialize")
    if args.alst:
        from .alst import offload
    step_context = offload(model) if args.alst else contextlib.nullcontext()  # around every forward+backward
    for step in range(args.steps):
        if tracer is not None and step == args.warmup_steps:
            tracer.__enter__()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        clock = Phases(args.breakdown and cuda)
        for micro in range(gas):
            x = next(data)
            with step_context:
                out = engine(input_ids=x, labels=x)
                loss = out.loss
                if not args.hold_outputs:  # HF Trainer's loop: the logits go before the backward
                    del out
                clock.lap("forward")
                memory.mark(f"forward {micro}") if step == 0 else None
                engine.backward(loss)
                out = None
            clock.lap("backward")
            memory.mark(f"backward {micro}") if step == 0 else None
            engine.step()
            clock.lap("step")
            memory.mark(f"step {micro}") if step == 0 else None
            total += loss.detach().float() / gas
        if args.read_after_step:
            reads.append(read_after_step(engine))
        breakdown.append(clock.seconds)
        dist.all_reduce(total)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        ends.append(time.time())
        losses.append(total.item() / world)
        host_steps.append(host_step(engine, host_steps))
        if rank == 0 and args.alst and step == 0:
            print(f"alst: {alst_report(model)}", flush=True)
        if rank == 0:
            print(f"step {step + 1:4d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:8.1f} ms"
                  + (f"  host waited {host_steps[-1]['waited_s']:.3f} s" if host_steps[-1] else ""), flush=True)
        if tracer is not None and step == args.warmup_steps + 1:
            tracer.__exit__(None, None, None)
            write_trace_summary(tracer, args.trace_summary, cuda)
            tracer = None
    timed = breakdown[args.warmup_steps:] or breakdown
    medians = {k: statistics.median(b[k] for b in timed) for k in timed[0]} if timed and timed[0] else None
    train.reads, train.host_steps = reads, host_steps
    return losses, (times, ends), memory.phases, medians


def read_after_step(engine) -> dict:
    """Right after step(): every parameter summed (fp64) as an EMA reads it, through model.parameters(); then, after
    engine.lins.wait(), the same tensors summed again without going through the module. Parameters a plan partitions
    are read one at a time inside GatheredParameters (what code written for ZeRO-3 does)."""
    import deepspeed

    def total(params, gathered) -> float:
        s = torch.zeros((), dtype=torch.float64, device=engine.device)
        for p in params:
            if gathered and hasattr(p, "ds_id"):
                with deepspeed.zero.GatheredParameters([p]):
                    s += p.detach().double().sum()
            else:
                s += p.detach().double().sum()
        return s.item()

    t0 = time.perf_counter()
    params = list(engine.module.parameters())  # the read itself: what an EMA's step(model.parameters()) does
    empty = sum(1 for p in params if p.numel() == 0)
    first = total(params, True)
    lins = getattr(engine, "lins", None)
    if lins is not None:
        lins.wait()
    return {"read": first, "after_wait": total(params, True), "empty_outside_forward": empty,
            "read_s": time.perf_counter() - t0}


class Phases:
    """Seconds per phase of one step (summed over its micro-batches), the GPU synchronized at each boundary; a
    no-op unless ``on``."""

    def __init__(self, on: bool):
        self.on, self.seconds = on, {}
        if on:
            torch.cuda.synchronize()
            self.t = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.on:
            torch.cuda.synchronize()
            now = time.perf_counter()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.t
            self.t = now


def trace(args, rank: int, cuda: bool):
    if not args.trace_summary or rank != 0 or args.steps < args.warmup_steps + 2:
        return None
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    return torch.profiler.profile(activities=acts)


def write_trace_summary(prof, path: str, cuda: bool) -> None:
    """Top operators of two profiled steps by device (or CPU) time: where a step's time goes; then by the host's
    own time, where a launch- or hook-bound step spends it."""
    key = "cuda_time_total" if cuda else "cpu_time_total"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    averages = prof.key_averages()
    with open(path, "w") as f:
        f.write(averages.table(sort_by=key, row_limit=30))
        if cuda:
            f.write("\n\nBy the host's own time:\n" + averages.table(sort_by="self_cpu_time_total", row_limit=30))


def host_step(engine, before: list):
    """Lins with offload, after a step: what the training thread waited for the host in it (updates and gradient
    sums), and the worker's last finished update (seconds waiting for the gradients, updating, uploading)."""
    rt = getattr(engine, "lins", None)
    stats = rt.host_stats() if rt is not None else None
    if stats is None:
        return None
    total, built = stats["waited_s"], stats["instance"]  # since this offload was built (a re-layout builds anew)
    last = next((s for s in reversed(before) if s), None)
    waited = total - last["waited_total_s"] if last is not None and last["offload"] == built else total
    return {"waited_s": waited, "waited_total_s": total, "offload": built, "worker_s": stats["worker_s"],
            "worker_spent_s": stats["worker_spent_s"], "worker_timeline": stats.get("worker_timeline", {})}


def offload_summary(engine, steps: int):
    """Lins with offload: host memory held, and per step the host worker's time and what the forward waited."""
    rt = getattr(engine, "lins", None)
    stats = rt.host_stats() if rt is not None else None
    if stats is None:
        return None
    return {"host_gb": rt.host_gb(), "predicted_host_gb": rt.plan.host_gb,
            **rt.plan.placement.legacy_json(), "units": len(rt.unit_sizes()),
            "host_optimizer": stats["host_optimizer"], "worker_s_last_step": stats["worker_s"],
            "waited_s_per_step": stats["updates_waited_s"] / max(1, steps),
            "grads_waited_s_per_step": stats["grads_waited_s"] / max(1, steps)}


def activation_offload_summary(engine):
    """Lins with activation offload: the layers offloaded, the host memory their inputs hold, what came back ahead."""
    rt = getattr(engine, "lins", None)
    stats = rt.activation_offload_stats() if rt is not None else None
    if stats is None:
        return None
    return {"units": rt.plan.activation_offload_units, "predicted_host_gb": rt.plan.host_gb,
            "pool_gb": stats.pool_bytes / 2**30, "offloaded": stats.offloaded, "prefetched": stats.prefetched,
            "on_demand": stats.on_demand}


def summarize(args, engine, losses, times, phases, startup: dict, cuda: bool) -> dict:
    from deepspeed import comm as dist

    timed = times[args.warmup_steps:] or times
    step_s = statistics.median(timed)
    samples = engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps()
    tokens_per_gpu_s = samples * args.seq_len / step_s
    flops = load_model(args.model).flops_per_token(args.seq_len)
    lins = getattr(engine, "lins", None)
    return {
        "config": os.path.basename(str(args.deepspeed_config)), "model": args.model,
        "world_size": dist.get_world_size(), "gpus_per_node": args.gpus_per_node, "seq_len": args.seq_len,
        "samples_per_gpu_per_step": samples, "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
        "grad_accum": engine.gradient_accumulation_steps(), "steps": args.steps, "warmup_steps": args.warmup_steps,
        "median_step_s": step_s,
        "hf_checkpointing": bool(args.checkpointing),  # --checkpointing: every layer recomputed (any mode)
        "tokens_per_gpu_s": tokens_per_gpu_s, **startup,
        "mfu": tokens_per_gpu_s * flops / (H200_BF16_TFLOPS * 1e12) if cuda else None,
        # training only (the statistics are reset after start-up); the worst rank's
        "peak_memory_gb": max_over_ranks(torch.cuda.max_memory_allocated() / 2**30) if cuda else None,
        "peak_reserved_gb": max_over_ranks(torch.cuda.max_memory_reserved() / 2**30) if cuda else None,
        "memory_phases": phases,
        # how often the caching allocator went to the device (a cap it met frees its cache and synchronises: slow)
        "allocator_events": {k: torch.cuda.memory_stats().get(k) for k in ("num_alloc_retries", "num_sync_all_streams",
                             "num_device_alloc", "num_device_free", "num_ooms")} if cuda else None,
        "losses": losses, "step_times_s": times,
        "plan": lins.plan.to_json() if lins is not None else None,
        "offload": offload_summary(engine, len(times)),
        "activation_offload": activation_offload_summary(engine),
        "tune": getattr(engine, "lins_tune_report", None),  # "plan": "tune": every candidate, predicted and measured
        "reads_after_step": getattr(train, "reads", None) or None,  # --read-after-step
        "host_steps": getattr(train, "host_steps", None) if any(getattr(train, "host_steps", None) or []) else None,
        "planned_seq_len": lins_seq(engine),
        "alst": alst_report(engine.module) if args.alst else None,
    }


def alst_report(model):
    from .alst import report

    return report(model)


def lins_seq(engine):
    ctx = getattr(engine, "_lins_solve", None)
    return ctx.train.seq_len if ctx is not None else None


def max_over_ranks(x: float, cuda: bool = True) -> float:
    from deepspeed import comm as dist

    t = torch.tensor([x], dtype=torch.float64, device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def startup_memory(startup_s: float, cuda: bool) -> dict:
    """Start-up wall time and peaks (GPU, and host RSS of this rank); the GPU statistics are reset after."""
    import resource

    out = {"startup_s": startup_s, "startup_host_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if cuda:
        out["startup_peak_gb"] = max_over_ranks(torch.cuda.max_memory_allocated() / 2**30)
        torch.cuda.reset_peak_memory_stats()
    return out


def main(argv=None) -> dict:
    from deepspeed import comm as dist

    args = parse_args(argv)
    ds_config = ds_config_for(args)
    device = setup_device()
    if args.gpu_cap_gb and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_gb / total), device)
    # the host's speed (bench/host.py), every rank at once, before the model and the engine exist: what
    # the process does later (the engine's hooks, its objects for the garbage collector) is the step's own cost
    host_s = max_over_ranks(seconds_per_module(device), device.type == "cuda")  # the slowest rank's
    host_memory = HostMemory()
    engine, model, startup_s = build_engine(args, ds_config, device)
    startup = startup_memory(startup_s, device.type == "cuda")
    losses, (times, ends), phases, breakdown = train(args, engine, model, device)
    summary = summarize(args, engine, losses, times, phases, startup, device.type == "cuda")
    summary.update(host_s_per_module=host_s, gpu_cap_gb=args.gpu_cap_gb, lins_memory_gb=args.lins_memory_gb, breakdown_s=breakdown, step_end_unix=ends,
                   host_memory=host_memory.stop())  # the machine's: every rank of this node in it
    if dist.get_rank() == 0 and summary["host_memory"]:
        print("host memory used: {before_gb:.2f} GiB before the engine, peak {peak_gb:.2f}, rise {rise_gb:.2f}"
              .format(**summary["host_memory"]) + (f"; breakdown per step {breakdown}" if breakdown else ""))
    if dist.get_rank() == 0 and args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    engine.destroy()
    # torch asks every process to end with this: a gloo group left to interpreter exit can abort the process
    # after the run has finished (pytorch/pytorch#179291; 5 of 40 two-rank runs of a minimal CPU script)
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
