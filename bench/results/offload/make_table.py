"""The table and plot of bench/results/offload/README.md from the JSON rows of bench/gpu_offload.sh."""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = [  # (label, budget GiB or None, file)
    ("DeepSpeed ZeRO-2 + offload_optimizer", None, "deepspeed_offload/3b_zero2_offload.json"),
    ("DeepSpeed ZeRO-3 + offload_param + offload_optimizer", None, "deepspeed_offload/3b_zero3_offload.json"),
    ("DeepSpeed ZeRO-3 + offload_optimizer ratio 0.6", None, "final/3b_zero3_ratio.json"),
    ("Lins, DeepSpeed's footprint", 19.28, "final/3b_lins_footprint.json"),
    ("Lins", 30, "final/3b_lins_30.json"),
    ("Lins", 40, "final/3b_lins_40.json"),
    ("Lins, LLaMA-7B (seq 2048, mb 1, gas 1)", 80, "final/7b_lins_80.json"),
]
BASE = "deepspeed_offload/3b_zero2_offload.json"


def load(f):
    with open(os.path.join(HERE, f)) as fh:
        return json.load(fh)


def main():
    base = load(BASE)["median_step_s"]
    lines = ["| run | budget GiB | OS on host | step s | vs ZeRO-2 offload | waited for host s | GPU work s | "
             "peak allocated GiB | predicted | error | allocator held GiB | host GiB (predicted) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    bars = []
    for label, budget, f in ROWS:
        r = load(f)
        o, plan = r.get("offload") or {}, r.get("plan") or {}
        step, peak = r["median_step_s"], r["peak_memory_gb"]
        pred = plan.get("predicted_peak_gb")
        waited = o.get("waited_s_per_step")
        three_b = "7B" not in label
        units = f"{o['offload_units']} of {o['units']} units" if o else ""
        host = f"{o['host_gb']:.2f} ({o['predicted_host_gb']:.2f})" if o else ""
        lines.append(
            f"| {label} | {budget or ''} | {units} | {step:.3f} | "
            f"{f'{base / step:.2f} x' if three_b else ''} | {f'{waited:.3f}' if waited is not None else ''} | "
            f"{f'{step - waited:.3f}' if waited is not None else ''} | {peak:.2f} | {f'{pred:.2f}' if pred else ''} | "
            f"{f'{100 * (peak / pred - 1):+.1f} %' if pred else ''} | {r['peak_reserved_gb']:.2f} | "
            f"{host} |")
        if three_b:
            bars.append((label + (f" @{budget:g} GiB" if budget else ""), step, r["peak_reserved_gb"]))
    table = "\n".join(lines)
    print(table)
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.2))
    names = [b[0] for b in bars]
    ax[0].barh(names, [b[1] for b in bars], color=["#888"] * 3 + ["#2a7"] * 3)
    ax[0].set_xlabel("step (s), median of steps 4-8")
    ax[1].barh(names, [b[2] for b in bars], color=["#888"] * 3 + ["#2a7"] * 3)
    ax[1].set_xlabel("GPU memory held by the allocator (GiB)")
    ax[1].set_yticklabels([])
    fig.suptitle("LLaMA 2.92B, seq 4096, mb 2, gas 2, bf16, AdamW, every layer checkpointed, one H200")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "offload_3b.png"), dpi=110)
    with open(os.path.join(HERE, "table.md"), "w") as fh:
        fh.write(table + "\n")


if __name__ == "__main__":
    main()
