#!/usr/bin/env bash
# The benchmark of issue 7 on the device tool's nvidia-h200-x2 (2 x H200, one host), in one call:
# every DeepSpeed mode and Lins on one host and as 2 emulated nodes, a memory-bound Lins run, loss
# curves, and the emulated-node profile with its prediction error. Results land in $OUT (bench.tgz).
set -uo pipefail
OUT=${OUT:-bench/out}; W=bench/out/run; mkdir -p "$OUT" "$W"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m bench run --model 1b --seq-len 2048 --micro-batch-size 2 --grad-accum 2 --steps 10 \
    --warmup-steps 3 --loss-steps 50 --memory-budget-gb 22 --out "$W" 2>&1 | grep -v "Warning\|warn("
NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4 torchrun --nproc_per_node 2 -m bench profile \
    --gpus-per-node 1 --out "$W/profile_2nodes.json" --validate --model llama-1b --seq-len 2048 \
    --micro-batch-size 2 --grad-accum 2 2>&1 | grep -E "prediction vs|measured "
cp "$W/bench.json" "$W/throughput.png" "$W/loss.png" "$OUT/" 2>/dev/null
tar czf "$OUT/bench.tgz" -C "$W" .
