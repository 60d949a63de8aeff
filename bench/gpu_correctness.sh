#!/usr/bin/env bash
# GPU check of the engine and the profiler on one host of 2 GPUs (device tool, nvidia-h200-x2):
#  1. a ~1B LLaMA, bf16, 30 steps, same script and seed, under three Lins plans and DeepSpeed ZeRO-1;
#  2. lins-ds profile (full and quick) on one host and on 2 emulated nodes (docs/design.md §11, tuned sockets),
#     each with --validate (prediction vs measurement on the plans' real groups).
# Writes everything under $OUT (or ./bench/out).
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
STEPS=${STEPS:-30}
run() { torchrun --nproc_per_node 2 --master_port $((29500 + RANDOM % 1000)) "$@"; }
for cfg in zero1 lins_replicated lins_as_zero1 lins_as_zero3; do
  run -m bench.train --deepspeed_config ds_configs/$cfg.json --model 1b --seq-len 1024 \
      --steps "$STEPS" --out "$OUT/loss_$cfg.json" 2>&1 | grep -E "^step|Lins plan|Error|error" | tail -4
done
run -m bench profile --out "$OUT/profile_1host.json" --validate --model llama-1b --seq-len 1024 \
    --micro-batch-size 2 2>&1 | grep -v "^\[\|lins profile:" | tail -30
run -m bench profile --quick --out "$OUT/profile_1host_quick.json" 2>&1 | grep "measured"
export NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4
run -m bench profile --gpus-per-node 1 --out "$OUT/profile_2nodes.json" --validate --model llama-1b \
    --seq-len 1024 --micro-batch-size 2 2>&1 | grep -v "^\[\|lins profile:" | tail -30
run -m bench profile --gpus-per-node 1 --quick --out "$OUT/profile_2nodes_quick.json" 2>&1 | grep "measured"
