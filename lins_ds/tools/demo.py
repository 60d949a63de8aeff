"""``lins-ds demo``: 4 CPU processes (gloo) as 2 nodes x 2 GPUs train a tiny LLaMA with a solved plan.

Self-contained (nothing but the installed package): the processes are forked here and meet through a file in a
temporary directory. The memory budget is set below what full replication needs, so the solver has to shard
something; the plan it picks (from collective times measured on this machine, the memory it predicts) is printed before
training, then the loss per step, which falls as the model learns the arithmetic progressions it is fed.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

NPROC, GPUS_PER_NODE, SEQ_LEN = 4, 2, 64
# fp32 tiny LLaMA, micro-batch 4 x 64 tokens, 2 micro-batches per step: full replication needs 9.8 MiB
# per process in the planner's memory model (`lins-ds plan --model llama-tiny --nodes 2 --gpus-per-node 2
# --seq-len 64 --micro-batch-size 4 --grad-accum 2 --dtype fp32 --reserved-gb 0`); 9.5 MiB makes it shard.
DEMO_CONFIG = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "steps_per_print": 1000, "zero_optimization": {"stage": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
    "lins": {"gpus_per_node": GPUS_PER_NODE, "plan": "solve", "gpu_memory_gb": 0.0093, "seq_len": SEQ_LEN,
             "activation_checkpointing": False},
}


def _worker(rank: int, steps: int, rendezvous: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % GPUS_PER_NODE), WORLD_SIZE=str(NPROC),
                      LOCAL_WORLD_SIZE=str(GPUS_PER_NODE))
    torch.set_num_threads(1)
    if rank != 0:  # rank 0 speaks for all (DeepSpeed would print its start-up lines once per process)
        sys.stdout = open(os.devnull, "w")
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=NPROC)
    import deepspeed
    import transformers

    import lins_ds  # noqa: F401  (a config with a "lins" block builds a LinsEngine)

    from .llama import llama_config, progressions

    torch.manual_seed(0)
    with lins_ds.init(config=DEMO_CONFIG):  # each rank builds only its own shards
        model = transformers.LlamaForCausalLM(llama_config("tiny", SEQ_LEN))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DEMO_CONFIG)
    data = progressions(model.config.vocab_size, SEQ_LEN, engine.train_micro_batch_size_per_gpu(), 1234 + rank)
    for step in range(1, steps + 1):
        total = torch.zeros(())
        for _ in range(engine.gradient_accumulation_steps()):
            x = next(data)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach() / engine.gradient_accumulation_steps()
        torch.distributed.all_reduce(total)
        if rank == 0:
            print(f"step {step:4d}  loss {total.item() / NPROC:.4f}", flush=True)
    engine.destroy()
    torch.distributed.destroy_process_group()


def run(args) -> int:
    os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    method = "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.start_processes(_worker, args=(args.steps, os.path.join(tmp, "rendezvous")),
                                              nprocs=NPROC, start_method=method)
    return 0
