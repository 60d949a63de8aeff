#!/usr/bin/env bash
# Issue 28 ("plan": "tune") on one H200 (device tool, nvidia-h200). DeepSpeed 0.19.8 from .whl (carry it).
# Usage: OUT=<dir> bash bench/gpu_tune.sh [tune40] [again40] [tune60] [again60]; writes $OUT/<run>.json/.log,
# $OUT/log.txt and the decisions cached in $OUT/cache, then one archive of them all.
#  LLaMA h3072 x 24 (2.92 B), seq 4096, micro-batch 2, gas 2, bf16, AdamW, clip 1; the solver picks activation
#  checkpointing (no --checkpointing: Lins decides the depth) and, where no GPU-resident plan fits, offload.
#  tune40   "gpu_memory_gb": 40 (GPU-resident needs ~53: offload and checkpointing traded), 4 candidates x 4 steps,
#           more until timed to +-3 % (lins.tune's max_steps, 12 each): up to 48 steps of trials, so 60 steps a run
#           (20 before the trials became adaptive ended inside the trials, and nothing was cached for again40)
#  again40  the same job again: the cached decision, no trials (the winner's step, untuned)
#  tune60   "gpu_memory_gb": 60 (checkpointing depth and a little offload traded), 4 candidates x 4 steps
#  again60  the same job again
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
run() {  # run <name> <timeout s> <bench.train args...>
  local name=$1 limit=$2; shift 2
  echo "== $name" | tee -a "$OUT/log.txt"
  timeout "$limit" torchrun --nproc_per_node 1 --master_port $((29500 + RANDOM % 500)) -m bench.train "$@" \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "rc $?" >> "$OUT/$name.log"
  grep -E "^step|Lins plan|tune|^ +[0-9] P=|activation checkpointing:|optimizer state on|lins memory|lins start-up|Error|error:|Killed|rc " \
    "$OUT/$name.log" | tail -24 | tee -a "$OUT/log.txt"
}
B3=(--model bench/models/llama-2.9b.json --seq-len 4096 --micro-batch-size 2 --grad-accum 2 --lins-init per_module
    --deepspeed_config ds_configs/lins_tune.json --lins-tune '{"candidates": 4, "steps": 4}'
    --lins-profile-cache "$OUT/cache")
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(tune40 again40 tune60 again60)
for part in "${parts[@]}"; do
  case $part in
  tune40) run tune40 330 "${B3[@]}" --lins-memory-gb 40 --steps 60 --warmup-steps 54 ;;
  again40) run again40 200 "${B3[@]}" --lins-memory-gb 40 --steps 8 --warmup-steps 3 ;;
  tune60) run tune60 330 "${B3[@]}" --lins-memory-gb 60 --steps 60 --warmup-steps 54 ;;
  again60) run again60 200 "${B3[@]}" --lins-memory-gb 60 --steps 8 --warmup-steps 3 ;;
  esac
done
free -g | tee -a "$OUT/log.txt"
tar -czf "$OUT/issue28_$(date +%H%M%S).tar.gz" -C "$OUT" $(cd "$OUT" && ls *.json *.log log.txt 2>/dev/null) cache \
  && (cd "$OUT" && rm -f *.json *.log)
