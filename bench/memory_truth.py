"""Issue 61's table from ``bench/gpu_memory_truth.sh``'s runs: per run the budget, the plan's length (start-up and
re-sized), its checkpointing and offload, predicted next to measured allocated peak, what the allocator reserved,
and whether it trained. Prints the table; writes memory_truth.json and memory_truth.png beside the runs.

    python -m bench.memory_truth DIR
"""

from __future__ import annotations

import glob
import json
import os
import sys


def rows(folder: str) -> list:
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        name = os.path.basename(path)[:-5]
        if name == "memory_truth":
            continue
        with open(path) as f:
            r = json.load(f)
        plan = r.get("plan") or {}
        pred, peak = plan.get("predicted_peak_gb"), r.get("peak_memory_gb")
        out.append({"run": name, "seq_len": r["seq_len"], "planned_seq_len": r.get("planned_seq_len"),
                    "budget_gb": r.get("lins_memory_gb"),
                    "checkpointed": f"{plan.get('activation_checkpointing_units')}/{plan.get('num_layers')}",
                    "offload_units": plan.get("offload_units"), "offload_grads": plan.get("offload_grads"),
                    "offload_params": plan.get("offload_params"),
                    "predicted_gb": pred, "measured_gb": peak, "reserved_gb": r.get("peak_reserved_gb"),
                    "error_pct": 100 * (pred / peak - 1) if pred and peak else None,
                    "step_s": r.get("median_step_s"), "losses": r.get("losses")})
    return out


def logged(folder: str) -> list:
    """Runs that wrote no JSON (failed): their name and last error line."""
    out = []
    for log in sorted(glob.glob(os.path.join(folder, "*.log"))):
        name = os.path.basename(log)[:-4]
        if os.path.exists(os.path.join(folder, name + ".json")):
            continue
        with open(log, errors="replace") as f:
            lines = [line.strip() for line in f if "Error" in line or "rc " in line]
        out.append({"run": name, "failed": lines[-2:] if lines else ["no output"]})
    return out


def main(folder: str) -> None:
    table, failed = rows(folder), logged(folder)
    fmt = "{:<22} {:>6} {:>6} {:>7} {:>7} {:>8} {:>9} {:>9} {:>9} {:>8} {:>7}"
    print(fmt.format("run", "budget", "seq", "sized", "ckpt", "offload", "pred GiB", "meas GiB", "resv GiB", "error %", "step s"))
    for r in table:
        off = f"{r['offload_units']}{'G' if r['offload_grads'] else ''}{'P' if r['offload_params'] else ''}"
        print(fmt.format(r["run"], r["budget_gb"] or "card", r["seq_len"], str(r["planned_seq_len"]), r["checkpointed"], off,
                         f"{r['predicted_gb']:.2f}" if r["predicted_gb"] else "-",
                         f"{r['measured_gb']:.2f}" if r["measured_gb"] else "-",
                         f"{r['reserved_gb']:.2f}" if r["reserved_gb"] else "-",
                         f"{r['error_pct']:+.1f}" if r["error_pct"] is not None else "-",
                         f"{r['step_s']:.3f}" if r["step_s"] else "-"))
    for f in failed:
        print(f"{f['run']:<22} FAILED: {' | '.join(f['failed'])}")
    with open(os.path.join(folder, "memory_truth.json"), "w") as f:
        json.dump({"runs": table, "failed": failed}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    done = [r for r in table if r["predicted_gb"] and r["measured_gb"]]
    if not done:
        return
    fig, ax = plt.subplots(figsize=(6, 6))
    top = max(max(r["predicted_gb"], r["measured_gb"]) for r in done) * 1.1
    ax.plot([0, top], [0, top], "k-", lw=0.8, label="predicted = measured")
    ax.fill_between([0, top], [0, 0.95 * top], [0, 1.05 * top], color="0.9", label="within 5 %")
    for r in done:
        ax.scatter(r["measured_gb"], r["predicted_gb"])
        ax.annotate(r["run"], (r["measured_gb"], r["predicted_gb"]), fontsize=7)
    ax.set_xlabel("measured peak allocated (GiB)")
    ax.set_ylabel("predicted peak allocated (GiB)")
    ax.set_title("Lins' memory model at the batches' length (issue 61)")
    ax.legend(loc="upper left")
    fig.savefig(os.path.join(folder, "memory_truth.png"), dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/out")
