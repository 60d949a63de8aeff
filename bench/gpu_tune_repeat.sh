#!/usr/bin/env bash
# Does "plan": "tune" repeat itself? One H200 (device tool nvidia-h200; DeepSpeed 0.19.8 wheels in .whl from
# ../shared/tools/device_wheels.sh 0.19.8): Qwen2.5-3B widths at 40 GiB (seq 4096, micro-batch 2, gas 2, bf16, AdamW,
# clip 1, offload "auto"), tuned three times, each with a fresh decision cache (the profiles are shared: they are
# measurements of the machine, not decisions), 3 candidates, each timed until its median step is known to +-3 %
# (lins.tune defaults, max_steps 8 to bound the run). The solver's plan run alone is bench/gpu_one_gpu_limit.sh's
# q3_lins40.
#   run(command="OUT=$OUT bash bench/gpu_tune_repeat.sh", carry=[".whl"])
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
Q3=bench/models/hub-qwen2.5-3b.json
for i in 1 2 3; do
  cache="$OUT/cache$i"; mkdir -p "$cache"
  [ "$i" -gt 1 ] && cp "$OUT/cache1/"*.json "$cache/" 2>/dev/null && rm -f "$cache"/tune-*.json
  timeout 165 torchrun --nproc_per_node 1 --master_port 29519 -m bench.train --deepspeed_config ds_configs/lins_tune.json \
    --model $Q3 --seq-len 4096 --micro-batch-size 2 --grad-accum 2 --lins-memory-gb 40 --steps 27 --warmup-steps 24 \
    --lins-tune '{"candidates": 3, "steps": 3, "max_steps": 8}' --lins-profile-cache "$cache" \
    --out "$OUT/tune$i.json" > "$OUT/tune$i.log" 2>&1
  echo "== tune$i rc=$?"; grep -A6 "^lins tune:" "$OUT/tune$i.log" | head -8; grep -E "^step" "$OUT/tune$i.log" | tail -3
done
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = []
for i in (1, 2, 3):
    try:
        d = json.load(open(os.path.join(out, f"tune{i}.json")))
    except (OSError, ValueError):
        print(f"tune{i}: failed"); continue
    rep = d.get("tune") or []
    win = [r for r in rep if r["chosen"]]
    after = d["step_times_s"][-3:]
    rows.append({"run": i, "chosen": win[0]["candidate"] if win else None,
                 "chosen_measured_s": win[0]["measured_step_s"] if win else None,
                 "solver_measured_s": rep[0]["measured_step_s"] if rep else None,
                 "last_steps_s": after, "trials": [(r["candidate"], r["measured_step_s"], r["interval_s"],
                                                    len(r["step_times_s"])) for r in rep]})
    print(rows[-1])
json.dump(rows, open(os.path.join(out, "tune_repeat.json"), "w"), indent=1)
PY
