#!/usr/bin/env bash
# Issue 13 on the device tool's nvidia-h200-x2 (2 x H200), DeepSpeed 0.19.6 wheels in .whl: a 13B LLaMA with
# ZeRO-3's layout, built under lins_ds.init, next to DeepSpeed ZeRO-3 built under deepspeed.zero.Init: start-up
# wall time, peak GPU and host memory during start-up, then 5 training steps. Results in $OUT (init.json).
set -uo pipefail
OUT=${OUT:-bench/out}; W=bench/out/init; mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m bench run --model 13b --seq-len 2048 --micro-batch-size 1 --grad-accum 1 --steps 6 --warmup-steps 1 \
  --loss-steps 6 --modes zero3,lins_as_zero3 --topologies host --no-no-comm-limit --out "$W" 2>&1 \
  | grep -E "^\[bench\]|^mode|^(zero3|lins_as_zero3) |start-up|Error"
cp "$W/bench.json" "$OUT/init.json" 2>/dev/null; cp "$W/host_zero3.json" "$W/host_lins_as_zero3.json" "$OUT/" 2>/dev/null
