"""Train a LLaMA-shaped model on synthetic tokens with DeepSpeed: Lins or any ZeRO stage, from the config alone.

    deepspeed --num_gpus 2 examples/train_llama.py --deepspeed_config ds_configs/lins.json --model 1b
    torchrun --nproc_per_node 2 examples/train_llama.py --deepspeed_config ds_configs/zero3.json --model 1b
    CUDA_VISIBLE_DEVICES= deepspeed --num_gpus 2 examples/train_llama.py \\
        --deepspeed_config ds_configs/lins.json --model tiny --steps 3            # on CPU (gloo)

``--model`` is a planner built-in (``lins-ds plan --model``): ``tiny``, ``1b``, ``7b``, ``13b``, ``30b``. What is
Lins' here: ``import lins_ds``, and building the model under ``lins_ds.init`` (as ZeRO-3 builds it under
``deepspeed.zero.Init``) so that no rank holds it whole. The rest is a plain DeepSpeed training loop.
"""

from __future__ import annotations

import argparse
import contextlib

import deepspeed
import torch
import transformers
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

import lins_ds  # a config with a "lins" block now builds a LinsEngine
from lins_ds.tools.llama import llama_config, progressions


def build_context(ds_config: dict):
    """Lins and ZeRO-3 build the model sharded as it is built; the other stages build it whole."""
    if "lins" in ds_config:
        return lins_ds.init(config=ds_config)
    if ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        return deepspeed.zero.Init(config_dict_or_path=ds_config)
    return contextlib.nullcontext()


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher passes it
    deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    ds_config = load_ds_config(args.deepspeed_config)

    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    torch.manual_seed(1234)
    with build_context(ds_config):
        model = transformers.LlamaForCausalLM(llama_config(args.model, args.seq_len))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    data = progressions(model.config.vocab_size, args.seq_len, engine.train_micro_batch_size_per_gpu(),
                        seed=1234 + rank, device=engine.device)
    losses = []
    for step in range(1, args.steps + 1):
        loss_sum = torch.zeros((), device=engine.device)
        for _ in range(engine.gradient_accumulation_steps()):
            tokens = next(data)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()  # the optimizer steps at the end of each accumulation window
            loss_sum += loss.detach().float()
        torch.distributed.all_reduce(loss_sum)
        losses.append(loss_sum.item() / (world * engine.gradient_accumulation_steps()))
        if rank == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)

    engine.destroy()
    deepspeed.comm.destroy_process_group()  # torch asks every process to end with this
    return losses


if __name__ == "__main__":
    main()
