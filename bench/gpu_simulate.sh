#!/usr/bin/env bash
# The simulator's calibration grid (issue 17, bench/results/simulate/README.md): every mode on one host and
# on 2 emulated nodes, for each model size named (1b, 7b), DeepSpeed 0.19.6 from .whl/ (the last with MiCS).
# One size per device call (each fits its 10 minutes); results come back as one tarball per size.
#   bash bench/gpu_simulate.sh 1b      # then: tar xzf sim_1b.tgz -C bench/results/simulate/<lease>/
# "1b-loaded": the one-host 1B runs of ZeRO-1, the ZeRO-3 family and Lins while every core also runs a busy loop
# (a slower host, measured by each run's lins_ds.profiler.host probe: what the simulator's fetch cost scales by).
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
MODES=zero0,zero1,zero2,zero3,zeropp,mics,lins
for size in "$@"; do
  case $size in
    1b) args="--micro-batch-size 2 --grad-accum 2 --steps 5 --warmup-steps 2 --loss-steps 5"
        grid="--modes $MODES --topologies host,emulated";;
    7b) args="--micro-batch-size 1 --grad-accum 2 --steps 3 --warmup-steps 1 --loss-steps 3"
        grid="--modes $MODES --topologies host,emulated";;
    1b-loaded) args="--micro-batch-size 2 --grad-accum 2 --steps 5 --warmup-steps 2 --loss-steps 5"
        grid="--modes zero1,zero3,zeropp,mics,lins --topologies host --no-no-comm-limit"
        for _ in $(seq "$(nproc)"); do python3 -c "while True: pass" & done;;
    *) echo "gpu_simulate.sh: unknown size $size (1b, 7b or 1b-loaded)"; exit 2;;
  esac
  dir=$(mktemp -d)/sim_$size
  timeout ${BENCH_TIMEOUT:-540} python3 -m lins_ds.cli bench --model "${size%-loaded}" --seq-len 2048 $args \
      $grid --out "$dir" 2>&1 | grep -vE "Warning|warn\(" | tail -40
  [ "$size" = 1b-loaded ] && { kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; }
  python3 - "$dir" <<'PY'  # the host probe per run, next to the step
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*_*.json"))):
    r = json.load(open(f))
    if "host_s_per_module" in r:
        print(f"{os.path.basename(f):24s} step {r['median_step_s']:.3f} s  host {1e6 * r['host_s_per_module']:.1f} us/module")
PY
  tar czf "$OUT/sim_$size.tgz" -C "$(dirname "$dir")" "sim_$size"
done
