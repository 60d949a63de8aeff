"""Every step of the three tuned runs and of the solver's plan alone (python bench/results/tune_repeat/plot.py)."""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
fig, ax = plt.subplots(figsize=(9, 4))
for name in ("tune1", "tune2", "tune3", "solve"):
    d = json.load(open(os.path.join(HERE, f"{name}.json")))
    times = d["step_times_s"]
    ax.plot(range(1, len(times) + 1), times, marker=".", label=name + (" (solver's plan alone)" if name == "solve" else ""))
ax.set_xlabel("optimizer step")
ax.set_ylabel("step s")
ax.set_ylim(0, 5)
ax.set_title("Qwen2.5-3B widths @40 GiB, one H200: \"plan\": \"tune\" three times, fresh caches")
ax.legend()
fig.tight_layout()
fig.savefig(os.path.join(HERE, "steps.png"), dpi=110)
