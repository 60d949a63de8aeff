"""Parameters used on some ranks only: torch DDP, Lins and DeepSpeed's own stages side by side (CPU, 2 gloo ranks).

    python -m bench unused-params [--out bench/results/unused_params]

The models and data are the tests' (``tests/test_unused_params.py``), each six blocks whose block i runs its side
branch on rank i % 2 only: ``side-branch`` (the batch carries the route) and ``rank-fixed`` (the block asks the rank;
a tanh branch scaled by 0.1, a linear head, one draw a step from a per-rank generator). Gas 1, no clipping, AdamW
lr 1e-2 over two parameter groups, fp32. A third case, ``rank-fixed, gradient_clipping not set``, is the same model
as a user writes it: one AdamW group, a config without ``gradient_clipping``. DeepSpeed then clips the global norm
at its default, 1.0, and so does Lins; its reference is DDP with ``clip_grad_norm_(1.0)`` (DDP without clipping is
shown beside it). Prints, per case, each run's loss at steps 0..3 (mean over ranks) and its largest weight
difference from the reference; writes ``unused_params.json`` beside the tables.
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the model, data and DDP oracle are the tests' own
import lins_ds  # noqa: E402,F401  (routes deepspeed.initialize to LinsEngine for configs with a lins block)
from helpers import run  # noqa: E402
from test_unused_params import (ALL_SHARDED, G_SHARDED, LR, MODELS, REPLICATED, STEPS, build, ddp_run,  # noqa: E402
                                ddp_single_group, engine_single_group, max_diff, mean_over_ranks, param_groups)

CASES = ("side-branch", "rank-fixed")
DEFAULT_CLIPPING = "rank-fixed, gradient_clipping not set"

RUNS = {"Lins, P 1x1 G 1x1 OS 1x1": {"lins": REPLICATED}, "Lins, P 1x1 G 2x1 OS 2x1": {"lins": G_SHARDED},
        "Lins, P 2x1 G 2x1 OS 2x1": {"lins": ALL_SHARDED}, "DeepSpeed stage 0": {"stage": 0},
        "DeepSpeed ZeRO-1": {"stage": 1}, "DeepSpeed ZeRO-2": {"stage": 2}}


def engine_run(name: str, spec: dict):
    import deepspeed

    rank = torch.distributed.get_rank()
    model = build(name)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": spec.get("stage", 0)}, "steps_per_print": 1000}
    if "lins" in spec:
        cfg["lins"] = {"plan": spec["lins"], "gpus_per_node": 2}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=LR), config=cfg)
    losses = []
    for step in range(STEPS):
        loss = engine(*MODELS[name][1](step, 0, rank))
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss.item()))
    weights = {k: v.float().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return losses, weights


def all_runs():
    tables = {}
    for name in CASES:
        ddp_losses, ddp_weights, _ = ddp_run(name, 1, 0.0)
        rows = [("torch DDP, find_unused_parameters=True", ddp_losses, 0.0)]
        for label, spec in RUNS.items():
            losses, weights = engine_run(name, spec)
            rows.append((label, losses, max_diff(weights, ddp_weights)))
        tables[name] = rows
    tables[DEFAULT_CLIPPING] = default_clipping_rows()
    return tables


def default_clipping_rows() -> list:
    plain, plain_weights = ddp_single_group(0.0)
    clipped, ref = ddp_single_group(1.0)
    rows = [("torch DDP, find_unused_parameters=True, no clipping", plain, max_diff(plain_weights, ref)),
            ("torch DDP, find_unused_parameters=True, clip_grad_norm_(1.0) (the reference)", clipped, 0.0)]
    for label, spec in RUNS.items():
        losses, _, weights = engine_single_group(spec.get("lins"), "client", None, spec.get("stage", 0))
        rows.append((label, losses, max_diff(weights, ref)))
    return rows


def main(args) -> None:
    import deepspeed

    tables = run(all_runs, 2, gpus_per_node=2)[0]
    versions = {"torch": torch.__version__, "deepspeed": deepspeed.__version__}
    for name, rows in tables.items():
        print(f"\n{name}: 2 gloo ranks, torch {versions['torch']}, DeepSpeed {versions['deepspeed']}")
        print(f"| run | loss at steps 0..{STEPS - 1} | max weight difference from the reference after {STEPS} steps |")
        print("|---|---|---|")
        for label, losses, diff in rows:
            print(f"| {label} | {', '.join(f'{x:.7f}' for x in losses)} | {diff:.1e} |")
    out = args.out or os.path.join(ROOT, "bench", "results", "unused_params")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "unused_params.json")
    with open(path, "w") as f:
        json.dump({"versions": versions, "command": "python -m bench unused-params",
                   "models": {name: [{"run": label, "losses": losses, "max_weight_diff_from_reference": diff}
                                     for label, losses, diff in rows] for name, rows in tables.items()}},
                  f, indent=1)
    print(f"written {path}")
