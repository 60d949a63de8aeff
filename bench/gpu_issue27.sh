#!/usr/bin/env bash
# Issue 27 (the simulator's compute from the model's shape) on one H200 (device tool, nvidia-h200), DeepSpeed 0.19.8
# from .whl (carry it). Usage: OUT=<dir> bash bench/gpu_issue27.sh
#  1. the compute table of this GPU: python -m lins_ds.profiler.compute (GEMMs, attention, bandwidth)
#  2. a grid of LLaMA shapes (bench/models/shape-*.json; hidden 1024-5120, seq 1024-8192, micro-batch 1-4, with
#     and without every layer checkpointed), each under DeepSpeed ZeRO-1 and Lins, 6 steps (median of the last 4),
#     gas 1, bf16, AdamW; the reference shape (h1024, seq 2048, mb 4) first and again last: a slower machine
#     shows as such.
# Everything lands in $OUT/issue27.tar (appended after each run: a call cut short keeps what it measured).
# ONLY="s9:lins ref2:zero1 ..." runs just those (a second call for what the first did not reach; no compute table).
# GRID=2 or GRID=3: a further 7 shapes each (about 550 s a call), the reference shape first (no compute table).
# GRID=4 MODES=zero1 STEPS=16 WARMUP=4: ZeRO-1 again on the shapes it was held worst on, timed over 12 steps.
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
keep() { tar -rf "$OUT/issue27.tar" -C "$OUT" "$@" && (cd "$OUT" && rm -f "$@"); }
if [ -z "${ONLY:-}" ] && [ "${GRID:-1}" = 1 ]; then
  timeout 240 python -m lins_ds.profiler.compute --out "$OUT/compute_h200.json" 2>&1 | tail -1 | tee -a "$OUT/log.txt"
  keep compute_h200.json
fi
run() {  # run <name> <mode> <model> <seq> <mb> [--checkpointing]
  local name=$1 mode=$2 model=$3 seq=$4 mb=$5; shift 5
  local extra=(); [ "$mode" = lins ] && extra=(--lins-memory-gb 130 --lins-init per_module)
  [ "$mode" = lins ] && [ "${1:-}" != --checkpointing ] && extra+=(--lins-checkpointing false)
  timeout 120 torchrun --nproc_per_node 1 --master_port $((29500 + RANDOM % 500)) -m bench.train \
    --deepspeed_config "ds_configs/$mode.json" --model "bench/models/$model.json" --seq-len "$seq" \
    --micro-batch-size "$mb" --grad-accum 1 --steps "${STEPS:-6}" --warmup-steps "${WARMUP:-2}" "$@" "${extra[@]}" \
    --out "$OUT/${name}_$mode.json" > "$OUT/${name}_$mode.log" 2>&1
  echo "$name $mode rc $? $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('step %.4f s peak %.2f GiB' % (r['median_step_s'], r['peak_memory_gb']))" "$OUT/${name}_$mode.json" 2>/dev/null)" | tee -a "$OUT/log.txt"
  keep $(cd "$OUT" && ls "${name}_$mode".* 2>/dev/null)
}
case "${GRID:-1}" in
  1) SHAPES=(
    "ref shape-h1024-l16 2048 4"
    "s2 shape-h2048-l12 4096 2"
    "s3 shape-h3072-l8 1024 4"
    "s4 shape-h4096-l6 2048 2 --checkpointing"
    "s5 shape-h5120-l8 4096 1"
    "s6 shape-h2560-l8 8192 1 --checkpointing"
    "s7 shape-h1536-l12 4096 2 --checkpointing"
    "s8 shape-h4096-l4 8192 1"
    "s9 shape-h5120-l8 2048 2 --checkpointing"
    "ref2 shape-h1024-l16 2048 4"
  ) ;;
  2) SHAPES=(  # shapes the first grid's fit never saw, two of them with grouped KV heads; the reference first
    "ref3 shape-h1024-l16 2048 4"
    "n1 shape-h1024-l24 4096 2"
    "n2 shape-h1536-l16 1024 4"
    "n3 shape-h2048-l8 8192 1 --checkpointing"
    "n4 shape-h2560-l12-kv4 2048 2"
    "n5 shape-h3072-l12 4096 1 --checkpointing"
    "n6 shape-h3584-l8 2048 4 --checkpointing"
    "n7 shape-h5120-l6-kv8 1024 4"
  ) ;;
  3) SHAPES=(
    "ref4 shape-h1024-l16 2048 4"
    "n8 shape-h1024-l8 8192 2"
    "n9 shape-h2048-l16-kv4 2048 4 --checkpointing"
    "n10 shape-h3072-l6 8192 1"
    "n11 shape-h4096-l10 1024 2"
    "n12 shape-h2560-l16 4096 1"
    "n13 shape-h1536-l24 2048 2 --checkpointing"
    "n14 shape-h4096-l8-kv8 4096 2 --checkpointing"
  ) ;;
  4) SHAPES=(  # the grid's worst-held DeepSpeed ZeRO-1 shapes again (MODES=zero1 STEPS=16): noise or model?
    "ref5 shape-h1024-l16 2048 4"
    "n12b shape-h2560-l16 4096 1"
    "n11b shape-h4096-l10 1024 2"
    "n4b shape-h2560-l12-kv4 2048 2"
    "s3b shape-h3072-l8 1024 4"
    "s2b shape-h2048-l12 4096 2"
    "n9b shape-h2048-l16-kv4 2048 4 --checkpointing"
    "n13b shape-h1536-l24 2048 2 --checkpointing"
    "n1b shape-h1024-l24 4096 2"
    "n5b shape-h3072-l12 4096 1 --checkpointing"
    "s8b shape-h4096-l4 8192 1"
    "n2b shape-h1536-l16 1024 4"
    "n8b shape-h1024-l8 8192 2"
    "ref6 shape-h1024-l16 2048 4"
  ) ;;
  *) echo "GRID=${GRID}: 1, 2, 3 or 4" >&2; exit 2 ;;
esac
for s in "${SHAPES[@]}"; do
  read -r name model seq mb ck <<< "$s"
  for mode in ${MODES:-zero1 lins}; do
    [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name:$mode "* ]] && continue
    run "$name" "$mode" "$model" "$seq" "$mb" $ck
  done
done
keep log.txt
