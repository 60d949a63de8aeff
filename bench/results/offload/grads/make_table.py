"""The table and plot of bench/results/offload/grads/README.md: per machine (one device lease each), DeepSpeed's full
offloads and Lins with the offloaded units' gradients placed by the solver, from the JSON rows of
bench/gpu_offload.sh (parts g-3b, 7b-cap, 3b-ds)."""
import glob
import json
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BASELINES = {"3b_zero2_offload": "DeepSpeed ZeRO-2 + offload_optimizer",
             "3b_zero3_offload": "DeepSpeed ZeRO-3 + offload_param + offload_optimizer"}


def load(path):
    with open(path) as fh:
        return json.load(fh)


def lins_label(name: str, r: dict) -> str:
    o = r["offload"]
    what = "OS+G" if o.get("offload_grads") else "OS"
    budget = re.search(r"_(\d+(?:\.\d+)?)", name).group(1)
    model = "7B" if name.startswith("7b") else "2.9B"
    cap = f", cap {r['gpu_cap_gb']:g}" if r.get("gpu_cap_gb") else ""
    alloc = ", expandable" if name.endswith("_exp") else ""
    return f"Lins {model} @ {budget} GiB{cap}{alloc}: {what} of {o['offload_units']}/{o['units']} units"


def main():
    lines = ["| machine | run | step s | vs ZeRO-2 offload | vs ZeRO-3 offload | waited: updates / gradient sums s | "
             "peak allocated GiB (predicted, error) | allocator held GiB | host GiB (predicted) |",
             "|---|---|---|---|---|---|---|---|---|"]
    bars = []
    for machine in sorted(glob.glob(os.path.join(HERE, "machine_*"))):
        m = os.path.basename(machine)[-1].upper()
        rows = {os.path.basename(f)[:-5]: load(f) for f in sorted(glob.glob(os.path.join(machine, "*.json")))}
        base = {k: rows[k]["median_step_s"] for k in BASELINES if k in rows}
        for name, r in rows.items():
            if name.startswith("smoke") or not r.get("median_step_s"):
                continue
            step = r["median_step_s"]
            o, plan = r.get("offload") or {}, r.get("plan") or {}
            label = BASELINES.get(name) or lins_label(name, r)
            three_b = name.startswith("3b")
            ratios = [f"{base[k] / step:.2f} x" if k in base and three_b else "" for k in BASELINES]
            waited = f"{o['waited_s_per_step']:.3f} / {o['grads_waited_s_per_step']:.3f}" if o else ""
            pred = plan.get("predicted_peak_gb")
            peak = r["peak_memory_gb"]
            mem = f"{peak:.2f}" + (f" ({pred:.2f}, {100 * (peak / pred - 1):+.1f} %)" if pred else "")
            host = f"{o['host_gb']:.2f} ({o['predicted_host_gb']:.2f})" if o else ""
            lines.append(f"| {m} | {label} | {step:.3f} | {ratios[0]} | {ratios[1]} | {waited} | {mem} | "
                         f"{r['peak_reserved_gb']:.2f} | {host} |")
            if three_b:
                bars.append((f"{m}: {label}", step, r["peak_reserved_gb"], name in BASELINES))
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(HERE, "table.md"), "w") as f:
        f.write(table + "\n")
    fig, ax = plt.subplots(1, 2, figsize=(15, 5.5))
    names = [b[0] for b in bars]
    colors = ["#888" if b[3] else "#2a7" for b in bars]
    ax[0].barh(names, [b[1] for b in bars], color=colors)
    ax[0].set_xlabel("step (s), median of steps 4-8")
    ax[1].barh(names, [b[2] for b in bars], color=colors)
    ax[1].set_xlabel("GPU memory held by the allocator (GiB)")
    ax[1].set_yticklabels([])
    fig.suptitle("LLaMA 2.92B, seq 4096, mb 2, gas 2, bf16, AdamW, every layer checkpointed; one H200 per machine")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "grads_3b.png"), dpi=110)


if __name__ == "__main__":
    main()
