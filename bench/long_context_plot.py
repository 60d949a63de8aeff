"""Issue 60's plot: tokens/s against sequence length for the plain loop, DeepSpeed's ALST recipe and Lins, from the
runs of ``bench/gpu_long_context.sh`` (``bench.train`` JSON summaries) gathered in one directory.

    python -m bench.long_context_plot bench/results/long_context/three_ways_1b [--title T]

Reads ``<mode>_<length>.json`` (mode ``plain``, ``alst``, or ``lins`` / ``tiled``: the script's name for Lins from
the config alone; other names, e.g. a rerun kept beside them, are left out) and ``<mode>_<length>.log`` without a
JSON (a run that ended early) whose log says it ran out of memory: marked x at that length. Writes
``tokens_per_s.png`` and ``tokens_per_s.json`` (per mode and length: the median step, tokens/s, measured and predicted
peak, or "out of memory"; and Lins over ALST at each length both ran).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

MODES = ("plain", "alst", "lins")
LABELS = {"plain": "plain PyTorch loop (HF checkpointing)", "alst": "DeepSpeed ALST recipe (ZeRO-3 offload)",
          "lins": "Lins (config alone)"}
NAME = re.compile(r"^(plain|alst|lins|tiled)_(\d+)\.(json|log)$")
MODE_OF = {"tiled": "lins"}  # gpu_long_context.sh's part name


def gather(directory: str) -> dict:
    """{mode: {length: row}} of the runs in ``directory``."""
    runs: dict = {m: {} for m in MODES}
    for path in sorted(glob.glob(os.path.join(directory, "*"))):
        match = NAME.match(os.path.basename(path))
        if not match:
            continue
        mode, length, kind = MODE_OF.get(match.group(1), match.group(1)), int(match.group(2)), match.group(3)
        if kind == "json":
            with open(path) as f:
                r = json.load(f)
            runs[mode][length] = {"median_step_s": r["median_step_s"], "tokens_per_s": r["tokens_per_gpu_s"],
                                  "measured_peak_gb": r.get("peak_memory_gb"),
                                  "predicted_peak_gb": (r.get("plan") or {}).get("predicted_peak_gb"),
                                  "steps": len(r.get("losses", [])), "first_loss": (r.get("losses") or [None])[0]}
        elif length not in runs[mode]:
            with open(path, errors="replace") as f:
                if "OutOfMemoryError" in f.read():
                    runs[mode][length] = {"result": "out of memory"}
    return runs


def ratios(runs: dict) -> dict:
    """Lins' tokens/s over ALST's at each length both trained."""
    both = sorted(set(runs["lins"]) & set(runs["alst"]))
    return {n: runs["lins"][n]["tokens_per_s"] / runs["alst"][n]["tokens_per_s"] for n in both
            if "tokens_per_s" in runs["lins"][n] and "tokens_per_s" in runs["alst"][n]}


def plot(runs: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode in MODES:
        ok = sorted((n, r["tokens_per_s"]) for n, r in runs[mode].items() if "tokens_per_s" in r)
        if ok:
            line, = ax.plot(*zip(*ok), marker="o", label=LABELS[mode])
            for n, r in runs[mode].items():
                if r.get("result") == "out of memory":
                    ax.plot([n], [ok[-1][1]], marker="x", markersize=10, color=line.get_color(), linestyle="none")
                    ax.annotate("out of memory", (n, ok[-1][1]), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("sequence length (tokens, one sequence per step)")
    ax.set_ylabel("tokens/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    p.add_argument("--title", default="tokens/s against sequence length, one GPU")
    args = p.parse_args(argv)
    runs = gather(args.directory)
    out = {"runs": {m: {str(n): r for n, r in sorted(v.items())} for m, v in runs.items()},
           "lins_over_alst": {str(n): round(x, 3) for n, x in ratios(runs).items()}}
    with open(os.path.join(args.directory, "tokens_per_s.json"), "w") as f:
        json.dump(out, f, indent=1)
    plot(runs, os.path.join(args.directory, "tokens_per_s.png"), args.title)
    for mode in MODES:
        for n, r in sorted(runs[mode].items()):
            print(f"{mode:6s} {n:7d}  " + (f"{r['median_step_s']:7.2f} s  {r['tokens_per_s']:8.0f} tokens/s"
                                            if "tokens_per_s" in r else r["result"]))
    for n, x in ratios(runs).items():
        print(f"Lins / ALST at {n}: {x:.3f}")


if __name__ == "__main__":
    main()
