#!/usr/bin/env bash
# Issue 12 on the device tool's nvidia-h200-x2 (2 x H200, one host), DeepSpeed 0.19.6 wheels in .whl:
# predicted next to measured peak memory for Lins (ZeRO-1's and ZeRO-3's layouts, partial checkpointing, the
# solver at 80 GiB) and DeepSpeed ZeRO-1 / ZeRO-3 on the same model and batch. Usage (device tool):
#   run(command="bash bench/gpu_memory.sh 1b", carry=[".whl"])   or   ... 7b [RUNS]
set -uo pipefail
MODEL=${1:-1b}; RUNS=${2:-}
OUT=${OUT:-bench/out}; W=bench/out/memory_$MODEL; mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
if [ "$MODEL" = 7b ]; then BATCH="--micro-batch-size 1 --grad-accum 4 --steps 3 --budget-gb 80"
else BATCH="--micro-batch-size 2 --grad-accum 4 --steps 4"; fi
python3 -m bench memory --model "$MODEL" --seq-len 2048 $BATCH ${RUNS:+--runs $RUNS} --out "$W" 2>&1 \
  | grep -v "Warning\|warn(" | grep -E "^\[|^run|^[a-z0-9-]+ +(DeepSpeed|P=)|memory-bench|Error" 
cp "$W/$MODEL.json" "$W/$MODEL.png" "$OUT/" 2>/dev/null
tar czf "$OUT/memory_$MODEL.tgz" -C "$W" .
