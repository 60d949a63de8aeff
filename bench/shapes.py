"""``python -m bench shapes``: the shape compute model (``lins_ds.plan.compute_model``) held to one-GPU runs of LLaMA
shapes it was not fitted on (issue 27).

Each run (a ``bench/train.py`` JSON: ZeRO-1 or Lins on one GPU, gas 1) is priced from its shape with the device's
measured compute table: GEMMs, attention, memory-bound work, recompute. Per system, the step is then fitted as the
simulator prices it (``simulate.StepTerms.step``, one GPU: no link)::

    step = sum over layer passes of max(a x its kernels, d)  +  a x the rest of the compute
         + b x update(parameters at the measured bandwidth)  +  c

in relative error — a is how far the kernels of a whole step fall short of the isolated ones the table timed, d the
host's cost of launching one layer pass's kernels and running its hooks (forward, backward, recompute: a small
layer waits for the host), b the optimizer's (and, for DeepSpeed, its gradient copies') cost per byte, c a fixed
cost per step; a and d by a grid search, b and c by non-negative least squares at each point — on half the shapes,
and each shape of the other half is predicted (leave-shapes-out), both ways. Beside it, the additive form before it,
``a x compute + b x update + c + d x layer passes`` (NNLS): every pass pays the host's d on top of its kernels.
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
from .simulate import DEFAULT_TERMS, StepTerms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(dirs: list) -> list:
    """[run dict]: every ``<name>_<system>.json`` of ``dirs``; repeats of a shape (``ref``, ``ref2``) kept apart. A
    DeepSpeed run's checkpointed layers: every layer where it ran with ``--checkpointing`` (``hf_checkpointing``);
    in results older than that field, those of the Lins run of the same shape in any of ``dirs``."""
    runs = []
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*_*.json"))):
            r = json.load(open(path))
            if "median_step_s" not in r:
                continue
            name, system = os.path.basename(path)[:-5].rsplit("_", 1)
            plan = r.get("plan")
            ckpt = plan.get("activation_checkpointing_units") if plan else None
            if ckpt is None and "hf_checkpointing" in r:
                ckpt = _layers(r["model"]) if r["hf_checkpointing"] else 0
            runs.append({"name": name, "system": system, "model": r["model"], "seq": r["seq_len"],
                         "mb": r["samples_per_gpu_per_step"], "step_s": r["median_step_s"], "dir": d,
                         "ckpt": ckpt, "plan": plan})
    ckpt = {(r["model"], r["seq"], r["mb"]): r["ckpt"] for r in runs if r["ckpt"] is not None}
    for r in runs:  # the ZeRO-1 run of a shape checkpoints as its Lins run does (bench/train.py --checkpointing)
        r["ckpt"] = ckpt.get((r["model"], r["seq"], r["mb"]), 0) if r["ckpt"] is None else r["ckpt"]
        r["shape"] = os.path.basename(r["model"])[:-5].replace("shape-", "") + f" s{r['seq']} mb{r['mb']}" + \
            (" ckpt" if r["ckpt"] else "")
    return runs


def _path(model: str) -> str:
    return model if os.path.isabs(model) else os.path.join(ROOT, model)


def _layers(model: str) -> int:
    return load_model(_path(model)).num_layers


def terms(run: dict, table: ComputeTable) -> dict:
    """A run's terms at the table's rates: compute, update, layers, and one layer's forward and backward kernels."""
    model = load_model(_path(run["model"]))
    train = TrainingSpec(run["seq"], run["mb"], 1, "bf16", "bf16")
    comp = step_compute(model, train, table, run["ckpt"])
    update = optimizer_seconds(model, train, 1, ComputeSpec(memory_bandwidth_gbs=table.bandwidth_gbs))
    return {"compute_s": comp.total_s, "update_s": update, "layers": model.num_layers,
            "recomputes": min(run["ckpt"], model.num_layers), "fwd_s": comp.layer_forward_s,
            "bwd_s": comp.layer_backward_s}


def _passes(r: dict) -> int:
    return 2 * r["layers"] + r["recomputes"]


def additive(rows: list) -> np.ndarray:
    """(a, b, c, d) minimising the relative error of a x compute + b x update + c + d x layer passes over ``rows``
    (the form before this one: every pass pays the host's d on top of its kernels)."""
    a = np.array([[r["compute_s"], r["update_s"], 1.0, _passes(r)] for r in rows]) / np.array([[r["step_s"]] for r in rows])
    return nnls(a, np.ones(len(rows)))


def additive_predict(coef: np.ndarray, r: dict) -> float:
    return float(coef[0] * r["compute_s"] + coef[1] * r["update_s"] + coef[2] + coef[3] * _passes(r))


GRID_A = np.linspace(0.8, 1.6, 33)
GRID_D = np.linspace(0.0, 0.012, 49)


def _base(r: dict, a: float, d: float) -> float:
    """The compute at a x the table's time, every layer pass the longer of its kernels and the host's d: the
    simulator's own step (``StepTerms.step``) with no update, link or fixed cost."""
    terms = StepTerms(a * r["compute_s"], 0.0, 0.0, 0.0, 0, layers=r["layers"], recomputes=r["recomputes"],
                      layer_fwd_s=a * r["fwd_s"], layer_bwd_s=a * r["bwd_s"])
    return terms.step(dict(DEFAULT_TERMS, per_layer_s=d))


def fit(rows: list) -> tuple:
    """(a, b, c, d) of the simulator's form, minimising the relative error over ``rows``."""
    y = np.array([r["step_s"] for r in rows])
    x = np.array([[r["update_s"], 1.0] for r in rows]) / y[:, None]
    best = None
    for a in GRID_A:
        for d in GRID_D:
            base = np.array([_base(r, a, d) for r in rows])
            bc = nnls(x, 1.0 - base / y)
            err = float(np.sum((base / y + x @ bc - 1.0) ** 2))
            if best is None or err < best[0]:
                best = (err, (float(a), float(bc[0]), float(bc[1]), float(d)))
    return best[1]


def predict(coef: tuple, r: dict) -> float:
    a, b, c, d = coef
    return _base(r, a, d) + b * r["update_s"] + c


def analyse(runs: list, table: ComputeTable) -> dict:
    for r in runs:
        r.update(terms(r, table))
    out = {"systems": {}}
    for system in sorted({r["system"] for r in runs}):
        rows = [r for r in runs if r["system"] == system]
        shapes = sorted({r["shape"] for r in rows})
        halves = (shapes[0::2], shapes[1::2])
        loo, add_loo = {}, {}
        for fit_on, held in (halves, halves[::-1]):
            part = [r for r in rows if r["shape"] in fit_on]
            coef, add_coef = fit(part), additive(part)
            for r in rows:
                if r["shape"] in held:
                    loo[id(r)], add_loo[id(r)] = predict(coef, r), additive_predict(add_coef, r)
        whole, add_whole = fit(rows), additive(rows)
        out["systems"][system] = {
            "coef": dict(zip(("compute", "update", "per_step_s", "per_layer_pass_s"), whole)),
            "halves": [list(h) for h in halves],
            "additive": dict(zip(("compute", "update", "per_step_s", "per_layer_pass_s"), add_whole)),
            "runs": [{"shape": r["shape"], "name": r["name"], "dir": os.path.basename(r["dir"]),
                      "measured_s": r["step_s"], "compute_s": r["compute_s"], "update_s": r["update_s"],
                      "raw_s": r["compute_s"] + r["update_s"], "fitted_s": predict(whole, r),
                      "held_out_s": loo[id(r)], "additive_held_out_s": add_loo[id(r)]} for r in rows]}
    return out


def text(result: dict) -> str:
    lines = []
    for system, s in result["systems"].items():
        c = s["coef"]
        lines.append(f"{system}: every layer pass the longer of {c['compute']:.3f} x its kernels and "
                     f"{1e3 * c['per_layer_pass_s']:.2f} ms of host, the rest of the compute x {c['compute']:.3f}, "
                     f"{c['update']:.3f} x update, {1e3 * c['per_step_s']:.1f} ms a step (fitted on every shape); "
                     f"halves: {s['halves']}")
        lines.append("| shape | call | run | measured s | shape model alone s | error | fitted (all) s | error | "
                     "held out (fitted on the other half) s | error | additive form, held out |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in s["runs"]:
            def err(x):
                return f"{100 * (x / r['measured_s'] - 1):+.1f} %"
            lines.append(f"| {r['shape']} | {r['dir']} | {r['name']} | {r['measured_s']:.4f} | {r['raw_s']:.4f} | "
                         f"{err(r['raw_s'])} | {r['fitted_s']:.4f} | {err(r['fitted_s'])} | {r['held_out_s']:.4f} | "
                         f"**{err(r['held_out_s'])}** | {err(r['additive_held_out_s'])} |")
        for key, label in (("held_out_s", "held out"), ("additive_held_out_s", "additive form, held out")):
            held = [abs(r[key] / r["measured_s"] - 1) for r in s["runs"]]
            lines.append(f"\n{label}: {sum(e <= 0.10 for e in held)} of {len(held)} runs within 10 %, largest "
                         f"{100 * max(held):.1f} %, median {100 * statistics.median(held):.1f} %")
        repeats = {}
        for r in s["runs"]:
            repeats.setdefault(r["shape"], []).append(r["measured_s"])
        for shape, steps in repeats.items():
            if len(steps) > 1:
                lines.append(f"measured {len(steps)} times (machines and calls apart): {shape}, "
                             f"{min(steps):.4f}-{max(steps):.4f} s, the slowest {100 * (max(steps) / min(steps) - 1):.0f} % "
                             f"over the fastest")
        m = s["additive"]
        lines.append(f"additive form (fitted on every shape): {m['compute']:.3f} x compute + {m['update']:.3f} x "
                     f"update + {1e3 * m['per_step_s']:.1f} ms + {1e3 * m['per_layer_pass_s']:.2f} ms x layer passes\n")
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
