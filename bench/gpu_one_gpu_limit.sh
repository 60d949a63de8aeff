#!/usr/bin/env bash
# One GPU at the limit (one H200, device tool nvidia-h200; DeepSpeed 0.19.8 wheels in .whl from
# ../shared/tools/device_wheels.sh 0.19.8): Qwen2.5-3B widths, seq 4096, micro-batch 2, gas 2, bf16, AdamW, clip 1,
# the same script for every mode: a plain PyTorch loop (bench/plain.py), Lins resident (the solver's plan at the full
# card), DeepSpeed ZeRO-1, each with a torch.profiler summary of two steps after warm-up; then Lins at 40 GiB (the
# optimizer state of most units on the host), with what the training thread waited for the host in every step; the
# same for a 2.9B LLaMA (plain and Lins). ZeRO-1 twice: the config's optimizer (torch's multi-tensor AdamW) and with
# "fused": true (the kernel Lins takes for a torch Adam left open). TRACE=1: a torch.profiler summary per run.
#   run(command="OUT=$OUT bash bench/gpu_one_gpu_limit.sh [RUN...]", carry=[".whl"])   (RUN: names below; default all)
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
Q3=bench/models/hub-qwen2.5-3b.json L3=bench/models/llama-2.9b.json
WANT=" ${*:-q3_plain q3_lins q3_zero1 q3_zero1_fused l3_plain l3_lins q3_lins40} "
one() {  # one(name, config, model, args...): a one-GPU run of bench.train, its summary in $OUT/name.json
  local name=$1 cfg=$2 model=$3; shift 3
  [[ "$WANT" == *" $name "* ]] || return 0
  timeout 300 torchrun --nproc_per_node 1 --master_port 29518 -m bench.train --deepspeed_config "$cfg" \
    --model $model --seq-len 4096 --micro-batch-size 2 --grad-accum 2 --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"; grep -E "^step|no plan|Error|error:" "$OUT/$name.log" | tail -3
}
T="--steps 10 --warmup-steps 3"
tr() { [ -n "${TRACE:-}" ] && echo "--trace-summary $OUT/$1_trace.txt"; }
one q3_plain ds_configs/zero0.json $Q3 --plain $T $(tr q3_plain)
one q3_lins ds_configs/lins.json $Q3 $T $(tr q3_lins)
one q3_zero1 ds_configs/zero1.json $Q3 $T $(tr q3_zero1)
one q3_zero1_fused ds_configs/zero1.json $Q3 $T --ds-set optimizer.params.fused=true $(tr q3_zero1_fused)
one l3_plain ds_configs/zero0.json $L3 --plain $T $(tr l3_plain)
one l3_lins ds_configs/lins.json $L3 $T $(tr l3_lins)
one q3_lins40 ds_configs/lins.json $Q3 --steps 10 --warmup-steps 3 --lins-memory-gb 40
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
runs = {}
for name in ("q3_plain", "q3_lins", "q3_zero1", "q3_zero1_fused", "l3_plain", "l3_lins", "q3_lins40"):
    try:
        runs[name] = json.load(open(os.path.join(out, name + ".json")))
    except (OSError, ValueError):
        print(f"| {name} | failed |")
summary = {}
for name, d in runs.items():
    base = runs.get(name[:2] + "_plain", {}).get("median_step_s")
    p = d.get("plan") or {}
    t = d["median_step_s"]
    after = d["step_times_s"][d["warmup_steps"]:]
    summary[name] = {"median_step_s": t, "x_plain": base / t if base else None, "peak_gb": d["peak_memory_gb"],
                     "predicted_peak_gb": p.get("predicted_peak_gb"), "max_over_median": max(after) / t,
                     "losses": d["losses"], "step_times_s": d["step_times_s"], "host_steps": d.get("host_steps")}
    print(f"| {name} | step {t:.3f} s | x plain {base / t if base else float('nan'):.3f} | peak {d['peak_memory_gb']:.2f} GiB "
          f"(pred {p.get('predicted_peak_gb', 0):.2f}) | losses {[round(x, 4) for x in d['losses'][:4]]} | "
          f"steps {[round(x, 2) for x in d['step_times_s']]} | max/median after warm-up {max(after) / t:.3f} |")
    for i, h in enumerate(d.get("host_steps") or []):
        print(f"    step {i + 1}: waited {h['waited_s']:.3f} s, worker {h['worker_s']:.3f} s {h['worker_spent_s']}")
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
PY
