"""Table and plot of the one-H200 tuning runs (issue 28): python bench/results/tune/make_table.py"""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = [("40 GiB (offload and checkpointing)", "final/tune40.json"),
        ("60 GiB (checkpointing)", "final/tune60.json"),
        ("40 GiB, first call (every switch staged)", "every_move_staged/tune40.json")]
AGAIN = [("40 GiB", "every_move_staged/again40.json"), ("60 GiB", "final/again60.json")]


def load(rel):
    with open(os.path.join(HERE, rel)) as f:
        return json.load(f)


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def main():
    lines = ["| budget | # | candidate | why | predicted step s | measured step s | pred./meas. | predicted peak GiB |"
             " measured peak GiB | switch s | extra GiB in switch | result |", "|" + "---|" * 12]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, rel in RUNS:
        rows = load(rel)["tune"]
        for i, r in enumerate(rows):
            ratio = r["predicted_step_s"] / r["measured_step_s"] if r["measured_step_s"] else None
            lines.append(f"| {label} | {i} | {r['candidate']} | {r['why']} | {fmt(r['predicted_step_s'])} | "
                         f"{fmt(r['measured_step_s'])} | {fmt(ratio, '.2f')} | {fmt(r['predicted_peak_gb'], '.2f')} | "
                         f"{fmt(r['measured_peak_gb'], '.2f')} | {fmt(r['relayout_s'], '.2f')} | "
                         f"{fmt(r['relayout_extra_gb'], '.2f')} | {'**chosen**' if r['chosen'] else r['dropped']} |")
    for ax, (label, rel) in zip(axes, RUNS[:2]):
        rows = load(rel)["tune"]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["predicted_step_s"] for r in rows], 0.4, label="predicted")
        ax.bar([x + 0.2 for x in xs], [r["measured_step_s"] for r in rows], 0.4, label="measured (median)")
        ax.set_xticks(list(xs), [r["candidate"].replace("P=1x1 G=1x1 OS=1x1 ", "").replace(" offload", "\noffload")
                                 + (" *" if r["chosen"] else "") for r in rows], fontsize=7)
        ax.set_title(f"2.92B LLaMA, one H200, {label}", fontsize=9)
        ax.set_ylabel("step s")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "tune_3b.png"), dpi=110)
    lines += ["", "| budget | the next launch (cached decision, no trials): median step s | steps |", "|---|---|---|"]
    for label, rel in AGAIN:
        d = load(rel)
        lines.append(f"| {label} | {d['median_step_s']:.3f} | {len(d['step_times_s'])} (median of steps 4-8) |")
    with open(os.path.join(HERE, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
