"""``python -m bench layer-split``: one decoder layer of every measured shape, its forward and backward timed on the GPU
and its kernels split by kind, next to what the shape compute model prices (issue 27).

A training step's time mixes the layers' kernels with the host, the optimizer and fixed costs, which the simulator's
fit has to tell apart. One Hugging Face ``LlamaDecoderLayer`` of each shape (the grid's, the 2.9B job's, the 1B and
7B runs'), run back to back as training queues it (``bench.compute_profile.layer_table``), shows the compute
term alone: its GEMMs, its attention and the rest (the memory-bound kernels), each against the model's price at the
table's rates.

- ``--out DIR`` (GPU): writes ``DIR/layers.json`` (every shape: seconds, kernels by kind) and ``DIR/compute.json``
  (the device's compute table, its timed reference layers included), and ``DIR/gemm_back_to_back.json`` (the same
  GEMM grid, each GEMM four times back to back between its events);
- ``--analyse DIR`` (CPU): the table of measured against priced, per shape and kind, priced with ``DIR/compute.json``
  (or ``--compute``).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
from dataclasses import replace

from lins_ds.plan import TrainingSpec, load_model
from bench.compute_model import ComputeTable, in_training_factor, step_compute

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = os.path.join(ROOT, "bench/results/simulate/shapes")
EXTRA = (("bench/models/llama-2.9b.json", 4096, 2), ("1b", 2048, 2), ("7b", 2048, 1))


def shapes() -> list:
    """[(model, seq, micro-batch)]: every LLaMA shape the grid ran (its runs' JSONs, gas 1) and ``EXTRA``; the models
    of the family runs (``family-*.json``) are left out, the layers timed here being LLaMA's of the planner's shapes
    (``compute.layer_table``), their LLaMA-type ones too (what they test is their LM head, not their layers)."""
    seen = []
    for path in sorted(glob.glob(os.path.join(SHAPES, "call*", "*_lins.json"))):
        r = json.load(open(path))
        key = (r["model"], r["seq_len"], r["samples_per_gpu_per_step"])
        family = os.path.basename(r["model"]).startswith("family-")
        if "median_step_s" in r and r["seq_len"] >= 1024 and key not in seen and _is_llama(r["model"]) and not family:
            seen.append(key)
    return seen + [e for e in EXTRA if e not in seen]


def _is_llama(name: str) -> bool:
    if not name.endswith(".json"):
        return True  # a planner built-in: LLaMA shapes
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return json.load(f).get("model_type", "llama") == "llama"


def _model(name: str):
    return load_model(name if not name.endswith(".json") else os.path.join(ROOT, name))


def _layer_shape(model: str, seq: int, mb: int) -> tuple:
    m = _model(model)
    return (m.hidden, m.intermediate, m.heads, m.kv_heads, seq, mb)


def measure(out: str) -> int:
    import torch

    from bench import compute_profile as compute

    device = torch.device("cuda", torch.cuda.current_device())
    os.makedirs(out, exist_ok=True)
    table = compute.measure(device)
    compute.save(table, os.path.join(out, "compute.json"))
    b2b = compute.gemm_table(device, torch.bfloat16, reps=3, inner=4)
    compute.save({"gemm": b2b}, os.path.join(out, "gemm_back_to_back.json"))
    rows = []
    for model, seq, mb in shapes():
        row = compute.layer_table(device, torch.bfloat16, shapes=(_layer_shape(model, seq, mb),), split=True)[0]
        rows.append(dict(row, model=model))
        k = row["kernels_s"]
        print(f"{model} s{seq} mb{mb}: {1e3 * row['seconds']:.2f} ms (kernels: GEMM {1e3 * k['gemm']:.2f}, "
              f"attention {1e3 * k['attention']:.2f}, other {1e3 * k['other']:.2f})", flush=True)
    compute.save({"device": table["device"], "layers": rows}, os.path.join(out, "layers.json"))
    return 0


def priced(table: ComputeTable, row: dict) -> dict:
    """The shape model's forward + backward of one layer of ``row``'s shape, by kind, at ``table``'s rates."""
    model = _model(row["model"])
    one = step_compute(model, TrainingSpec(row["seq"], row["micro_batch"], 1), table)
    layers = model.num_layers
    # step_compute prices the whole model; one layer's share of each kind (the head's GEMM and loss taken out)
    head = step_compute(replace(model, num_layers=1), TrainingSpec(row["seq"], row["micro_batch"], 1), table)
    per = {k: (getattr(one, k) - getattr(head, k)) / (layers - 1) if layers > 1 else getattr(one, k)
           for k in ("gemm_s", "attention_s", "memory_s")}
    return {"gemm": per["gemm_s"], "attention": per["attention_s"], "other": per["memory_s"],
            "total": one.layer_forward_s + one.layer_backward_s}


def analyse(folder: str, compute: str = "") -> str:
    table = ComputeTable.load(compute or os.path.join(folder, "compute.json"))
    rows = json.load(open(os.path.join(folder, "layers.json")))["layers"]
    lines = [f"compute table: {table.source}; its in-training factor (timed reference layers over their price): "
             f"{in_training_factor(table):.3f}",
             "| shape | layer fwd+bwd ms | priced ms | ratio | GEMM ms (priced) | attention ms (priced) | "
             "other ms (priced) |", "|---|---|---|---|---|---|---|"]
    ratios = []
    for row in rows:
        p, k = priced(table, row), row["kernels_s"]
        ratios.append(row["seconds"] / p["total"])
        name = os.path.basename(row["model"]).replace(".json", "").replace("shape-", "")
        lines.append(f"| {name} s{row['seq']} mb{row['micro_batch']} | {1e3 * row['seconds']:.2f} | "
                     f"{1e3 * p['total']:.2f} | {ratios[-1]:.3f} | "
                     + " | ".join(f"{1e3 * k[x]:.2f} ({1e3 * p[x]:.2f})" for x in ("gemm", "attention", "other"))
                     + " |")
    lines.append(f"\nmeasured over priced: median {statistics.median(ratios):.3f}, {min(ratios):.3f}-"
                 f"{max(ratios):.3f} over {len(ratios)} shapes")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--out", help="GPU: measure every shape's layer here")
    p.add_argument("--analyse", help="CPU: measured against priced, from a folder --out wrote")
    p.add_argument("--compute", help="with --analyse: price with this compute table instead of the folder's")


def main(args) -> int:
    if args.out:
        return measure(args.out)
    if args.analyse:
        print(analyse(args.analyse, args.compute or ""))
        return 0
    raise SystemExit("python -m bench layer-split: give --out (GPU) or --analyse (CPU)")
