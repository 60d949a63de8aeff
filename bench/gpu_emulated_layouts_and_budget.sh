#!/usr/bin/env bash
# Two emulated nodes and one memory-bound host on 2 x H200 (device tool, nvidia-h200-x2; first run as round 3, when gradients
# now accumulate in place (views into the accumulator) in DeepSpeed's default dtype. Most informative
# first, each line printed as it finishes:
#  2 emulated nodes (tuned sockets): Lins with ZeRO-2's layout (G and OS sharded across the nodes,
#  ReduceScatter every micro-batch), ZeRO-0 (the best DeepSpeed mode there so far), Lins solve;
#  one host: ZeRO-1 and Lins under a 20 GiB budget (the memory-bound case).
set -uo pipefail
OUT=${OUT:-bench/out}; W=bench/out/r3; mkdir -p "$OUT" "$W"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
B="python3 -m bench run --model 1b --seq-len 2048 --micro-batch-size 2 --grad-accum 2 --steps 10 --warmup-steps 3 --loss-steps 10 --no-no-comm-limit"
for m in lins_as_zero2 zero0 lins; do $B --topologies emulated --modes $m --out "$W/emulated_$m" 2>&1 | grep --line-buffered "^\[bench\]\|Error"; done
$B --topologies host --modes zero1 --memory-budget-gb 20 --out "$W/host" 2>&1 | grep --line-buffered "^\[bench\]\|Error\|lins-budget"
tar czf "$OUT/r3.tgz" -C "$W" .
