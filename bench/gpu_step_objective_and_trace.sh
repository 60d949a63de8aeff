#!/usr/bin/env bash
# Follow-up on 2 x H200: the solver's "step" objective on one host next to ZeRO-1, a torch.profiler
# summary of Lins on 2 emulated nodes next to ZeRO-0, and MiCS's failure with its error text.
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
COMMON="--model 1b --seq-len 2048 --micro-batch-size 2 --grad-accum 2 --steps 10 --warmup-steps 3"
tr() { torchrun --nproc_per_node 2 --master_port $((29500 + RANDOM % 500)) -m bench.train "$@"; }
for cfg in zero1 lins; do  # lins.json now has "objective": "step" (then ds_configs/lins_step.json)
  tr --deepspeed_config ds_configs/$cfg.json $COMMON --out "$OUT/host_$cfg.json" 2>&1 | grep -E "Lins plan|^  (P|G|OS) \(" ; done
export NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4
tr --deepspeed_config ds_configs/zero0.json $COMMON --gpus-per-node 1 --out "$OUT/emulated_zero0.json" >/dev/null 2>&1
tr --deepspeed_config ds_configs/lins.json $COMMON --gpus-per-node 1 --out "$OUT/emulated_lins.json" \
   --trace-summary "$OUT/trace_emulated_lins.txt" >/dev/null 2>&1
unset NCCL_SOCKET_NTHREADS NCCL_NSOCKS_PERTHREAD
tr --deepspeed_config ds_configs/mics.json $COMMON --steps 3 --out "$OUT/host_mics.json" > "$OUT/mics_log.txt" 2>&1
grep -E "Error|error" "$OUT/mics_log.txt" | grep -v "^\s*$" | head -8
python3 - "$OUT" <<'PY'
import json, sys, os
d = sys.argv[1]
for n in ["host_zero1", "host_lins", "emulated_zero0", "emulated_lins"]:
    p = os.path.join(d, n + ".json")
    if os.path.exists(p):
        r = json.load(open(p))
        plan = r["plan"] and " ".join(f"{s}={r['plan'][s]['intra']}x{r['plan'][s]['inter']}" for s in ("p", "g", "os"))
        print(f"{n:16s} {r['tokens_per_gpu_s']:8.0f} tok/GPU/s  step {r['median_step_s']:.3f} s  peak {r['peak_memory_gb']:.1f} GiB  {plan or ''}")
PY
