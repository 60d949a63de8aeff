#!/usr/bin/env bash
# The simulator's calibration grid (issue 17, bench/results/simulate/README.md): every mode on one host and
# on 2 emulated nodes, for each model size named (1b, 7b), DeepSpeed 0.19.6 from .whl/ (the last with MiCS).
# One size per device call (each fits its 10 minutes); results come back as one tarball per size.
#   bash bench/gpu_simulate.sh 1b      # then: tar xzf sim_1b.tgz -C bench/results/simulate/<lease>/
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
MODES=zero0,zero1,zero2,zero3,zeropp,mics,lins
for size in "$@"; do
  case $size in
    1b) args="--micro-batch-size 2 --grad-accum 2 --steps 5 --warmup-steps 2 --loss-steps 5";;
    7b) args="--micro-batch-size 1 --grad-accum 2 --steps 3 --warmup-steps 1 --loss-steps 3";;
    *) echo "gpu_simulate.sh: unknown size $size (1b or 7b)"; exit 2;;
  esac
  dir=$(mktemp -d)/sim_$size
  timeout ${BENCH_TIMEOUT:-540} python3 -m lins_ds.cli bench --model "$size" --seq-len 2048 $args \
      --modes $MODES --topologies host,emulated --out "$dir" 2>&1 | grep -vE "Warning|warn\(" | tail -40
  tar czf "$OUT/sim_$size.tgz" -C "$(dirname "$dir")" "sim_$size"
done
