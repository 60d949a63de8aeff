"""``python -m bench shapes``: the shape compute model (``lins_ds.plan.compute_model``) held to one-GPU runs of LLaMA
shapes it was not fitted on (issue 27).

Each run (a ``bench/train.py`` JSON: ZeRO-1 or Lins on one GPU, gas 1) is priced from its shape with the device's
measured compute table: GEMMs, attention, memory-bound work, recompute. Per system, the step is then fitted as

    step = a x compute(shape)  +  b x update(parameters at the measured bandwidth)  +  c  +  d x layer passes

by non-negative least squares in relative error — a is how far the kernels of a whole step fall short of the
isolated ones the table timed, b the optimizer's (and, for DeepSpeed, its gradient copies') cost per byte, c a fixed
cost per step, d the host's cost of launching one layer's kernels and running its hooks (per layer, micro-batch
and pass: forward, backward, recompute) — on half the shapes, and each shape of the other half is predicted
(leave-shapes-out), both ways.
"""

from __future__ import annotations

import glob
import json
import os
import statistics

import numpy as np

from lins_ds.plan import ComputeSpec, TrainingSpec, load_model
from lins_ds.plan.compute_model import ComputeTable, step_compute
from lins_ds.plan.solver import optimizer_seconds

from .calibrate import nnls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(dirs: list) -> list:
    """[run dict]: every ``<name>_<system>.json`` of ``dirs``; repeats of a shape (``ref``, ``ref2``) kept apart."""
    runs = []
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*_*.json"))):
            r = json.load(open(path))
            if "median_step_s" not in r:
                continue
            name, system = os.path.basename(path)[:-5].rsplit("_", 1)
            runs.append({"name": name, "system": system, "model": r["model"], "seq": r["seq_len"],
                         "mb": r["samples_per_gpu_per_step"], "step_s": r["median_step_s"], "dir": d,
                         "ckpt": (r.get("plan") or {}).get("activation_checkpointing_units"), "plan": r.get("plan")})
    ckpt = {(r["model"], r["seq"], r["mb"]): r["ckpt"] for r in runs if r["ckpt"] is not None}
    for r in runs:  # the ZeRO-1 run of a shape checkpoints as its Lins run does (bench/train.py --checkpointing)
        r["ckpt"] = ckpt.get((r["model"], r["seq"], r["mb"]), 0) if r["ckpt"] is None else r["ckpt"]
        r["shape"] = os.path.basename(r["model"])[:-5].replace("shape-", "") + f" s{r['seq']} mb{r['mb']}" + \
            (" ckpt" if r["ckpt"] else "")
    return runs


def terms(run: dict, table: ComputeTable) -> tuple:
    """(compute s, update s, layer passes) of a run."""
    path = run["model"] if os.path.isabs(run["model"]) else os.path.join(ROOT, run["model"])
    model = load_model(path)
    train = TrainingSpec(run["seq"], run["mb"], 1, "bf16", "bf16")
    comp = step_compute(model, train, table, run["ckpt"])
    update = optimizer_seconds(model, train, 1, ComputeSpec(memory_bandwidth_gbs=table.bandwidth_gbs))
    return comp.total_s, update, model.num_layers * 2 + min(run["ckpt"], model.num_layers)


def fit(rows: list) -> np.ndarray:
    """(a, b, c) minimising the relative error of a x compute + b x update + c over ``rows``."""
    a = np.array([[r["compute_s"], r["update_s"], 1.0, r["passes"]] for r in rows]) / np.array([[r["step_s"]] for r in rows])
    return nnls(a, np.ones(len(rows)))


def predict(coef: np.ndarray, r: dict) -> float:
    return float(coef[0] * r["compute_s"] + coef[1] * r["update_s"] + coef[2] + coef[3] * r["passes"])


def analyse(runs: list, table: ComputeTable) -> dict:
    for r in runs:
        r["compute_s"], r["update_s"], r["passes"] = terms(r, table)
    out = {"systems": {}}
    for system in sorted({r["system"] for r in runs}):
        rows = [r for r in runs if r["system"] == system]
        shapes = sorted({r["shape"] for r in rows})
        halves = (shapes[0::2], shapes[1::2])
        loo = {}
        for fit_on, held in (halves, halves[::-1]):
            coef = fit([r for r in rows if r["shape"] in fit_on])
            for r in rows:
                if r["shape"] in held:
                    loo[id(r)] = predict(coef, r)
        whole = fit(rows)
        out["systems"][system] = {
            "coef": {"compute": whole[0], "update": whole[1], "per_step_s": whole[2], "per_layer_pass_s": whole[3]},
            "halves": [list(h) for h in halves],
            "runs": [{"shape": r["shape"], "name": r["name"], "measured_s": r["step_s"], "compute_s": r["compute_s"],
                      "update_s": r["update_s"], "raw_s": r["compute_s"] + r["update_s"],
                      "fitted_s": predict(whole, r), "held_out_s": loo[id(r)]} for r in rows]}
    return out


def text(result: dict) -> str:
    lines = []
    for system, s in result["systems"].items():
        c = s["coef"]
        lines.append(f"{system}: step = {c['compute']:.3f} x compute + {c['update']:.3f} x update + "
                     f"{1e3 * c['per_step_s']:.1f} ms + {1e3 * c['per_layer_pass_s']:.2f} ms x layer passes "
                     f"(fitted on every shape); halves: {s['halves']}")
        lines.append("| shape | run | measured s | shape model alone s | error | fitted (all) s | error | "
                     "held out (fitted on the other half) s | error |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in s["runs"]:
            def err(x):
                return f"{100 * (x / r['measured_s'] - 1):+.1f} %"
            lines.append(f"| {r['shape']} | {r['name']} | {r['measured_s']:.4f} | {r['raw_s']:.4f} | {err(r['raw_s'])} | "
                         f"{r['fitted_s']:.4f} | {err(r['fitted_s'])} | {r['held_out_s']:.4f} | "
                         f"**{err(r['held_out_s'])}** |")
        held = [abs(r["held_out_s"] / r["measured_s"] - 1) for r in s["runs"]]
        lines.append(f"\nheld out: {sum(e <= 0.10 for e in held)} of {len(held)} runs within 10 %, largest "
                     f"{100 * max(held):.1f} %, median {100 * statistics.median(held):.1f} %\n")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("dirs", nargs="+", help="folders of bench/train.py JSONs named <shape>_<system>.json")
    p.add_argument("--compute", required=True, help="the device's compute table (python -m lins_ds.profiler.compute)")
    p.add_argument("--out", help="write the analysis as JSON here")


def main(args) -> int:
    result = analyse(load(args.dirs), ComputeTable.load(args.compute))
    print(text(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
