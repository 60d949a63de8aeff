#!/usr/bin/env bash
# Issue 59 on one GPU machine (H100 or H200, 16 host cores), one call per PARTS list: the blocked host update (this
# tree) against main's staged one (.baseline/old.tgz), first alone on the host, then in training, side by side with
# DeepSpeed ZeRO-2 Offload in the same call. DeepSpeed 0.19.8 wheels in .whl (../shared/tools/device_wheels.sh 0.19.8);
# main's tree archived on the session's machine:
#   mkdir -p .baseline && git archive main lins_ds bench lins_ds_autoload.py ds_configs | gzip > .baseline/old.tgz
#   run(command="OUT=$OUT PARTS='bench q3 q3-old' bash bench/gpu_issue59.sh", carry=[".whl", ".baseline"])
# Parts (in the order given; a part is skipped, and says so, where fewer than its seconds are left of LIMIT, 580 s):
#  bench   bench/host_update_bench.py: the host's copy and triad bandwidth, each tree's update of ELEMS (4e8) fp32
#          elements with bf16 gradients on THREADS (8,16) and the runtime's own count, idle and beside a
#          kernel-launching thread: elements/s, bytes per element, GB/s, % of the bandwidth. ~90 s.
#  q3      Qwen2.5-3B widths (bench/models/hub-qwen2.5-3b.json), seq 4096, mb 2, gas 2, 8 steps, every layer
#          checkpointed: Lins at 40 GiB with gradient_clipping 0 and 1, ZeRO-2 Offload with 1 and 0, Lins at
#          ZeRO-2 Offload's own footprint (bench/gpu_offload.sh noclip noclip-ds noclip-fp). ~75 s a run.
#  q3-old  main's tree, Lins at 40 GiB, clipping 0 then 1 (gpu_offload.sh noclip from /tmp/old).
#  q3-z2   ZeRO-2 Offload alone (clipping 1, 0); q3-tiled: Lins at 40 GiB with the logits and loss in 8 tiles
#          (lins.tiling: the memory the head frees keeps more units' optimizer state on the GPU).
#  l3, l3-old   the same on the 2.9B LLaMA (bench/models/llama-2.9b.json); l3-lins, l3-z2 as q3-lins, q3-z2.
#  q14     Qwen2.5-14B widths (bench/models/hub-qwen2.5-14b.json) on an H200 + at most 118 GiB of host, seq 4096, mb 1,
#          the solver's plan, one run per GAS:CLIP of Q14_RUNS (gpu_offload.sh q14; "16:1 16:0"). ~200-300 s a run.
# Writes $OUT/host_update.{json,txt} and $OUT/<part>/issue26_*.tar.gz (gpu_offload.sh's archive of JSONs and logs).
# Tables: python -m bench.host_exposed <dir> q3_lins_40_clip0 ... --baseline q3_zero2_offload_clip1 (see bench/README).
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: parts run from /tmp/old too
LIMIT=${LIMIT:-580}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf .baseline/old.tgz -C /tmp/old || exit 1
NEW=$PWD
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
echo "== host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
lscpu | grep -E "^Model name|^Socket|^NUMA|^L3" | tr -s ' ' 
Q3=bench/models/hub-qwen2.5-3b.json L3=bench/models/llama-2.9b.json
left() { echo $((LIMIT - SECONDS)); }
want() {  # want <part> <seconds>: whether there is time for it
  if [ "$(left)" -lt "$2" ]; then echo "== $1 skipped: $(left) s left, it needs ~$2"; return 1; fi
  echo "== $1 ($(left) s left)"
}
offload() {  # offload <tree> <model> <prefix> <parts...>
  local tree=$1 model=$2 prefix=$3; shift 3
  mkdir -p "$OUT/$prefix"
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree M3=$model P=$prefix OUT=$OUT/$prefix timeout "$(left)" \
    bash bench/gpu_offload.sh "$@")
}
for part in ${PARTS:-bench q3 q3-old}; do
  case $part in
  bench) want bench 100 && (export PYTHONPATH=/tmp/site; timeout "$(left)" python3 bench/host_update_bench.py --old /tmp/old --new "$NEW" \
      --elems "${ELEMS:-4e8}" --threads "${THREADS:-8,16}" --blocks "${BLOCKS:-2097152,8388608}" \
      --timeout 150 --out "$OUT/host_update.json") 2>&1 | grep -v real_accelerator | tee "$OUT/host_update.txt" ;;
  q3) want q3 300 && offload "$NEW" $Q3 q3 noclip noclip-ds noclip-fp ;;
  q3-lins) want q3-lins 150 && offload "$NEW" $Q3 q3 noclip ;;  # Lins alone, clipping 0 and 1
  q3-z2) want q3-z2 90 && offload "$NEW" $Q3 q3 noclip-ds ;;  # ZeRO-2 Offload, clipping 1 and 0, on this machine
  q3-tiled) want q3-tiled 150 && LINS_SET='lins.tiling={"logits": 8}' offload "$NEW" $Q3 q3tiled noclip ;;
  q3-old) want q3-old 140 && offload /tmp/old $Q3 q3old noclip ;;
  l3) want l3 300 && offload "$NEW" $L3 l3 noclip noclip-ds noclip-fp ;;
  l3-old) want l3-old 140 && offload /tmp/old $L3 l3old noclip ;;
  l3-lins) want l3-lins 150 && offload "$NEW" $L3 l3 noclip ;;  # Lins alone, clipping 0 and 1
  l3-z2) want l3-z2 90 && offload "$NEW" $L3 l3 noclip-ds ;;  # ZeRO-2 Offload, clipping 1 and 0, on this machine
  l3-z2c0) want l3-z2c0 90 && offload "$NEW" $L3 l3 noclip-ds0 ;;  # ZeRO-2 Offload without clipping alone
  l3-c0) want l3-c0 80 && offload "$NEW" $L3 l3 noclip0 ;;  # Lins at 40 GiB without clipping alone
  q3-c0) want q3-c0 80 && offload "$NEW" $Q3 q3 noclip0 ;;
  q14) want q14 200 && offload "$NEW" $L3 q14 q14 ;;  # the 14B on an H200 (gpu_offload.sh q14: Q14_RUNS, HOST_GB)
  *) echo "unknown part $part" ;;
  esac
done
echo "== done in $SECONDS s"
