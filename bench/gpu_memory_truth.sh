#!/usr/bin/env bash
# Issue 61 on one GPU (device tool, nvidia-h100-x1 or nvidia-h200), DeepSpeed 0.19.8 from .whl (carry it): a plan
# that fits must not run out of memory, and its predicted peak must hold at the batches' length. From the config
# alone (ds_configs/lins_offload.json: "offload": "auto", no lins.seq_len: the start-up plan is sized for 2048 and
# re-sized for the batches), no environment variable for the allocator; bf16, AdamW, clip 1.0, micro-batch 1, gas 4,
# the logits held through the backward (the loop the memory probe models). Parts (all by default):
#   gemma   Gemma-2-2B widths (eager attention, soft-capping, vocabulary 256000) at seq 4096 under
#           lins.gpu_memory_gb 24, 40 and the whole card, and at 8192 on the whole card
#   qwen    Qwen2-1.5B widths with eager attention, the same four runs
#   sdpa    Qwen2-1.5B widths with SDPA at 4096 and 8192 (the re-size where attention is linear)
#   mistral Mistral-7B widths (SDPA) at 78 GiB and the whole card (seq 4096)
#   alloc   the gpu-marked allocator test (a capped, fragmented allocator serves a request that fits)
# Writes $OUT/<run>.json, $OUT/<run>.log, $OUT/log.txt and $OUT/memory_truth.{json,png} (bench/memory_truth.py).
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
run() {  # run <name> <timeout s> <bench.train args...>
  local name=$1 limit=$2; shift 2
  echo "== $name" | tee -a "$OUT/log.txt"
  timeout "$limit" torchrun --nproc_per_node 1 --master_port $((29500 + RANDOM % 500)) -m bench.train \
    --deepspeed_config ds_configs/lins_offload.json --micro-batch-size 1 --grad-accum 4 --steps 3 --warmup-steps 1 \
    --lins-seq-len null --hold-outputs --lins-init per_module --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "rc $?" >> "$OUT/$name.log"
  grep -E "^step|allocator:|sequence length|checkpointed|on the host|lins memory|OutOfMemory|Error|rc " \
    "$OUT/$name.log" | tail -12 | tee -a "$OUT/log.txt"
}
G=(--model bench/models/hub-gemma2-2b.json)
Q=(--model bench/models/family-qwen2-h1536-l28.json)
M=(--model bench/models/hub-mistral-7b.json)
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(gemma qwen sdpa mistral alloc)
for part in "${parts[@]}"; do
  case $part in
  gemma)
    run gemma_24 200 "${G[@]}" --seq-len 4096 --lins-memory-gb 24
    run gemma_40 200 "${G[@]}" --seq-len 4096 --lins-memory-gb 40
    run gemma_card 200 "${G[@]}" --seq-len 4096
    run gemma_card_8k 200 "${G[@]}" --seq-len 8192 ;;
  gemma40)  # the 40 GiB run alone
    run gemma_40 200 "${G[@]}" --seq-len 4096 --lins-memory-gb 40 ;;
  qwen)
    run qwen_eager_24 200 "${Q[@]}" --attn eager --seq-len 4096 --lins-memory-gb 24
    run qwen_eager_40 200 "${Q[@]}" --attn eager --seq-len 4096 --lins-memory-gb 40
    run qwen_eager_card 200 "${Q[@]}" --attn eager --seq-len 4096
    run qwen_eager_card_8k 200 "${Q[@]}" --attn eager --seq-len 8192 ;;
  sdpa)
    run qwen_sdpa_card 200 "${Q[@]}" --seq-len 4096
    run qwen_sdpa_card_8k 200 "${Q[@]}" --seq-len 8192 ;;
  mistral)
    run mistral_78 300 "${M[@]}" --seq-len 4096 --lins-memory-gb 78
    run mistral_card 300 "${M[@]}" --seq-len 4096 ;;
  alloc)
    { python3 -m pytest -q -m gpu tests/test_allocator.py 2>&1 || python3 -c "import sys; sys.path.insert(0, 'tests')
import test_allocator as t; t.test_a_capped_fragmented_allocator_serves_a_request_that_fits(); print('1 passed')"; } \
      2>&1 | tail -3 | tee -a "$OUT/log.txt" ;;
  esac
done
python3 -m bench.memory_truth "$OUT" | tee -a "$OUT/log.txt"
