"""Numbers unchanged (issue 62): the losses and a digest of the final weights of four plans (replicated; OS sharded with
half the units' OS on the host; all sharded; hpZ-like), one layer checkpointed, 3 steps of the tests' data, 4 gloo ranks
on CPU, under the lins_ds of TREE (a checkout or `git archive` of a commit). Run it under two trees and compare:
    python bench/same_numbers.py /tmp/old > old.txt; python bench/same_numbers.py . > new.txt; diff old.txt new.txt
Prints one line per plan: its losses and the weights' digest."""
import hashlib
import json
import os
import sys

tree = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
sys.path.insert(0, os.path.join(tree, "tests")); sys.path.insert(0, tree)
import torch
import lins_ds  # noqa
from helpers import run, config, tiny_llama, param_groups, batch, GAS

PLANS = {"replicated": {"p": [1, 1], "g": [1, 1], "os": [1, 1]},
         "os-sharded": {"p": [1, 1], "g": [1, 1], "os": [2, 2]},
         "all-sharded": {"p": [2, 2], "g": [2, 2], "os": [2, 2]},
         "hpz": {"p": [2, 1], "g": [2, 2], "os": [2, 2]}}

def job(names):
    import deepspeed
    out = {}
    for name in names:
        lins = {"plan": PLANS[name], "host_optimizer": "torch", "activation_checkpointing": 1}
        if name == "os-sharded":
            lins["offload"] = {"os": "cpu", "os_fraction": 0.5}
        model = tiny_llama()
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                          config=config(lins))
        rank, losses = torch.distributed.get_rank(), []
        for step in range(3):
            for micro in range(GAS):
                x = batch(step, micro, rank, 96)
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss); engine.step(); losses.append(loss.item())
        sd = engine.module.state_dict()
        h = hashlib.sha256(b"".join(sd[k].detach().float().numpy().tobytes() for k in sorted(sd))).hexdigest()[:16]
        out[name] = (losses, h)
        engine.destroy()
    return out

if __name__ == "__main__":
    for name, (losses, digest) in run(job, 4, list(PLANS), gpus_per_node=2)[0].items():
        print(name, digest, json.dumps(losses))
