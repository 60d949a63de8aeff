#!/usr/bin/env bash
# The simulator's calibration grid (issue 17, bench/results/simulate/README.md): every mode on one host and
# on 2 emulated nodes, for each model size named (1b, 7b), DeepSpeed 0.19.6 from .whl/ (the last with MiCS).
# One size per device call (each fits its 10 minutes); results come back as one tarball per size.
#   bash bench/gpu_simulate.sh 1b      # then: tar xzf sim_1b.tgz -C bench/results/simulate/<lease>/
# "1b-loaded": the one-host 1B runs of ZeRO-1, the ZeRO-3 family and Lins while every core also runs a busy loop
# (a slower host, measured by each run's bench/host.py probe: what the simulator's fetch cost scales by).
# "1b-1gpu": every mode on ONE GPU (one rank: DeepSpeed's stage-3 fetches gather nothing, only their hooks run, so
# ZeRO-3 minus ZeRO-0 is the hooks' cost alone); "1b-1gpu-half" / "1b-1gpu-loaded": ZeRO-0, ZeRO-3 and MiCS there
# with half / all of the cores also running a busy loop (does the hooks' cost follow the host probe?).
# "wide-1gpu": ZeRO-0, ZeRO-3 and MiCS on one GPU with 7B's modules, 8 layers (bench/models/): does a fetch of a
# 4x larger module cost more when nothing is gathered (host copies), or is the per-byte cost the gather's wait?
# "trace-2gpu": torch.profiler summaries of ZeRO-3, ZeRO++ and MiCS on 2 GPUs of one host, 1B (where their
# two-rank work goes: hpZ's secondary copies, MiCS's coalesced gathers), each run with its host probe.
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
MODES=zero0,zero1,zero2,zero3,zeropp,mics,lins
STEPS_1B="--micro-batch-size 2 --grad-accum 2 --steps 5 --warmup-steps 2"  # bench/train.py's too
ARGS_1B="$STEPS_1B --loss-steps 5"
ONE_GPU="--topologies host --nproc 1 --no-no-comm-limit"
busy_loops() { for _ in $(seq "$1"); do python3 -c "while True: pass" & done; }
show() {  # the host probe per run, next to the step
  python3 - "$1" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*_*.json"))):
    r = json.load(open(f))
    if "host_s_per_module" in r:
        print(f"{os.path.basename(f):24s} step {r['median_step_s']:.3f} s  host {1e6 * r['host_s_per_module']:.1f} us/module")
PY
}
pack() {  # $1 = .../sim_<size> into $OUT/sim_<size>.tgz; run again into the same $OUT: sim_<size>_2.tgz, ...
  local name tgz n=2; name=$(basename "$1"); tgz=$OUT/$name.tgz
  while [ -e "$tgz" ]; do tgz=$OUT/${name}_$n.tgz n=$((n + 1)); done
  tar czf "$tgz" -C "$(dirname "$1")" "$name"
}
for size in "$@"; do
  args=$ARGS_1B dir=$(mktemp -d)/sim_$size
  case $size in
    1b) grid="--modes $MODES --topologies host,emulated";;
    7b) args="--micro-batch-size 1 --grad-accum 2 --steps 3 --warmup-steps 1 --loss-steps 3"
        grid="--modes $MODES --topologies host,emulated";;
    1b-loaded) grid="--modes zero1,zero3,zeropp,mics,lins --topologies host --no-no-comm-limit"
        busy_loops "$(nproc)";;
    1b-1gpu) grid="--modes $MODES $ONE_GPU";;
    wide-1gpu) grid="--modes zero0,zero3,mics $ONE_GPU";;
    1b-1gpu-half) grid="--modes zero0,zero3,mics $ONE_GPU"; busy_loops $(($(nproc) / 2));;
    1b-1gpu-loaded) grid="--modes zero0,zero3,mics $ONE_GPU"; busy_loops "$(nproc)";;
    trace-2gpu) mkdir -p "$dir"
        for ds in zero3 zeropp mics; do  # --gpus-per-node 2: hpZ and MiCS groups of the host, as the bench's runs
          timeout 150 torchrun --nproc_per_node 2 -m bench.train --deepspeed_config ds_configs/$ds.json \
              --model 1b --seq-len 2048 $STEPS_1B --gpus-per-node 2 \
              --out "$dir/1b_$ds.json" --trace-summary "$dir/trace_1b_$ds.txt" \
              2>&1 | grep -vE "Warning|warn\(" | tail -3
        done
        show "$dir"; pack "$dir"; continue;;
    *) echo "gpu_simulate.sh: unknown size $size (1b, 7b, 1b-loaded, 1b-1gpu, 1b-1gpu-half, 1b-1gpu-loaded, wide-1gpu, trace-2gpu)"; exit 2;;
  esac
  model=${size%%-*}; [ "$model" = wide ] && model=bench/models/llama-7b-width-8-layers.json
  timeout ${BENCH_TIMEOUT:-540} python3 -m bench run --model "$model" --seq-len 2048 $args \
      $grid --out "$dir" 2>&1 | grep -vE "Warning|warn\(" | tail -40
  [ -n "$(jobs -p)" ] && { kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; }
  show "$dir"; pack "$dir"
done
