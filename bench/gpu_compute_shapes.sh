#!/usr/bin/env bash
# Issue 27 (the simulator's compute from the model's shape) on one H200 (device tool, nvidia-h200), DeepSpeed 0.19.8
# from .whl (carry it). Usage: OUT=<dir> bash bench/gpu_compute_shapes.sh
#  1. the compute table of this GPU: python -m bench.compute_profile (GEMMs, attention, bandwidth)
#  2. a grid of LLaMA shapes (bench/models/shape-*.json; hidden 1024-5120, seq 1024-8192, micro-batch 1-4, with
#     and without every layer checkpointed), each under DeepSpeed ZeRO-1 and Lins, 6 steps (median of the last 4),
#     gas 1, bf16, AdamW; the reference shape (h1024, seq 2048, mb 4) first and again last: a slower machine
#     shows as such.
# Everything lands in $OUT/issue27.tar (appended after each run: a call cut short keeps what it measured).
# ONLY="s9:lins ref2:zero1 ..." runs just those (a second call for what the first did not reach; no compute table).
# GRID=2 or GRID=3: a further 7 shapes each (about 550 s a call), the reference shape first (no compute table).
# GRID=4 MODES=zero1 STEPS=16 WARMUP=4: ZeRO-1 again on the shapes it was held worst on, timed over 12 steps.
# GRID=5/6 MODES=lins, GRID=7 MODES=zero1 (STEPS=20 WARMUP=4): every shape again on another machine.
# GRID=8, then GRID=9 (STEPS=30 WARMUP=4): two host-bound shapes, then the same pinned to four cores (PIN, a command
# put before torchrun; GRID=9's default "taskset -c 2-5"): does a step that waits for the host repeat when pinned?
# GRID=10-13 (STEPS=20 WARMUP=4): every shape a third time under both systems, on one more machine (GRID=12 and 13
# ran once with MODES=zero1 and once, on another machine, with MODES=lins).
# GRID=14 (STEPS=12 WARMUP=4): host-bound probes, by phase (--breakdown): sequence 128, with and without
# checkpointing, at widths 1024, 1536 and 4096; then h1536 x 24 at seq 2048 mb 2 with and without.
# GRID=15 (STEPS=10 WARMUP=4): six GPU-bound grid shapes by phase (--breakdown), both systems: the optimizer step of
# each apart from its forward and backward. Before it, for the compute term alone, run
# `python -m bench layer-split --out $OUT/layers` (one layer of every shape, timed and split by kernel kind).
# GRID=16 (STEPS=10 WARMUP=4): four models of other families (bench/models/family-*.json: GPT-2, Qwen2, two Qwen3 with
# their norms of queries and keys, one with heads x head_dim twice its hidden width), each built as its own Hugging
# Face class, both systems; the reference shape first.
# GRID=17 (STEPS=10 WARMUP=4): linear layers of a width off a multiple of 8. The compute table again (now with its
# misaligned GEMMs), then the reference shape, the GPT-2 (vocabulary 50257) again, and a Llama-3.2-1B-like model
# (tied embeddings) with a vocabulary of 128257 (a pad token added to 128256, as resize_token_embeddings leaves it)
# and of 128256: the same model but for its LM head's alignment, both systems; then h2560 x 16 (n12) once more.
# GRID=18 (STEPS=10 WARMUP=4): the compute table again (misaligned GEMMs of widths that are multiples of 2 and 4 too),
# the reference shape, and the same model with a vocabulary of 128258 and of 128260, both systems.
# GRID=19 (STEPS=10 WARMUP=4): the reference shape, the vocabularies of 128256 and 128258 again on one machine, and a
# Phi-3-like model (fused QKV and gate-up projections), both systems.
# GRID=20 and 21 (MODES=zero1 STEPS=20 WARMUP=4): a fourth DeepSpeed ZeRO-1 run of every grid shape, on one more
# machine, the reference first in each call. A shape's ZeRO-1 runs spread more than its Lins runs (slowest over
# fastest: median 7 % against 2 % on calls 1-13), so it gets one more run each; a shape is held at the median of its runs.
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
keep() { tar -rf "$OUT/issue27.tar" -C "$OUT" "$@" && (cd "$OUT" && rm -f "$@"); }
if [ -z "${ONLY:-}" ] && { [ "${GRID:-1}" = 1 ] || [ "${GRID:-1}" = 17 ] || [ "${GRID:-1}" = 18 ]; }; then
  timeout 240 python -m bench.compute_profile --out "$OUT/compute_h200.json" 2>&1 | tail -1 | tee -a "$OUT/log.txt"
  keep compute_h200.json
fi
run() {  # run <name> <mode> <model> <seq> <mb> [--checkpointing]
  local name=$1 mode=$2 model=$3 seq=$4 mb=$5; shift 5
  local extra=(); [ "$mode" = lins ] && extra=(--lins-memory-gb 130 --lins-init per_module)
  [ "$mode" = lins ] && [ "${1:-}" != --checkpointing ] && extra+=(--lins-checkpointing false)
  timeout 120 ${PIN:-} torchrun --nproc_per_node 1 --master_port $((29500 + RANDOM % 500)) -m bench.train \
    --deepspeed_config "ds_configs/$mode.json" --model "bench/models/$model.json" --seq-len "$seq" \
    --micro-batch-size "$mb" --grad-accum 1 --steps "${STEPS:-6}" --warmup-steps "${WARMUP:-2}" "$@" "${extra[@]}" \
    --out "$OUT/${name}_$mode.json" > "$OUT/${name}_$mode.log" 2>&1
  echo "$name $mode rc $? $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('step %.4f s peak %.2f GiB' % (r['median_step_s'], r['peak_memory_gb']))" "$OUT/${name}_$mode.json" 2>/dev/null)" | tee -a "$OUT/log.txt"
  keep $(cd "$OUT" && ls "${name}_$mode".* 2>/dev/null)
}
declare -A SPEC=(  # base name: model, sequence, micro-batch [--checkpointing]
  [ref]="shape-h1024-l16 2048 4" [s2]="shape-h2048-l12 4096 2" [s3]="shape-h3072-l8 1024 4"
  [s4]="shape-h4096-l6 2048 2 --checkpointing" [s5]="shape-h5120-l8 4096 1"
  [s6]="shape-h2560-l8 8192 1 --checkpointing" [s7]="shape-h1536-l12 4096 2 --checkpointing"
  [s8]="shape-h4096-l4 8192 1" [s9]="shape-h5120-l8 2048 2 --checkpointing"
  [n1]="shape-h1024-l24 4096 2" [n2]="shape-h1536-l16 1024 4" [n3]="shape-h2048-l8 8192 1 --checkpointing"
  [n4]="shape-h2560-l12-kv4 2048 2" [n5]="shape-h3072-l12 4096 1 --checkpointing"
  [n6]="shape-h3584-l8 2048 4 --checkpointing" [n7]="shape-h5120-l6-kv8 1024 4"
  [n8]="shape-h1024-l8 8192 2" [n9]="shape-h2048-l16-kv4 2048 4 --checkpointing" [n10]="shape-h3072-l6 8192 1"
  [n11]="shape-h4096-l10 1024 2" [n12]="shape-h2560-l16 4096 1" [n13]="shape-h1536-l24 2048 2 --checkpointing"
  [n14]="shape-h4096-l8-kv8 4096 2 --checkpointing"
  # host-bound probes (GRID=14): at sequence 128 the kernels are too short to hide the host, so a step is the host's
  # work; with and without every layer checkpointed, forward, backward and step timed apart (--breakdown)
  [hb1]="shape-h1536-l24 128 1 --breakdown" [hb1c]="shape-h1536-l24 128 1 --checkpointing --breakdown"
  [hb2]="shape-h1024-l16 128 1 --breakdown" [hb2c]="shape-h1024-l16 128 1 --checkpointing --breakdown"
  [hb3]="llama-7b-width-8-layers 128 1 --breakdown" [hb3c]="llama-7b-width-8-layers 128 1 --checkpointing --breakdown"
  [n13k]="shape-h1536-l24 2048 2 --checkpointing --breakdown" [n13n]="shape-h1536-l24 2048 2 --breakdown"
  [s5k]="shape-h5120-l8 4096 1 --breakdown" [n5k]="shape-h3072-l12 4096 1 --checkpointing --breakdown"
  [s2k]="shape-h2048-l12 4096 2 --breakdown" [n12k]="shape-h2560-l16 4096 1 --breakdown"
  [n7k]="shape-h5120-l6-kv8 1024 4 --breakdown" [s8k]="shape-h4096-l4 8192 1 --breakdown"
  # other families (GRID=16): never fitted, priced with the shape model as it stands
  [f1]="family-gpt2-h1600-l24 2048 4" [f2]="family-qwen2-h1536-l28 4096 2"
  [f3]="family-qwen3-h2048-l28 2048 4 --checkpointing" [f4]="family-qwen3-h1024-l28 4096 2"
  # GRID=17: the same Llama-3.2-1B-like model with its LM head misaligned (128257) and aligned (128256)
  [f5]="family-llama3-h2048-l16-v128257 2048 4" [f6]="family-llama3-h2048-l16-v128256 2048 4"
  [f7]="family-llama3-h2048-l16-v128258 2048 4" [f8]="family-llama3-h2048-l16-v128260 2048 4"  # GRID=18
  [f9]="family-phi3-h3072-l12 2048 4"  # GRID=19
)
case "${GRID:-1}" in  # "<run name>:<base name>", in the order they run
  1) RUNS="ref:ref s2:s2 s3:s3 s4:s4 s5:s5 s6:s6 s7:s7 s8:s8 s9:s9 ref2:ref" ;;
  2) RUNS="ref3:ref n1:n1 n2:n2 n3:n3 n4:n4 n5:n5 n6:n6 n7:n7" ;;  # shapes the first grid's fit never saw
  3) RUNS="ref4:ref n8:n8 n9:n9 n10:n10 n11:n11 n12:n12 n13:n13 n14:n14" ;;
  4) RUNS="ref5:ref n12b:n12 n11b:n11 n4b:n4 s3b:s3 s2b:s2 n9b:n9 n13b:n13 n1b:n1 n5b:n5 s8b:s8 n2b:n2 n8b:n8 ref6:ref" ;;
  # every shape once more on another machine, longer (STEPS=20 WARMUP=4): Lins on all 23, ZeRO-1 on the 10 it
  # had run once, the reference first
  5) RUNS="ref7:ref s2r:s2 s3r:s3 s4r:s4 s5r:s5 s6r:s6 s7r:s7 s8r:s8 s9r:s9 n1r:n1 n2r:n2 n3r:n3" ;;
  6) RUNS="ref8:ref n4r:n4 n5r:n5 n6r:n6 n7r:n7 n8r:n8 n9r:n9 n10r:n10 n11r:n11 n12r:n12 n13r:n13 n14r:n14" ;;
  7) RUNS="ref9:ref s4r:s4 s5r:s5 s6r:s6 s7r:s7 s9r:s9 n3r:n3 n6r:n6 n7r:n7 n10r:n10 n14r:n14 ref10:ref" ;;
  8) RUNS="ref11:ref n2q:n2 ref12:ref" ;;
  9) RUNS="ref11p:ref n2qp:n2 ref12p:ref"; PIN=${PIN:-taskset -c 2-5} ;;
  # a third run of every shape under both systems, on one more machine (STEPS=20 WARMUP=4): a shape is held at the
  # median of three; the reference first in each call
  10) RUNS="ref13:ref s2t:s2 s3t:s3 s4t:s4 s5t:s5 s6t:s6 s7t:s7" ;;
  11) RUNS="ref14:ref s8t:s8 s9t:s9 n1t:n1 n2t:n2 n3t:n3 n4t:n4" ;;
  12) RUNS="ref15:ref n5t:n5 n6t:n6 n7t:n7 n8t:n8 n9t:n9" ;;
  13) RUNS="ref16:ref n10t:n10 n11t:n11 n12t:n12 n13t:n13 n14t:n14" ;;
  # what a layer pass costs the host, checkpointed or not, by width; then the shape both systems miss (h1536 x 24
  # ckpt) and the same without checkpointing, by phase (STEPS=12 WARMUP=4)
  14) RUNS="hb1:hb1 hb1c:hb1c hb2:hb2 hb2c:hb2c hb3:hb3 hb3c:hb3c n13k:n13k n13n:n13n" ;;
  15) RUNS="s5k:s5k n5k:n5k s2k:s2k n12k:n12k n7k:n7k s8k:s8k" ;;  # GPU-bound shapes, forward, backward, step apart
  16) RUNS="ref17:ref f1:f1 f2:f2 f3:f3 f4:f4" ;;
  17) RUNS="ref18:ref f1b:f1 f5:f5 f6:f6 n12u:n12" ;;
  18) RUNS="ref19:ref f7:f7 f8:f8" ;;
  19) RUNS="ref20:ref f6b:f6 f7b:f7 f9:f9" ;;
  20) RUNS="ref21:ref s2u:s2 s3u:s3 s4u:s4 s5u:s5 s6u:s6 s7u:s7 s8u:s8 s9u:s9 n1u:n1 n2u:n2 n3u:n3" ;;
  21) RUNS="ref22:ref n4u:n4 n5u:n5 n6u:n6 n7u:n7 n8u:n8 n9u:n9 n10u:n10 n11u:n11 n12v:n12 n13u:n13 n14u:n14" ;;
  *) echo "GRID=${GRID}: 1 to 21" >&2; exit 2 ;;
esac
# The GPU's clocks, power and throttle reasons every 250 ms beside the steps (bench/train.py: step_end_unix)
nvidia-smi -i "${CUDA_VISIBLE_DEVICES:-0}" --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active \
  --format=csv,nounits -lms 250 > "$OUT/gpu_clocks_grid${GRID:-1}.csv" 2>/dev/null & CLOCKS=$!
trap 'kill $CLOCKS 2>/dev/null' EXIT  # a call cut short leaves no logger behind
for r in $RUNS; do
  name=${r%%:*}
  read -r model seq mb ck <<< "${SPEC[${r#*:}]}"
  for mode in ${MODES:-zero1 lins}; do
    [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name:$mode "* ]] && continue
    run "$name" "$mode" "$model" "$seq" "$mb" $ck
  done
done
kill $CLOCKS 2>/dev/null; wait $CLOCKS 2>/dev/null
keep "gpu_clocks_grid${GRID:-1}.csv"
keep log.txt
