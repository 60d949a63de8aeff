"""What the test modules share: ranks run as forked gloo processes, the tiny LLaMA and its data, the single-process
reference (computed once per session), DeepSpeed configs, subprocess launches."""

from __future__ import annotations

import functools
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD, GPUS_PER_NODE, GAS, MB, SEQ, STEPS = 4, 2, 2, 2, 8, 3
RUN_TIMEOUT_S = 600


# --- ranks ------------------------------------------------------------------------------------------------
def _worker(local_rank, fn, world_size, gpus_per_node, tmp, args):
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank % gpus_per_node),
                      LOCAL_WORLD_SIZE=str(gpus_per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=local_rank, world_size=world_size)
    try:
        result = fn(*args)
        with open(f"{tmp}/result.{local_rank}", "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(f"{tmp}/error.{local_rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        try:
            import deepspeed.comm as dscomm
            dscomm.destroy_process_group() if dscomm.is_initialized() else None
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn, world_size: int, *args, gpus_per_node: int = None, timeout: float = RUN_TIMEOUT_S):
    """``fn(*args)`` on ``world_size`` forked ranks (``gpus_per_node`` per emulated node); the results by rank.
    A rank that raises fails the call with every rank's traceback; ranks still running after ``timeout``
    seconds (a collective nobody answers) are killed and named."""
    gpus_per_node = gpus_per_node or world_size
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(fn, world_size, gpus_per_node, tmp, args), nprocs=world_size,
                                 start_method="fork", join=False)
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    hung = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    for p in ctx.processes:
                        p.kill()
                    raise RuntimeError(f"ranks {hung} still running after {timeout:.0f} s (a collective that "
                                       f"no other rank issued?)\n" + _errors(tmp))
        except mp.ProcessRaisedException as e:
            raise RuntimeError("a rank failed:\n" + (_errors(tmp) or str(e))) from e
        except mp.ProcessExitedException as e:
            raise RuntimeError(f"a rank died ({e}):\n" + _errors(tmp)) from e
        out = []
        for r in range(world_size):
            with open(f"{tmp}/result.{r}", "rb") as f:
                out.append(pickle.load(f))
        return out


def _errors(tmp: str) -> str:
    return "\n".join(open(f"{tmp}/{n}").read() for n in sorted(os.listdir(tmp)) if n.startswith("error."))


# --- processes launched as a user would ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_env(**extra) -> dict:
    """The environment of a CPU launch: no GPU, one thread a process, this checkout importable."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def launch(cmd: list, cwd=None, timeout: float = 600, **env) -> str:
    """Run ``cmd``; its output, stdout then stderr. Fails the test with the output's tail if it fails."""
    r = subprocess.run(cmd, env=cpu_env(**env), cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    return out


def torchrun(nproc: int = 2) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port())]


# --- the tiny LLaMA, its data, the single-process reference -----------------------------------------------------
def tiny_llama(vocab=96, tied=False, layers=2):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=64, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


def tiny_gpt2():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def freeze_some(model):
    model.model.embed_tokens.weight.requires_grad_(False)
    for p in model.model.layers[0].mlp.parameters():
        p.requires_grad_(False)
    return model


def checkpointed(make, reentrant: bool):
    def build():
        m = make()
        kwargs = {"use_reentrant": reentrant}
        if hasattr(m, "activation_checkpointing_enable"):  # transformers 5.24 deprecates the older name
            m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return m
    return build


MODELS = {  # name -> (builder, vocab): what the reference is keyed by
    "llama": (tiny_llama, 96),
    "llama-tied-97": (lambda: tiny_llama(vocab=97, tied=True), 97),
    "llama-frozen": (lambda: freeze_some(tiny_llama()), 96),
    "llama-ckpt": (checkpointed(tiny_llama, True), 96),
    "llama-ckpt-nonreentrant": (checkpointed(tiny_llama, False), 96),
    "gpt2-ckpt": (checkpointed(tiny_gpt2, True), 96),
}


def param_groups(model, lr=1e-3):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1, "lr": lr}, {"params": other, "weight_decay": 0.0, "lr": 2 * lr}]


def batch(step, micro, rank, vocab):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randint(0, vocab, (MB, SEQ), generator=g)


@functools.lru_cache(maxsize=None)
def reference(name: str) -> list:
    """Single process, AdamW on the global batch of ``WORLD`` ranks: the parameters after each step. Computed
    once per session, in the parent, before the ranks are forked (they inherit it)."""
    make, vocab = MODELS[name]
    model = make()
    opt = torch.optim.AdamW(param_groups(model))
    out = []
    for step in range(STEPS):
        for micro in range(GAS):
            for rank in range(WORLD):
                x = batch(step, micro, rank, vocab)
                (model(input_ids=x, labels=x).loss / (GAS * WORLD)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def config(lins=None, **extra) -> dict:
    """The tests' DeepSpeed config: micro-batch MB, GAS accumulation, clipping at 1, and ``lins`` when given."""
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 0}, "steps_per_print": 1000}
    if lins is not None:
        cfg["lins"] = {"gpus_per_node": GPUS_PER_NODE, **lins}
    cfg.update(extra)
    return cfg


def train(engine, vocab=96, steps=STEPS, after_step=None) -> list:
    """``steps`` optimizer steps of GAS micro-batches of this rank's data; ``after_step(engine)`` after each."""
    rank = torch.distributed.get_rank()
    out = []
    for step in range(steps):
        for micro in range(GAS):
            x = batch(step, micro, rank, vocab)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        out.append(after_step(engine) if after_step else None)
    return out


def micro_losses(engine, first: int, count: int, vocab=96) -> list:
    """Optimizer steps ``first`` .. ``first + count - 1`` of GAS micro-batches of this rank's data: every loss."""
    rank, losses = torch.distributed.get_rank(), []
    for step in range(first, first + count):
        for micro in range(GAS):
            x = batch(step, micro, rank, vocab)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def bad_config(lins, extra) -> str:
    """``deepspeed.initialize`` of the tiny LLaMA with a ``lins`` block: what it raised (``Type: message``)."""
    import deepspeed

    try:
        model = tiny_llama()
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                             config=config(lins, **extra))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def state(engine) -> dict:
    return {k: v.float().clone() for k, v in engine.module.state_dict().items()}


def max_err(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def allow_fp16_on_this_cpu() -> None:
    """DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels for this CPU (AVX-512 FP16 /
    AMX); AVX2-only hosts say "Type fp16 is not supported on your device". These tests run no oneDNN fp16
    kernel (torch's own half kernels exist on every CPU), so lift that gate, for the test process only,
    to make the result independent of the host CPU."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu" and not acc.is_fp16_supported():
        acc.is_fp16_supported = lambda: True


# --- checkpoints: one fixed global batch sequence whatever the world size ----------------------------------------
def ckpt_config(plan, world, gpus_per_node) -> dict:
    gas = 8 // world  # the same global batch of 8 micro-batches on 4 or 2 ranks
    return {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 0}, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                              "warmup_num_steps": 2, "total_num_steps": 10}},
            "lins": {"plan": plan, "gpus_per_node": gpus_per_node}}


def ckpt_steps(engine, first, count) -> list:
    """Steps ``first`` .. ``first + count - 1`` of one fixed global batch sequence, whatever the world size:
    (full state dict, lr) after each."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    gas, states = 8 // world, []
    for step in range(first, first + count):
        for micro in range(gas):
            g = rank * gas + micro  # global micro-batch index 0..7
            x = batch(step, g % 2, g // 2, 96)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        states.append(({k: v.clone() for k, v in engine.module.state_dict().items()}, engine.get_lr()[0]))
    return states


def make_ckpt_engine(plan, gpus_per_node):
    import deepspeed

    world = torch.distributed.get_world_size()
    engine, *_ = deepspeed.initialize(model=tiny_llama(), config=ckpt_config(plan, world, gpus_per_node))
    return engine


def brute_force_candidates(topo):
    """The test oracle for ``lins_ds.plan.topology.candidates``: all (a|L, b|M)^3 triples filtered by ``is_valid``."""
    import itertools

    from lins_ds.plan.topology import Factor, Layout, divisors, is_valid

    all_factors = [Factor(a, b) for a in divisors(topo.gpus_per_node) for b in divisors(topo.nodes)]
    for p, g, os_ in itertools.product(all_factors, repeat=3):
        layout = Layout(p, g, os_)
        if is_valid(topo, layout):
            yield layout
