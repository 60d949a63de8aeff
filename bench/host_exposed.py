"""Issue 59's table: for each offload run of ``bench/gpu_offload.sh``, the step and what it waited for the host
(measured: the training thread's waits on host updates, mean over the steps after warm-up) next to what the start-up
table predicted ("... ms per step not hidden by ..."), and each run's step against a baseline run's.

    python -m bench.host_exposed DIR [--baseline NAME] RUN...     (RUN: a name of DIR/<RUN>.json and .log)

Prints a Markdown table and writes DIR/host_exposed.json."""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics

PREDICTED = re.compile(r"([\d.]+) ms per step not hidden by ([^)]*)\)")


def one(directory: str, name: str) -> dict:
    with open(os.path.join(directory, name + ".json")) as f:
        d = json.load(f)
    with open(os.path.join(directory, name + ".log")) as f:
        found = PREDICTED.findall(f.read())
    steady = (d.get("host_steps") or [])[d["warmup_steps"]:]
    times = d["step_times_s"][d["warmup_steps"]:]
    return {"median_step_s": d["median_step_s"], "max_over_median": max(times) / d["median_step_s"] if times else None,
            "waited_s": statistics.mean(h["waited_s"] for h in steady) if steady else None,
            "predicted_s": float(found[-1][0]) / 1e3 if found else None,
            "hidden_by": found[-1][1] if found else None, "peak_gb": d.get("peak_memory_gb"),
            "predicted_peak_gb": (d.get("plan") or {}).get("predicted_peak_gb"), "losses": d.get("losses")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory")
    p.add_argument("runs", nargs="+")
    p.add_argument("--baseline", action="append", default=[], help="a run each other run's step is compared with")
    args = p.parse_args(argv)
    rows = {}
    for name in args.runs + args.baseline:
        try:
            rows[name] = one(args.directory, name)
        except (OSError, ValueError, KeyError) as e:
            print(f"| {name} | no result ({type(e).__name__}: {e}) |")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print("| run | step s | max/median | waited for host s | predicted s | error | peak GiB (pred) | "
          + " | ".join(f"x {b}" for b in args.baseline) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(args.baseline))
    for name, r in rows.items():
        err = (r["predicted_s"] - r["waited_s"]) / r["waited_s"] if r["waited_s"] and r["predicted_s"] is not None else None
        r["prediction_error"] = err
        r["x_baseline"] = {b: rows[b]["median_step_s"] / r["median_step_s"] for b in args.baseline if b in rows}
        print(f"| {name} | {r['median_step_s']:.3f} | {fmt(r['max_over_median'], '.3f')} | {fmt(r['waited_s'], '.3f')} "
              f"| {fmt(r['predicted_s'], '.3f')} | {fmt(err and 100 * err, '+.0f')} % | {fmt(r['peak_gb'], '.2f')} "
              f"({fmt(r['predicted_peak_gb'], '.2f')}) | "
              + " | ".join(fmt(r["x_baseline"].get(b), ".3f") for b in args.baseline) + " |")
    with open(os.path.join(args.directory, "host_exposed.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
