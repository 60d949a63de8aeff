"""``python -m bench shapes``: the shape compute model (``bench/compute_model.py``) held to one-GPU runs of LLaMA
shapes it was not fitted on (issue 27).

Each run (a ``bench/train.py`` JSON: ZeRO-1 or Lins on one GPU, gas 1) is priced from its shape with the device's
measured compute table: GEMMs, attention, memory-bound work, recompute. Per system, the step is then fitted as the
simulator prices it (``simulate.StepTerms.step``, one GPU: no link)::

    step = sum over layer passes of max(a x its kernels, d)  +  a x the rest of the compute
         + b x update(parameters at the measured bandwidth)  +  c

in relative error — a is how far the kernels of a whole step fall short of the isolated ones the table timed
(measured, and held, where the table timed whole layers: ``compute_model.in_training_factor``), d the
host's cost of launching one layer pass's kernels and running its hooks (forward, backward, recompute: a small
layer waits for the host), b the optimizer's (and, for DeepSpeed, its gradient copies') cost per byte, c a fixed
cost per step; a (unless measured) and d by a grid search, b and c by non-negative least squares at each point —
on half the shapes, and each shape of the other half is predicted (leave-shapes-out), both ways. A shape measured
more than once (other machines, other calls) is held at the median of its runs; each run is listed, and held alone
too. Beside it, the additive form before it, ``a x compute + b x update + c + d x layer passes`` (NNLS): every pass
pays the host's d on top of its kernels. The simulator's host cost per layer once a step is left out: these runs
are gas 1, where it only moves the backward's threshold beside d (a scratch grid over it, 0-6 ms, held fewer shapes:
Lins 22 and ZeRO-1 20 of 23, against 23 and 22 without); the 2-GPU runs at gas 2 fit it.
"""

from __future__ import annotations

import csv
import datetime
import glob
import json
import os
import statistics

import numpy as np

from lins_ds.plan import ComputeSpec, TrainingSpec, load_model
from bench.compute_model import ComputeTable, in_training_factor, step_compute
from lins_ds.plan.solver import optimizer_seconds

from .fit import nnls
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
            if r.get("world_size", 1) != 1:
                raise ValueError(f"{path}: a run on {r['world_size']} ranks; these are one-GPU runs (give 2-GPU "
                                 f"runs as python -m bench run results)")
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


def fit(rows: list, measured_a: float = 0.0) -> tuple:
    """(a, b, c, d) of the simulator's form, minimising the relative error over ``rows``; a held at ``measured_a``
    where the compute table measured it (its timed layers: ``compute_model.in_training_factor``)."""
    y = np.array([r["step_s"] for r in rows])
    x = np.array([[r["update_s"], 1.0] for r in rows]) / y[:, None]
    best = None
    for a in ([measured_a] if measured_a else GRID_A):
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


def by_shape(rows: list) -> list:
    """One row per shape: its terms, and as its step the median of its runs' (repeats on other machines and calls:
    a prediction is held to the shape, as ``calibrate.per_mode`` holds a mode), with the runs kept for the table."""
    groups = {}
    for r in rows:
        groups.setdefault(r["shape"], []).append(r)
    return [dict(g[0], step_s=float(np.median([r["step_s"] for r in g])), repeats=g) for _, g in sorted(groups.items())]


def analyse(runs: list, table: ComputeTable) -> dict:
    for r in runs:
        r.update(terms(r, table))
    a = in_training_factor(table) if table.layers else 0.0
    out = {"systems": {}, "measured_compute_factor": a or None}
    for system in sorted({r["system"] for r in runs}):
        rows = by_shape([r for r in runs if r["system"] == system])
        names = [r["shape"] for r in rows]
        halves = (names[0::2], names[1::2])
        for fit_on, held in (halves, halves[::-1]):
            part = [r for r in rows if r["shape"] in fit_on]
            coef, add_coef = fit(part, a), additive(part)
            for r in rows:
                if r["shape"] in held:
                    r["held_out_s"], r["additive_held_out_s"] = predict(coef, r), additive_predict(add_coef, r)
        whole, add_whole = fit(rows, a), additive(rows)
        out["systems"][system] = {
            "coef": dict(zip(("compute", "update", "per_step_s", "per_layer_pass_s"), whole)),
            "halves": [list(h) for h in halves],
            "additive": dict(zip(("compute", "update", "per_step_s", "per_layer_pass_s"), add_whole)),
            "shapes": [{"shape": r["shape"], "measured_s": r["step_s"], "compute_s": r["compute_s"],
                        "update_s": r["update_s"], "raw_s": r["compute_s"] + r["update_s"],
                        "fitted_s": predict(whole, r), "held_out_s": r["held_out_s"],
                        "additive_held_out_s": r["additive_held_out_s"],
                        "runs": [{"name": x["name"], "dir": os.path.basename(x["dir"]), "measured_s": x["step_s"]}
                                 for x in r["repeats"]]} for r in rows]}
    return out


def _spread(runs: list) -> float:
    """How much slower a shape's slowest run was than its fastest (0 for one run)."""
    steps = [x["measured_s"] for x in runs]
    return max(steps) / min(steps) - 1


def _within(pairs: list) -> str:
    """"k of n within 10 %, largest, median" of (predicted, measured) pairs."""
    errs = [abs(p / m - 1) for p, m in pairs]
    return (f"{sum(e <= 0.10 for e in errs)} of {len(errs)} within 10 %, largest {100 * max(errs):.1f} %, "
            f"median {100 * statistics.median(errs):.1f} %")


def text(result: dict) -> str:
    lines = []
    for system, s in result["systems"].items():
        c = s["coef"]
        lines.append(f"{system}: every layer pass the longer of {c['compute']:.3f} x its kernels and "
                     f"{1e3 * c['per_layer_pass_s']:.2f} ms of host, the rest of the compute x {c['compute']:.3f}, "
                     f"{c['update']:.3f} x update, {1e3 * c['per_step_s']:.1f} ms a step (fitted on every shape"
                     f"{'; the compute factor measured by the table' if result.get('measured_compute_factor') else ''}"
                     f"); halves: {s['halves']}")
        lines.append("| shape | runs (call/run: s) | measured s (median) | spread | shape model alone s | error | "
                     "fitted (all) s | error | held out (fitted on the other half) s | error | additive form, held out |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in s["shapes"]:
            def err(x):
                return f"{100 * (x / r['measured_s'] - 1):+.1f} %"
            listed = ", ".join(f"{x['dir']}/{x['name']}: {x['measured_s']:.4f}" for x in r["runs"])
            lines.append(f"| {r['shape']} | {listed} | {r['measured_s']:.4f} | {100 * _spread(r['runs']):.0f} % | "
                         f"{r['raw_s']:.4f} | {err(r['raw_s'])} | {r['fitted_s']:.4f} | {err(r['fitted_s'])} | "
                         f"{r['held_out_s']:.4f} | **{err(r['held_out_s'])}** | {err(r['additive_held_out_s'])} |")
        shapes, runs = s["shapes"], [(r, x) for r in s["shapes"] for x in r["runs"]]
        lines.append(f"\nheld out: {_within([(r['held_out_s'], r['measured_s']) for r in shapes])} (shapes, each "
                     f"at the median of its runs)")
        lines.append(f"held out, each run alone: {_within([(r['held_out_s'], x['measured_s']) for r, x in runs])} (runs)")
        lines.append(f"additive form, held out: {_within([(r['additive_held_out_s'], r['measured_s']) for r in shapes])} "
                     f"(shapes)")
        repeated = [r for r in shapes if len(r["runs"]) > 1]
        spreads = sorted((_spread(r["runs"]), r["shape"]) for r in repeated)
        if spreads:
            lines.append(f"measured more than once (machines and calls apart): {len(repeated)} shapes, the slowest run "
                         f"over the fastest by {100 * spreads[0][0]:.0f}-{100 * spreads[-1][0]:.0f} % "
                         f"(median {100 * statistics.median(x for x, _ in spreads):.0f} %, largest {spreads[-1][1]})")
        m = s["additive"]
        lines.append(f"additive form (fitted on every shape): {m['compute']:.3f} x compute + {m['update']:.3f} x "
                     f"update + {1e3 * m['per_step_s']:.1f} ms + {1e3 * m['per_layer_pass_s']:.2f} ms x layer passes\n")
    return "\n".join(lines)


# nvidia-smi's clocks_event_reasons bits (nvmlClocksEventReasons)
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "SW power cap", 0x8: "HW slowdown", 0x10: "sync boost",
           0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake", 0x100: "display clock"}


def read_clocks(folder: str) -> list:
    """(unix time, SM MHz, throttle-reason bits) of the folder's GPU clock logs (``gpu_clocks_*.csv``: nvidia-smi's
    csv, its clock UTC, as bench/gpu_compute_shapes.sh writes it beside the runs)."""
    rows = []
    for path in glob.glob(os.path.join(folder, "gpu_clocks_*.csv")):
        with open(path, newline="") as f:
            for r in list(csv.reader(f))[1:]:
                try:  # a sample nvidia-smi could not take reads "[N/A]" (or the log was cut mid-row): left out
                    when = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
                    rows.append((when.replace(tzinfo=datetime.timezone.utc).timestamp(), int(r[1]), int(r[6], 16)))
                except (ValueError, IndexError):
                    continue
    return sorted(rows)


def clock_lines(dirs: list, warmup: int = 4) -> list:
    """Per run with a clock log beside it: the spread of its timed steps next to the GPU's SM clock and throttle
    reasons sampled within them (the steps after the run's own ``warmup_steps``; ``warmup`` for results older than
    that field). On the lent H200s (calls 6-13) every run whose clock fell below 1860 MHz (under the power cap: its
    kernels keep the GPU busy) repeated within 8 %; most of those whose clock stayed near its 1980 MHz maximum,
    waiting for the host, moved by 10-198 %."""
    lines = []
    for d in dirs:
        clocks = read_clocks(d)
        for path in sorted(glob.glob(os.path.join(d, "*_*.json"))) if clocks else ():
            r = json.load(open(path))
            ends = r.get("step_end_unix")
            if not ends:
                continue
            steps = list(zip(r["step_times_s"], ends))[r.get("warmup_steps", warmup):]
            seen = [c for dt, end in steps for c in clocks if end - dt <= c[0] <= end]
            if not seen:
                continue
            times = [dt for dt, _ in steps]
            reasons = sorted({name for _, _, bits in seen for bit, name in REASONS.items() if bits & bit}) or ["none"]
            lines.append(f"{os.path.basename(d)}/{os.path.basename(path)[:-5]}: steps {1e3 * min(times):.0f}-"
                         f"{1e3 * max(times):.0f} ms ({100 * (max(times) / min(times) - 1):.0f} %), SM clock "
                         f"{min(c[1] for c in seen)}-{max(c[1] for c in seen)} MHz over {len(seen)} samples, "
                         f"throttled by: {', '.join(reasons)}")
    return lines


def add_arguments(p) -> None:
    p.add_argument("dirs", nargs="+", help="folders of bench/train.py JSONs named <shape>_<system>.json")
    p.add_argument("--compute", required=True, help="the device's compute table (python -m bench.compute_profile)")
    p.add_argument("--out", help="write the analysis as JSON here")
    p.add_argument("--clocks", action="store_true", help="also each run's step spread next to the GPU clock log "
                   "beside it (bench/gpu_compute_shapes.sh writes one), over the steps after each run's warm-up")


def main(args) -> int:
    result = analyse(load(args.dirs), ComputeTable.load(args.compute))
    print(text(result))
    if args.clocks:
        print("\n".join(clock_lines(args.dirs)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
