#!/usr/bin/env bash
# Issue 31 on one H200 (device tool, nvidia-h200), one call:
#  1. memory: LLaMA h3072 x 24 (2.92 B), seq 4096, micro-batch 2, gas 1, bf16, AdamW, clip 1: DeepSpeed ZeRO-1
#     next to Lins' replicated layout (P=G=OS=1x1), peak allocated after start-up and Lins' prediction;
#  2. start-up: 7B built under lins_ds.init on one GPU, lins.init "eager" against "per_module";
#  3. the eager init's CPU cost for 7B (bench/init_cost.py).
# Usage: bash bench/gpu_memory_startup.sh [memory|startup] (both when no argument); writes $OUT/*.json.
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
tr() { torchrun --nproc_per_node 1 --master_port $((29500 + RANDOM % 500)) -m bench.train "$@"; }
M=bench/models/llama-2.9b.json
part=${1:-all}
[ "$part" = startup ] || for cfg in zero1 lins_replicated; do
  tr --deepspeed_config ds_configs/$cfg.json --model $M --seq-len 4096 --micro-batch-size 2 --grad-accum 1 \
     --steps 6 --warmup-steps 2 --out "$OUT/mem_$cfg.json" 2>&1 | grep -E "^step|Lins plan|predicted|rror" | tail -5
done
[ "$part" = memory ] || for init in per_module eager; do
  tr --deepspeed_config ds_configs/lins_replicated.json --model 7b --seq-len 512 --micro-batch-size 1 --grad-accum 1 \
     --steps 2 --warmup-steps 1 --lins-init $init --out "$OUT/init7b_$init.json" 2>&1 | grep -E "^step|start-up|rror" | tail -3
done
[ "$part" = memory ] || python3 -m bench init-cost --model 7b 2>&1 | grep -E "^\{|rror" | tee "$OUT/init_cost.jsonl"
