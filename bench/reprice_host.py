"""Issue 59: the exposed host time each offload run of ``bench/gpu_offload.sh`` waited, next to the solver's price of
it (``plan.offload.exposed_seconds``, as the engine's start-up calls it) at the start-up's host update rate and at the
rate the run's own host worker updated at in its steady steps: what the overlap model predicts given the right rate.
The other inputs are the run's: its plan (placement, checkpointing, in-backward updates), the start-up summary's copy,
sum and norm speeds and compute rate (its log), the model, sequence and batch.

    python -m bench.reprice_host DIR RUN... [--micro-batch-size 2] [--grad-accum 2]

The batch defaults to the JSON's (``bench/train.py`` records it) or gpu_offload.sh's (2 and 2). Prints a Markdown
table and writes DIR/reprice_host.json."""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics

from lins_ds.plan import ComputeSpec, Topology, TrainingSpec, candidates, load_model
from lins_ds.plan.offload import HostSpec, Placement, exposed_seconds
from lins_ds.plan.solver import compute_seconds

from . import host_exposed

OFFLOAD = re.compile(r"offload: host optimizer .*?, ([\d.]+) G elements/s; copies ([\d.]+) GB/s up, ([\d.]+) GB/s "
                     r"down(?:, gradient sums ([\d.]+) and norms ([\d.]+) G elements/s)?")  # sums: G on the host
COMPUTE = re.compile(r"compute: ([\d.]+) TFLOP/s, [\d.]+ % of ([\d.]+)")


def price(run: dict, rate: float) -> float:
    """The solver's exposed host time of ``run``'s plan with the host update at ``rate`` elements/s."""
    plan = run["plan"]
    model = load_model(run["model"])
    in_backward = bool(plan.get("host_update_in_backward"))
    ckpt = plan["activation_checkpointing_units"]
    train = TrainingSpec(run["seq_len"], run["micro_batch_size"], run["grad_accum"], activation_checkpointing=ckpt,
                         host_update_in_backward=in_backward)
    fwd, bwd = compute_seconds(model, train, ComputeSpec(run["peak_tflops"], run["mfu_priced"]), ckpt)
    (layout,) = candidates(Topology(1, 1))
    p = plan["placement"]
    up, h2d, d2h, acc, norm = run["host"]
    host = HostSpec(1e6, rate, h2d, d2h, accumulate_elems_per_s=acc * 1e9, norm_elems_per_s=norm * 1e9)
    return exposed_seconds(model.unit_params(), Placement.of(p["units"], p["os"], p["g"], p["p"]), layout, train, host,
                           fwd, train.grad_accum * (fwd + bwd) - fwd, backward_s=bwd)


def worker_rate(run: dict) -> float:
    """The run's host worker's elements per second, median over the steps after warm-up."""
    units = load_model(run["model"]).unit_params()
    elems = sum(units[len(units) - run["plan"]["placement"]["units"]:])
    steady = [h for h in run["host_steps"][run["warmup_steps"]:] if h and h["worker_spent_s"].get("update")]
    return statistics.median(elems / h["worker_spent_s"]["update"] for h in steady)


def one(directory: str, name: str, mb: int, gas: int) -> dict:
    with open(os.path.join(directory, name + ".json")) as f:
        run = json.load(f)
    with open(os.path.join(directory, name + ".log")) as f:
        log = f.read()
    host, compute = OFFLOAD.search(log).groups(), COMPUTE.search(log).groups()
    run.update(micro_batch_size=run.get("micro_batch_size", mb), grad_accum=run.get("grad_accum", gas),
               host=[float(x) if x is not None else 1e9 for x in host], peak_tflops=float(compute[1]),
               mfu_priced=float(compute[0]) / float(compute[1]))
    start_up, worker = float(host[0]) * 1e9, worker_rate(run)
    measured = host_exposed.one(directory, name)  # the steady steps' mean wait and the start-up's logged price
    return {"run": name, "in_backward": bool(run["plan"].get("host_update_in_backward")),
            "waited_s": measured["waited_s"], "logged_s": measured["predicted_s"], "start_up_rate": start_up,
            "at_start_up_s": price(run, start_up), "worker_rate": worker, "at_worker_s": price(run, worker)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory")
    p.add_argument("runs", nargs="+")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    args = p.parse_args(argv)
    rows = [one(args.directory, r, args.micro_batch_size, args.grad_accum) for r in args.runs]
    print("| run | updates | waited s | start-up: rate G/s, priced s (logged) | error | worker rate G/s | "
          "priced at it s | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        err = (lambda s: f"{100 * (s / r['waited_s'] - 1):+.0f} %")
        print(f"| {r['run']} | {'in the backward' if r['in_backward'] else 'after the step'} | {r['waited_s']:.3f} | "
              f"{r['start_up_rate'] / 1e9:.2f}: {r['at_start_up_s']:.3f} ({r['logged_s']:.3f}) | "
              f"{err(r['at_start_up_s'])} | {r['worker_rate'] / 1e9:.2f} | {r['at_worker_s']:.3f} | "
              f"{err(r['at_worker_s'])} |")
    with open(os.path.join(args.directory, "reprice_host.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
