"""``python -m bench host-probe``: what a layer pass, and a checkpointed one, costs the host, measured on steps whose
kernels are too short to hide it, next to what the simulator's fitted terms say (issue 27).

The runs are ``bench/train.py --breakdown`` results (bench/gpu_compute_shapes.sh GRID=14: sequence 128, micro-batch 1,
with and without every layer checkpointed, ZeRO-1 and Lins), so a step is the host's work and its forward and
backward are timed apart. Each run is priced by ``calibrate.predict`` with the profile's terms on a host as slow as
the folder's runs measured theirs (``bench/host.py``: the median over the folder, against the calibration host's;
the runs were not in the fit). For each shape measured both ways, the extra host time of one checkpointed layer:
measured (the step, its forward and its backward, over the layers) and as the simulator prices it (the step). Where
every pass waits for the host, the forward pays ``per_ckpt_pass_s`` more and the backward ``per_layer_s +
per_ckpt_pass_s`` (the recompute), both at the folder's host.
"""

from __future__ import annotations

import glob
import json
import os
import statistics

from lins_ds.plan import ProfileTable, get_cluster

from . import calibrate as C


def _results(folder: str) -> dict:
    """(model, seq, mb, ckpt units, system) -> the run's JSON, for the folder's bench/train.py results."""
    results = [j for j in (json.load(open(p)) for p in sorted(glob.glob(os.path.join(folder, "*_*.json"))))
               if "median_step_s" in j]  # in the order shapes.load reads them, which load_train_runs keeps
    if not results or any("host_s_per_module" not in j for j in results):
        raise C.PlanError(f"{folder}: no bench/train.py results, or some without the host speed they ran at "
                          f"(host_s_per_module)")
    out = {}
    for r, j in zip(C.load_train_runs([folder]), results):
        key = (r.model, r.seq_len, r.micro_batch, r.ckpt_units, r.system)
        if key in out:  # pairs are taken by shape: a repeat would be dropped unseen
            raise C.PlanError(f"{folder}: {r.model} seq {r.seq_len} mb {r.micro_batch} ckpt {r.ckpt_units} under "
                              f"{r.system} twice; host-probe takes one run of each (put repeats in another folder)")
        out[key] = (r, j)
    return out


def probe(folder: str, profile: str) -> list:
    """Lines: every run predicted next to measured, then per shape and system the cost of a checkpointed layer."""
    table = ProfileTable.load(profile)
    ov = C.stored(table, profile)
    if ov is None or not ov.shape_model or not ov.host_s_per_module:
        raise C.PlanError(f"{profile}: no shape-model terms with a measured host (python -m bench simulate --fit "
                          f"--compute-table ... writes them)")
    runs = _results(folder)
    host = statistics.median(j["host_s_per_module"] for _, j in runs.values())
    scale = host / ov.host_s_per_module
    compute = ov.compute_spec(get_cluster("h200-emulated").compute())
    pred = {}
    lines = [f"{folder}: host {1e6 * host:.0f} us per module, {scale:.2f}x the calibration's "
             f"({1e6 * ov.host_s_per_module:.0f} us); every run priced at it",
             f"{'run':<46}{'measured ms':>12}{'predicted':>10}{'error':>8}   forward / backward / step, measured ms"]
    for key, (r, j) in sorted(runs.items()):
        terms = C.terms_of(r, {"host": table}, compute, scale)[0]
        pred[key] = terms.step(ov.terms(r.system))
        b = j.get("breakdown_s") or {}
        lines.append(f"{r.model} s{r.seq_len} mb{r.micro_batch} ckpt {r.ckpt_units} {r.system}".ljust(46)
                     + f"{1e3 * r.step_s:>12.1f}{1e3 * pred[key]:>10.1f}{100 * (pred[key] / r.step_s - 1):>+7.1f}%   "
                     + " / ".join(f"{1e3 * b[p]:.1f}" for p in ("forward", "backward", "step") if p in b))
    ckpt_ms = 1e3 * ov.terms("lins")["per_ckpt_pass_s"] * scale  # shared by every system
    lines.append(f"one checkpointed layer's extra host time, ms (the simulator, where every pass waits for the host: "
                 f"forward +{ckpt_ms:.2f}, backward + per_layer_s x {scale:.2f} + {ckpt_ms:.2f})")
    for key, (r, j) in sorted(runs.items()):
        model, seq, mb, n, system = key
        plain = runs.get((model, seq, mb, 0, system))
        if not n or plain is None:
            continue
        a = plain[1]
        measured = {p: (j["breakdown_s"][p] - a["breakdown_s"][p]) / n for p in ("forward", "backward")
                    if j.get("breakdown_s") and a.get("breakdown_s")}
        predicted = (pred[key] - pred[(model, seq, mb, 0, system)]) / n
        lines.append(f"  {model} s{seq} mb{mb} {system}: measured step +{1e3 * (r.step_s - plain[0].step_s) / n:.2f} ("
                     + ", ".join(f"{p} +{1e3 * v:.2f}" for p, v in measured.items())
                     + f"), predicted step +{1e3 * predicted:.2f} (per_layer_s "
                     + f"{1e3 * ov.terms(system)['per_layer_s'] * scale:.2f} at this host)")
    return lines


def add_arguments(p) -> None:
    p.add_argument("dir", help="a folder of bench/train.py --breakdown results (bench/gpu_compute_shapes.sh GRID=14)")
    p.add_argument("--profile", required=True, help="a profile with the fitted shape-model terms "
                   "(python -m bench simulate --fit --compute-table ... --out)")


def main(args) -> int:
    print("\n".join(probe(args.dir, args.profile)))
    return 0

