#!/usr/bin/env bash
# Real jobs on one H200 (device tool nvidia-h200), DeepSpeed 0.19.8 wheels in .whl (../shared/tools/device_wheels.sh
# 0.19.8): a hub config (Qwen2.5-3B: its real max_position_embeddings 32768) trained with and without lins.seq_len;
# every weight read right after every step, as an EMA reads it, next to the same read after engine.lins.wait(), with
# the optimizer state and gradients on the host (40 GiB) and the parameters too (24 GiB); Qwen2.5-7B widths at 80 GiB
# with nothing but lins.gpu_memory_gb holding the allocator. seq 4096, micro-batch 2, gas 2, bf16, AdamW, clip 1.
#   run(command="OUT=$OUT bash bench/gpu_real_jobs.sh [RUN...]", carry=[".whl"])   (RUN: the names below; default all)
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
Q3=bench/models/hub-qwen2.5-3b.json Q7=bench/models/hub-qwen2.5-7b.json
WANT=" ${*:-q3b_seq_given q3b_hub_config q3b_40_reads q3b_24_reads q7b_80} "
one() {  # one(name, args...): a one-GPU run of bench.train, its summary in $OUT/name.json
  local name=$1; shift
  [[ "$WANT" == *" $name "* ]] || return 0
  timeout 420 torchrun --nproc_per_node 1 --master_port 29517 -m bench.train --deepspeed_config ds_configs/lins.json \
    --seq-len 4096 --micro-batch-size 2 --grad-accum 2 --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"; grep -E "^step|lins: the|no plan|Error|error:" "$OUT/$name.log" | tail -4
}
one q3b_seq_given --model $Q3 --steps 8 --warmup-steps 3
one q3b_hub_config --model $Q3 --steps 8 --warmup-steps 3 --lins-seq-len null
one q3b_40_reads --model $Q3 --steps 5 --warmup-steps 2 --lins-seq-len null --lins-memory-gb 40 --read-after-step
one q3b_24_reads --model $Q3 --steps 4 --warmup-steps 2 --lins-seq-len null --lins-memory-gb 24 --read-after-step
one q7b_80 --model $Q7 --steps 4 --warmup-steps 2 --lins-seq-len null --lins-memory-gb 80
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = []
for name in ("q3b_seq_given", "q3b_hub_config", "q3b_40_reads", "q3b_24_reads", "q7b_80"):
    try:
        d = json.load(open(os.path.join(out, name + ".json")))
    except (OSError, ValueError):
        print(f"| {name} | failed |"); continue
    p = d["plan"] or {}
    reads = d.get("reads_after_step") or []
    rows.append(name)
    print(f"| {name} | seq planned {d.get('planned_seq_len')} | step {d['median_step_s']:.3f} s | peak {d['peak_memory_gb']:.2f} GiB "
          f"(predicted {p.get('predicted_peak_gb', 0):.2f}) | reserved {d['peak_reserved_gb']:.2f} GiB | ckpt "
          f"{p.get('activation_checkpointing_units')}/{p.get('num_layers')} offload {p.get('offload_units')} "
          f"G {p.get('offload_grads')} P {p.get('offload_params')} | reads equal after wait: "
          f"{all(r['read'] == r['after_wait'] for r in reads) if reads else '-'} "
          f"({len(reads)} steps; empty outside forward {reads[0]['empty_outside_forward'] if reads else '-'}) |")
PY
tar czf "$OUT/real_jobs_logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) 2>/dev/null
