#!/usr/bin/env bash
# Issue 60 on one GPU (device tool, nvidia-h100-x1 or nvidia-h200; DeepSpeed 0.19.8 from .whl, carry it): the longest
# sequence per card with sequence tiling planned, Llama-3-8B widths, bf16, AdamW, clip 1, one sequence per step
# (micro-batch 1, gas 1), 3 steps (1 untimed), the logits held through the backward where untiled (the loop the
# memory probe models). From the config alone: ds_configs/lins_offload.json ("offload": "auto"), lins.tiling "auto"
# (the default) or false, lins.seq_len fixed at each length. Parts (all by default; each a list of lengths):
#   plain   the plain PyTorch loop (bench/plain.py) with HF gradient checkpointing, at each length until it runs out
#           of memory
#   untiled Lins with "tiling": false
#   tiled   Lins with "tiling": "auto" (and "activation_offload": "auto", the default)
#   logits8 Lins with "tiling": {"logits": 8} fixed, whether needed or not (the tiled head's memory model checked on
#           another model, e.g. MODEL=bench/models/family-llama3-h2048-l16-v128256.json)
#   act     Lins with "activation_offload": ACT_LAYERS (16 by default) fixed: the inputs of that many checkpointed layers
#           on the host whether needed or not (the memory model and the runtime's copies measured at any length)
#   alst    DeepSpeed's ALST single-GPU recipe (bench/alst.py, ds_configs/alst_offload.json): ZeRO-3 with parameters and
#           optimizer on the host, TiledMLP, tiled logits+loss, checkpointing with its inputs on the host, and the
#           recipe's PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#   plan    `lins-ds plan --longest` for the same model and card, tiled and not (no GPU work)
# MODEL (default bench/models/hub-llama3-8b.json) picks the model, RUN_LIMIT (s) caps each run, STEPS and WARMUP
# (3, 1) the steps, LENGTHS (default "8192 16384 32768 65536 131072") the lengths. Writes $OUT/<part>_<len>.json/.log and
# $OUT/long_context.json (per run: rc, median step, tokens/s, predicted and measured peak, the plan's tiles).
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
M=(--model "${MODEL:-bench/models/hub-llama3-8b.json}" --micro-batch-size 1 --grad-accum 1 --steps "${STEPS:-3}"
   --warmup-steps "${WARMUP:-1}" --lins-init per_module)
run() {  # run <name> <timeout s> <bench.train args...>
  local name=$1 limit=${RUN_LIMIT:-$2}; shift 2
  echo "== $name" | tee -a "$OUT/log.txt"
  timeout "$limit" torchrun --nproc_per_node 1 --master_port $((29500 + RANDOM % 500)) -m bench.train "${M[@]}" \
    --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "rc $?" >> "$OUT/$name.log"
  grep -E "^step|^alst:|sequence tiling|activation offload|checkpointed|on the host|lins memory|OutOfMemory|NoPlanFits|rc " \
    "$OUT/$name.log" | tail -8 | tee -a "$OUT/log.txt"
}
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(plan plain untiled tiled alst)
for part in "${parts[@]}"; do
  for n in ${LENGTHS:-8192 16384 32768 65536 131072}; do
    case $part in
      plain) run "plain_$n" 300 --plain --checkpointing --deepspeed_config ds_configs/zero0.json --seq-len "$n" \
               --hold-outputs ;;
      untiled) run "untiled_$n" 400 --deepspeed_config ds_configs/lins_offload.json --seq-len "$n" --hold-outputs \
                 --ds-set 'lins.tiling=false' ;;
      tiled) run "tiled_$n" 400 --deepspeed_config ds_configs/lins_offload.json --seq-len "$n" --hold-outputs ;;
      logits8) run "logits8_$n" 400 --deepspeed_config ds_configs/lins_offload.json --seq-len "$n" --hold-outputs \
                 --ds-set 'lins.tiling={"logits": 8}' ;;
      act) run "act_$n" 400 --deepspeed_config ds_configs/lins_offload.json --seq-len "$n" --hold-outputs \
             --ds-set "lins.activation_offload=${ACT_LAYERS:-16}" ;;
      alst) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
              run "alst_$n" 400 --alst --deepspeed_config ds_configs/alst_offload.json --seq-len "$n" ;;
      plan) for t in off auto; do
              python3 -m lins_ds.cli plan --model "${MODEL:-bench/models/hub-llama3-8b.json}" --nodes 1 --gpus-per-node 1 \
                --gpu-memory-gb "$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**30)')" \
                --host-memory-gb 100 --micro-batch-size 1 --seq-len 8192 --tiling "$t" --longest --format json \
                > "$OUT/plan_$t.json" 2>> "$OUT/log.txt"
            done; break ;;
    esac
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out, rows = sys.argv[1], []
for f in sorted(glob.glob(os.path.join(out, "*_*.json"))):
    name = os.path.basename(f)[:-5]
    if name.startswith("plan_") or name == "long_context":
        continue
    try:
        r = json.load(open(f))
    except ValueError:
        continue
    plan = r.get("plan") or {}
    rows.append({"run": name, "seq_len": r.get("seq_len"), "median_step_s": r.get("median_step_s"),
                 "tokens_per_s": r.get("tokens_per_gpu_s"), "measured_peak_gb": r.get("peak_memory_gb"),
                 "predicted_peak_gb": plan.get("predicted_peak_gb"), "mlp_tiles": plan.get("mlp_tiles", 1),
                 "logits_tiles": plan.get("logits_tiles", 1), "offload_units": plan.get("offload_units"),
                 "host_peak_gb": (r.get("host_memory") or {}).get("peak_gb"), "alst": r.get("alst"),
                 "activation_offload": r.get("activation_offload"), "rc_ok": r.get("median_step_s") is not None})
for row in rows:
    print(row)
json.dump(rows, open(os.path.join(out, "long_context.json"), "w"), indent=1)
PY
