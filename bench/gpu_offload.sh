#!/usr/bin/env bash
# Issue 26 (offload) on one H200 (device tool, nvidia-h200). DeepSpeed 0.19.8 from .whl (carry it).
# Usage: OUT=<dir> bash bench/gpu_offload.sh [smoke] [3b-lins] [3b-ds] [3b-more] [7b] (all by default), or the parts
# of the gradient placement: g-smoke g-3b (BUDGETS="19.28 13.29 40" by default) 7b-cap 3b-ds; writes
# $OUT/<part>_<run>.json and $OUT/log.txt.
#  smoke  the tiny LLaMA under Lins with every OS on the host (CUDA streams, pinned memory, the worker thread)
#  3b     LLaMA h3072 x 24 (2.92 B), seq 4096, micro-batch 2, gas 2, bf16, AdamW, clip 1, every layer checkpointed
#         (HF gradient checkpointing, all modes): DeepSpeed ZeRO-2 + offload_optimizer, ZeRO-3 + offload_param +
#         offload_optimizer, ZeRO-3 + offload_optimizer ratio 0.6; Lins (offload "auto") at 40 and 30 GiB and at
#         the faster DeepSpeed full offload's footprint (its max_memory_reserved + Lins' 2 GiB reserve); Lins
#         reading the ZeRO-Offload config itself (stage 0 + "lins": {}: every unit's OS on the host)
#  7b     LLaMA-7B, seq 2048, micro-batch 1, gas 1, Lins with "gpu_memory_gb": 80 (the solver picks
#         checkpointing and offload)
# and of the parameter placement: p-smoke p-3b (P_BUDGET, 9.3 GiB by default); ratio (RATIOS="0.5" by default:
# DeepSpeed ZeRO-3 + offload_optimizer.ratio); z2 (DeepSpeed ZeRO-2 + offload_optimizer alone); issue 59's
# noclip-smoke, noclip, noclip-ds, noclip-fp (gradient_clipping 1 and 0; Lins at ZeRO-2's footprint, after noclip-ds in
# the same invocation; then `python -m bench.host_exposed $OUT RUN...`). BREAKDOWN=1:
# every 3b run times forward, backward and step apart; HOLD=1: keeps the logits until the backward (runs "_hold").
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
# EXPANDABLE=1: the caching allocator grows segments instead of caching fixed blocks (less fragmentation; runs "_exp")
[ -n "${EXPANDABLE:-}" ] && export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
run() {  # run <name> <timeout s> <bench.train args...>
  local name=$1 limit=$2; shift 2
  echo "== $name" | tee -a "$OUT/log.txt"
  timeout "$limit" torchrun --nproc_per_node 1 --master_port $((29500 + RANDOM % 500)) -m bench.train "$@" \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "rc $?" >> "$OUT/$name.log"
  grep -E "^step|Lins plan|optimizer state on|offload:|lins memory|lins host|lins start-up|Error|error:|Killed|rc |no plan" \
    "$OUT/$name.log" | grep -v "^step    [3-7] " | tail -14 | tee -a "$OUT/log.txt"
  grep -E "^host memory used" "$OUT/$name.log" | tee -a "$OUT/log.txt"
}
# M3=<model JSON> (default the 2.9B LLaMA) and P=<prefix> (default 3b) for the noclip parts: the same runs on another
# family, e.g. M3=bench/models/hub-qwen2.5-3b.json P=q3
M3=${M3:-bench/models/llama-2.9b.json}
P=${P:-3b}
# LINS_SET=KEY=JSON: one more --ds-set for the noclip parts' Lins runs, e.g. 'lins.tiling={"logits": 8}' (P names them)
LS=(${LINS_SET:+--ds-set "$LINS_SET"})
B3=(--model $M3 --seq-len 4096 --micro-batch-size 2 --grad-accum 2 --steps 8 --warmup-steps 3 --checkpointing
    ${BREAKDOWN:+--breakdown} ${HOLD:+--hold-outputs})
L=(--lins-init per_module)
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(smoke 3b-lins 3b-ds 3b-more 7b)
for part in "${parts[@]}"; do
  case $part in
  smoke)
    run smoke_all 200 --deepspeed_config ds_configs/lins.json --model tiny --seq-len 64 --steps 6 --warmup-steps 2 \
      --lins-offload '{"os": "cpu"}' "${L[@]}"
    run smoke_half 200 --deepspeed_config ds_configs/lins.json --model tiny --seq-len 64 --steps 6 --warmup-steps 2 \
      --lins-offload '{"os": "cpu", "os_fraction": 0.5}' "${L[@]}" ;;
  3b-lins)
    run 3b_lins_40 240 --deepspeed_config ds_configs/lins_offload.json "${B3[@]}" --lins-memory-gb 40 "${L[@]}"
    run 3b_lins_30 240 --deepspeed_config ds_configs/lins_offload.json "${B3[@]}" --lins-memory-gb 30 "${L[@]}" ;;
  3b-ds)
    run 3b_zero2_offload 300 --deepspeed_config ds_configs/zero2_offload.json "${B3[@]}"
    run 3b_zero3_offload 240 --deepspeed_config ds_configs/zero3_offload.json "${B3[@]}" ;;
  z2)
    run 3b_zero2_offload 300 --deepspeed_config ds_configs/zero2_offload.json "${B3[@]}" ;;
  3b-more)  # FP=<GiB>: the footprint when 3b ran in another call
    fp=${FP:-$(python3 -c "import json,sys; r=[json.load(open(f)) for f in sys.argv[1:]]; r=[x for x in r if x.get('median_step_s')]
b=min(r, key=lambda x: x['median_step_s']); print(round(b['peak_reserved_gb'] + 2.0, 2))" \
      "$OUT/3b_zero2_offload.json" "$OUT/3b_zero3_offload.json")}
    echo "DeepSpeed footprint + reserve: $fp GiB" | tee -a "$OUT/log.txt"
    run 3b_lins_footprint 240 --deepspeed_config ds_configs/lins_offload.json "${B3[@]}" --lins-memory-gb "$fp" "${L[@]}"
    run 3b_zero3_ratio 240 --deepspeed_config ds_configs/zero3_offload_ratio.json "${B3[@]}"
    run 3b_lins_from_zero_offload 240 --deepspeed_config ds_configs/lins_from_zero_offload.json "${B3[@]}" "${L[@]}" ;;
  3b-again)  # Lins' three budgets, then DeepSpeed's partial offload (FP as for 3b-more)
    run 3b_lins_40 240 --deepspeed_config ds_configs/lins_offload.json "${B3[@]}" --lins-memory-gb 40 "${L[@]}"
    run 3b_lins_30 240 --deepspeed_config ds_configs/lins_offload.json "${B3[@]}" --lins-memory-gb 30 "${L[@]}"
    run 3b_lins_footprint 240 --deepspeed_config ds_configs/lins_offload.json "${B3[@]}" --lins-memory-gb "${FP:?}" "${L[@]}" ;;
  noclip-smoke)  # issue 59: the tiny LLaMA, OS+G of every unit on the host, gradient_clipping 0: the host updates
    # inside the last backward (CUDA lanes, the worker fed unit by unit), then after the step: the same losses
    run smoke_noclip 200 --deepspeed_config ds_configs/lins.json --model tiny --seq-len 64 --steps 6 --warmup-steps 2 \
      --lins-offload '{"os": "cpu", "g": "cpu"}' --ds-set gradient_clipping=0 "${L[@]}"
    run smoke_noclip_after 200 --deepspeed_config ds_configs/lins.json --model tiny --seq-len 64 --steps 6 \
      --warmup-steps 2 --lins-offload '{"os": "cpu", "g": "cpu"}' --ds-set gradient_clipping=0 \
      --ds-set lins.host_update_in_backward=false "${L[@]}" ;;
  noclip)  # issue 59: Lins at 40 GiB without clipping (updates inside the last backward) and with (after it)
    run ${P}_lins_40_clip0 240 --deepspeed_config ds_configs/lins_offload.json "${B3[@]}" --lins-memory-gb 40 \
      --ds-set gradient_clipping=0 "${L[@]}" "${LS[@]}"
    run ${P}_lins_40_clip1 240 --deepspeed_config ds_configs/lins_offload.json "${B3[@]}" --lins-memory-gb 40 "${L[@]}" \
      "${LS[@]}" ;;
  noclip0)  # ... Lins at 40 GiB without clipping alone (a short device window)
    run ${P}_lins_40_clip0 240 --deepspeed_config ds_configs/lins_offload.json "${B3[@]}" --lins-memory-gb 40 \
      --ds-set gradient_clipping=0 "${L[@]}" "${LS[@]}" ;;
  noclip-ds)  # ... and DeepSpeed ZeRO-2 Offload with the same two settings
    run ${P}_zero2_offload_clip1 300 --deepspeed_config ds_configs/zero2_offload.json "${B3[@]}"
    run ${P}_zero2_offload_clip0 300 --deepspeed_config ds_configs/zero2_offload.json "${B3[@]}" \
      --ds-set gradient_clipping=0 ;;
  noclip-ds0)  # ... ZeRO-2 Offload without clipping alone (a short device window)
    run ${P}_zero2_offload_clip0 300 --deepspeed_config ds_configs/zero2_offload.json "${B3[@]}" \
      --ds-set gradient_clipping=0 ;;
  noclip-fp)  # ... and Lins at ZeRO-2 Offload's own footprint (its reserved peak, clip 1 run, + Lins' 2 GiB reserve;
    # FP=<GiB> where it ran in another call), the caching allocator capped at that peak (the card it plans for)
    fp=${FP:-$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['peak_reserved_gb'] + 2.0, 2))" \
      "$OUT/${P}_zero2_offload_clip1.json")}
    echo "ZeRO-2 Offload footprint + reserve: $fp GiB" | tee -a "$OUT/log.txt"
    run ${P}_lins_fp_clip1 240 --deepspeed_config ds_configs/lins_offload.json "${B3[@]}" --lins-memory-gb "$fp" \
      --gpu-cap-gb "$(python3 -c "print($fp - 2)")" "${L[@]}" "${LS[@]}" ;;
  q14)  # issue 59's largest model: Qwen2.5-14B widths on one H200, seq 4096, micro-batch 1, the card's own memory,
    # host memory HOST_GB (at most 118 GiB, and 8 GiB under what the node has free); the solver picks checkpointing
    # and the offload; one run per GAS:CLIP of Q14_RUNS ("16:1 16:0": 64k tokens a step, gradient_clipping 1 and 0)
    free=$(free -g | awk '/Mem:/ {print $7}'); hg=${HOST_GB:-$(( free - 8 < 118 ? free - 8 : 118 ))}
    echo "host memory for Lins: $hg GiB ($free GiB available)" | tee -a "$OUT/log.txt"
    for gc in ${Q14_RUNS:-16:1 16:0}; do
      gas=${gc%:*} c=${gc#*:}
      run q14_lins_gas${gas}_clip$c ${Q14_LIMIT:-420} --deepspeed_config ds_configs/lins_offload.json \
        --model bench/models/hub-qwen2.5-14b.json --seq-len 4096 --micro-batch-size 1 --grad-accum $gas \
        --steps ${Q14_STEPS:-6} --warmup-steps 2 --ds-set lins.host_memory_gb=$hg --ds-set gradient_clipping=$c "${L[@]}"
    done ;;
  3b-ratio)
    run 3b_zero3_ratio 240 --deepspeed_config ds_configs/zero3_offload_ratio.json "${B3[@]}" ;;
  g-smoke)  # the offloaded units' gradients accumulated on the host (CUDA copy stream, pinned buffers, its thread)
    run smoke_g 200 --deepspeed_config ds_configs/lins.json --model tiny --seq-len 64 --steps 6 --warmup-steps 2 \
      --lins-offload '{"os": "cpu", "g": "cpu"}' "${L[@]}"
    run smoke_half_g 200 --deepspeed_config ds_configs/lins.json --model tiny --seq-len 64 --steps 6 --warmup-steps 2 \
      --lins-offload '{"os": "cpu", "os_fraction": 0.5, "g": "cpu"}' "${L[@]}" ;;
  g-3b)  # Lins "auto" (OS and now G placement) at DeepSpeed's two full-offload footprints and 40 GiB; each run's
    # caching allocator capped at its budget less Lins' 2 GiB reserve (--gpu-cap-gb: the card it plans for)
    for b in ${BUDGETS:-19.28 13.29 40}; do
      run 3b_lins_g_$b${EXPANDABLE:+_exp}${HOLD:+_hold} 240 --deepspeed_config ds_configs/lins_offload.json "${B3[@]}" --lins-memory-gb $b \
        --gpu-cap-gb $(python3 -c "print($b - 2)") "${L[@]}"
    done ;;
  p-smoke)  # the offloaded units' parameters on the host too (upload stream, a unit released after use)
    run smoke_p 200 --deepspeed_config ds_configs/lins.json --model tiny --seq-len 64 --steps 6 --warmup-steps 2 \
      --lins-offload '{"os": "cpu", "g": "cpu", "p": "cpu"}' "${L[@]}"
    run smoke_half_p 200 --deepspeed_config ds_configs/lins.json --model tiny --seq-len 64 --steps 6 --warmup-steps 2 \
      --lins-offload '{"os": "cpu", "os_fraction": 0.5, "g": "cpu", "p": "cpu"}' "${L[@]}" ;;
  p-3b)  # every unit's P, G and OS on the host, under a budget the G floor (12.2 GiB) does not fit: by default
    # DeepSpeed ZeRO-3 Offload's allocated peak (7.11 GiB) + Lins' 2 GiB reserve, the allocator capped 2 GiB lower
    b=${P_BUDGET:-9.3}
    run 3b_lins_p_$b${EXPANDABLE:+_exp}${HOLD:+_hold} 300 --deepspeed_config ds_configs/lins_offload.json "${B3[@]}" --lins-memory-gb $b \
      --gpu-cap-gb $(python3 -c "print($b - 2)") --lins-offload '{"os": "cpu", "g": "cpu", "p": "cpu"}' "${L[@]}" ;;
  ratio)  # DeepSpeed's partial offload at the ratios given (the fraction of the OS on the host)
    # the ratio is applied per sub-group (zero_optimization.sub_group_size, 1e9 elements by default: 3 for this
    # model, so 0.5 and 0.6 both offload 2 of 3); SUB_GROUP=<elements> makes it finer (runs "_sg<elements>")
    for r in ${RATIOS:-0.5}; do
      run 3b_zero3_ratio_$r${SUB_GROUP:+_sg$SUB_GROUP} 300 --deepspeed_config ds_configs/zero3_offload_ratio.json \
        "${B3[@]}" --ds-set zero_optimization.offload_optimizer.ratio=$r \
        ${SUB_GROUP:+--ds-set zero_optimization.sub_group_size=$SUB_GROUP}
    done ;;
  7b-cap)  # the 7B at 80 GiB on an emulated 80 GiB card (allocator capped at 78 GiB)
    run 7b_lins_80_cap${EXPANDABLE:+_exp} 400 --deepspeed_config ds_configs/lins_offload.json --model 7b --seq-len 2048 \
      --micro-batch-size 1 --grad-accum 1 --steps 6 --warmup-steps 2 --lins-memory-gb 80 --gpu-cap-gb 78 "${L[@]}" ;;
  7b)
    run 7b_lins_80 400 --deepspeed_config ds_configs/lins_offload.json --model 7b --seq-len 2048 --micro-batch-size 1 \
      --grad-accum 1 --steps 6 --warmup-steps 2 --lins-memory-gb 80 "${L[@]}" ;;
  esac
done
free -g | tee -a "$OUT/log.txt"
# one archive: the device tool brings back a limited number of files
tar -czf "$OUT/issue26_$(date +%H%M%S).tar.gz" -C "$OUT" $(cd "$OUT" && ls *.json *.log log.txt 2>/dev/null) \
  && (cd "$OUT" && rm -f *.json *.log)
