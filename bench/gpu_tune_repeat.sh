#!/usr/bin/env bash
# Does "plan": "tune" repeat itself? One H200 (device tool nvidia-h200; DeepSpeed 0.19.8 wheels in .whl from
# ../shared/tools/device_wheels.sh 0.19.8): Qwen2.5-3B widths at 40 GiB (seq 4096, micro-batch 2, gas 2, bf16, AdamW,
# clip 1, offload "auto"), tuned three times, each with a fresh decision cache (the profiles are shared: they are
# measurements of the machine, not decisions), 3 candidates, each timed until its median step is known to +-3 %
# (lins.tune defaults: 2 warm-up steps untimed, max_steps 12), 40 steps a run; then the solver's plan run alone
# ("plan": "solve", the same job, 20 steps, the first 5 left out), side by side in one invocation. RUN picks the
# runs (tune1 tune2 tune3 solve; default all; a device call holds about two): the table reads every tune<i>.json and
# solve.json under $OUT, so runs split over calls go into one table by re-running the summary with RUN=none.
#   run(command="OUT=$OUT RUN='tune1 tune2' bash bench/gpu_tune_repeat.sh", carry=[".whl"])
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
Q3=bench/models/hub-qwen2.5-3b.json
WANT=" ${RUN:-tune1 tune2 tune3 solve} "
COMMON="--model $Q3 --seq-len 4096 --micro-batch-size 2 --grad-accum 2 --lins-memory-gb 40"
for i in 1 2 3; do
  [[ "$WANT" == *" tune$i "* ]] || continue
  cache="/tmp/tune_cache$i"; rm -rf "$cache"; mkdir -p "$cache"  # fresh: no decision, and no profile either
  timeout 280 torchrun --nproc_per_node 1 --master_port 29519 -m bench.train --deepspeed_config ds_configs/lins_tune.json \
    $COMMON --steps 40 --warmup-steps 37 --lins-tune '{"candidates": 3, "steps": 3}' --lins-profile-cache "$cache" \
    --out "$OUT/tune$i.json" > "$OUT/tune$i.log" 2>&1
  echo "== tune$i rc=$?"; grep -A6 "^lins tune:" "$OUT/tune$i.log" | head -8; grep -E "^step" "$OUT/tune$i.log" | tail -3
done
if [[ "$WANT" == *" solve "* ]]; then
  timeout 200 torchrun --nproc_per_node 1 --master_port 29519 -m bench.train --deepspeed_config ds_configs/lins.json \
    $COMMON --steps 20 --warmup-steps 5 --out "$OUT/solve.json" > "$OUT/solve.log" 2>&1
  echo "== solve rc=$?"; grep -E "^step" "$OUT/solve.log" | tail -3
fi
python3 - "$OUT" <<'PY'
import json, os, statistics, sys
out = sys.argv[1]
try:
    solve = json.load(open(os.path.join(out, "solve.json")))["median_step_s"]
except (OSError, ValueError, KeyError):
    solve = None
rows = []
for i in (1, 2, 3):
    try:
        d = json.load(open(os.path.join(out, f"tune{i}.json")))
    except (OSError, ValueError):
        print(f"tune{i}: no result"); continue
    rep = d.get("tune") or []
    win = [r for r in rep if r["chosen"]]
    pick = win[0]["measured_step_s"] if win else None
    rows.append({"run": i, "chosen": win[0]["candidate"] if win else None, "is_solvers": bool(rep and rep[0]["chosen"]),
                 "chosen_measured_s": pick, "vs_solver_alone": pick / solve if pick and solve else None,
                 "last_steps_s": d["step_times_s"][-3:],  # after the move back to the pick: its warm-up steps
                 "trials": [(r["candidate"], r["measured_step_s"], r["interval_s"], len(r["step_times_s"]))
                            for r in rep]})
print(f"solver's plan alone (solve.json): median step {solve} s")
print("| run | chosen | the solver's? | its trial median s | / solver's plan alone |")
print("|---|---|---|---|---|")
for r in rows:
    ratio = f"{r['vs_solver_alone']:.3f}" if r["vs_solver_alone"] else "-"
    print(f"| tune{r['run']} | {r['chosen']} | {r['is_solvers']} | {r['chosen_measured_s']:.3f} | {ratio} |")
    for t in r["trials"]:
        iv = "-" if t[2] is None else f"{t[2][0]:.3f}-{t[2][1]:.3f}"
        print(f"|   | trial {t[0]} | | {t[1]:.3f} (95 % interval {iv}, n={t[3]}) | |")
picks = [r["chosen_measured_s"] for r in rows if r["chosen_measured_s"]]
spread = max(picks) / min(picks) - 1 if picks else None
print(f"plans chosen: {sorted(set(r['chosen'] for r in rows))}; their trial medians' spread (max/min - 1): {spread}")
json.dump({"solver_alone_median_s": solve, "runs": rows, "picks_spread": spread},
          open(os.path.join(out, "tune_repeat.json"), "w"), indent=1)
PY
