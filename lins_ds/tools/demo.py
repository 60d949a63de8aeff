"""``lins-ds demo``: 4 CPU processes (gloo) as 2 nodes x 2 GPUs train a tiny LLaMA with a solved plan.

The memory budget is set below what full replication needs, so the solver has to shard something;
the plan it picks (measured collective times of this machine, the memory it predicts) is printed
before training, then the loss per step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from .bench import example_script

# fp32 tiny LLaMA, micro-batch 4 x 64 tokens, 2 micro-batches per step: full replication needs 9.8 MiB
# per process in the planner's memory model (`lins-ds plan --model llama-tiny --nodes 2 --gpus-per-node 2
# --seq-len 64 --micro-batch-size 4 --grad-accum 2 --dtype fp32 --reserved-gb 0`); 9.5 MiB makes it shard.
DEMO_CONFIG = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "steps_per_print": 1000, "zero_optimization": {"stage": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
    "lins": {"gpus_per_node": 2, "plan": "solve", "gpu_memory_gb": 0.0093, "seq_len": 64,
             "activation_checkpointing": False},
}


def run(args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "lins_demo.json")
        with open(cfg, "w") as f:
            json.dump(DEMO_CONFIG, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
               "--master_port", str(args.master_port), example_script(), "--deepspeed_config", cfg,
               "--model", "tiny", "--seq-len", "64", "--steps", str(args.steps)]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
        return subprocess.call(cmd, env=env)
