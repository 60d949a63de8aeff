"""The table and plot of bench/results/offload/params/README.md: per machine (one device lease each), DeepSpeed's
offloads and Lins with parameters on the host, the footprint and the 40 GiB runs, each timed apart by phase
(bench/train.py --breakdown), with the machine's host memory rise; from the JSON rows of bench/gpu_offload.sh."""
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


def label(name: str, r: dict) -> str:
    if name in BASELINES:
        return BASELINES[name]
    ratio = re.match(r"3b_zero3_ratio_([\d.]+)(?:_sg(\d+))?", name)
    if ratio:
        groups = f"sub_group_size {int(ratio.group(2)):.0e}" if ratio.group(2) else "default sub-groups"
        return f"DeepSpeed ZeRO-3 + offload_optimizer ratio {ratio.group(1)} ({groups})"
    o = r["offload"]
    what = "P+G+OS" if o.get("offload_params") else "G+OS" if o.get("offload_grads") else "OS"
    budget = re.search(r"_(\d+(?:\.\d+)?)", name).group(1)
    held = ", logits held" if name.endswith("_hold") else ""
    return f"Lins @ {budget} GiB (cap {r['gpu_cap_gb']:g}){held}: {what} of {o['offload_units']}/{o['units']} units"


def row(m: str, name: str, r: dict, base: dict) -> str:
    step, o, plan = r["median_step_s"], r.get("offload") or {}, r.get("plan") or {}
    ratios = [f"{base[k] / step:.2f} x" if k in base else "" for k in BASELINES]
    b = r.get("breakdown_s") or {}
    phases = " / ".join(f"{b[k]:.2f}" for k in ("forward", "backward", "step")) if b else ""
    waited = f"{o['waited_s_per_step']:.2f} / {o['grads_waited_s_per_step']:.2f}" if o else ""
    pred, peak = plan.get("predicted_peak_gb"), r["peak_memory_gb"]
    mem = f"{peak:.2f}" + (f" ({pred:.2f}, {100 * (pred / peak - 1):+.1f} %)" if pred else "")
    h = r.get("host_memory") or {}
    host = f"{h['rise_gb']:.2f}" + (f" ({o['predicted_host_gb']:.2f})" if o else "") if h else ""
    return (f"| {m} | {label(name, r)} | {step:.3f} | {ratios[0]} | {ratios[1]} | {phases} | {waited} | {mem} | "
            f"{r['peak_reserved_gb']:.2f} | {host} |")


def main():
    lines = ["| machine | run | step s | vs ZeRO-2 offload | vs ZeRO-3 offload | forward / backward / step s | "
             "waited: updates / gradient sums s | peak allocated GiB (predicted, over) | allocator held GiB | "
             "host memory rise GiB (predicted) |", "|---|---|---|---|---|---|---|---|---|---|"]
    bars = []
    for machine in sorted(glob.glob(os.path.join(HERE, "machine_*"))):
        m = os.path.basename(machine)[-1].upper()
        rows = {os.path.basename(f)[:-5]: load(f) for f in sorted(glob.glob(os.path.join(machine, "3b_*.json")))}
        base = {k: rows[k]["median_step_s"] for k in BASELINES if k in rows}
        for name, r in rows.items():
            lines.append(row(m, name, r, base))
            bars.append((f"{m}: {label(name, r)}", r.get("breakdown_s") or {}, r["peak_reserved_gb"],
                         (r.get("host_memory") or {}).get("rise_gb", 0.0), name.startswith("3b_zero")))
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(HERE, "table.md"), "w") as f:
        f.write(table + "\n")
    plot(bars)


def plot(bars):
    fig, ax = plt.subplots(1, 3, figsize=(18, 6.5))
    names = [b[0] for b in bars]
    left = [0.0] * len(bars)
    for phase, color in (("forward", "#4a90d9"), ("backward", "#2a7"), ("step", "#d95f4a")):
        width = [b[1].get(phase, 0.0) for b in bars]
        ax[0].barh(names, width, left=left, color=color, label=phase)
        left = [a + w for a, w in zip(left, width)]
    ax[0].legend()
    ax[0].set_xlabel("s per step, by phase (GPU synchronized at each boundary; medians of steps 4-8)")
    for i, (key, xlabel) in enumerate(((2, "GPU memory held by the allocator (GiB)"),
                                       (3, "host memory the run took (GiB, MemAvailable drop)")), start=1):
        ax[i].barh(names, [b[key] for b in bars], color=["#888" if b[4] else "#2a7" for b in bars])
        ax[i].set_xlabel(xlabel)
        ax[i].set_yticklabels([])
    fig.suptitle("LLaMA 2.92B, seq 4096, mb 2, gas 2, bf16, AdamW, every layer checkpointed; one H200 per machine")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "params_3b.png"), dpi=100)


if __name__ == "__main__":
    main()
