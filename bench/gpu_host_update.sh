#!/usr/bin/env bash
# Issue 59's host update, measured in one call on one GPU machine (H100 or H200, 16 host cores): main's staged update
# (48 bytes per bf16 element) against the branch's blocked one (28) on its explicit threads, first alone on the host,
# then in training. DeepSpeed 0.19.8 wheels in .whl (as the other bench/gpu_*.sh); the two trees as gpu_same_speed.sh
# takes them, made on the session's machine from the repository (not from a working tree):
#   git archive main lins_ds bench lins_ds_autoload.py ds_configs | gzip > .baseline/old.tgz
#   git archive wip/issue59-host-update lins_ds bench lins_ds_autoload.py ds_configs | gzip > .baseline/new.tgz
# (old: the branch's base where main has moved on: git merge-base main wip/issue59-host-update.) This script lives in
# new.tgz; from a checkout of main, run it from there:
#   run(command="mkdir -p /tmp/new && tar xzf .baseline/new.tgz -C /tmp/new && OUT=$OUT bash /tmp/new/bench/gpu_host_update.sh",
#       carry=[".whl", ".baseline"])
# (from a checkout of the branch, "OUT=$OUT bash bench/gpu_host_update.sh" does the same.)
#  1. bench/host_update_bench.py: the host's copy and triad bandwidth on 4, 8, 16 threads and the new updater's own
#     count; each tree's update of ELEMS (5e8) fp32 elements with bf16 gradients, through the tree's own
#     HostOptimizer and update_piece, on those thread counts, idle and beside a kernel-launching thread: elements/s,
#     bytes per element, GB/s, % of the triad and copy bandwidth; the new tree's block sizes; each tree's start-up
#     measurement. $OUT/host_update.json and .txt. About 2 minutes.
#  2. bench/gpu_same_speed.sh with ONLY=offload40 HOST=torch: Qwen2-1.5B widths, seq 4096, mb 2, gas 2, 10 steps, at
#     40 GiB with the torch host optimizer, old, new, old, new (ROUNDS=2; 1 where step 1 ran long), about 50 s a run.
#     $OUT/same_speed/: each run's JSON and log, same_speed.json (old/new of the median steps: > 1, new faster).
# About 6 minutes in all (installs ~30 s, 1: ~2 min, 2: ~3.5 min). Env: ELEMS, THREADS (4,8,16), ROUNDS.
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: both parts run from the trees' dirs
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf .baseline/old.tgz -C /tmp/old || exit 1
NEW=$PWD
if [ -f .baseline/new.tgz ]; then
  rm -rf /tmp/new && mkdir -p /tmp/new && tar xzf .baseline/new.tgz -C /tmp/new && NEW=/tmp/new || exit 1
fi
[ -f "$NEW/bench/host_update_bench.py" ] || { echo "no bench/host_update_bench.py in $NEW: new.tgz is not the branch"; exit 1; }
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
echo "== host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
echo "== 1. the host update alone (old /tmp/old, new $NEW)"
(cd "$NEW" && timeout 240 python3 bench/host_update_bench.py --old /tmp/old --new "$NEW" --elems "${ELEMS:-5e8}" \
  --threads "${THREADS:-4,8,16}" --out "$OUT/host_update.json") 2>&1 | grep -v "real_accelerator" | tee "$OUT/host_update.txt"
echo "== 1 took $((SECONDS - T0)) s"
if [ -z "${ROUNDS:-}" ]; then ROUNDS=2; [ $((SECONDS - T0)) -gt 200 ] && ROUNDS=1 && echo "(step 1 ran long: ROUNDS=1)"; fi
echo "== 2. in training: offload at 40 GiB, torch host optimizer, old/new x $ROUNDS"
mkdir -p "$OUT/same_speed"
ONLY=offload40 HOST=torch ROUNDS=$ROUNDS OUT=$OUT/same_speed bash "$NEW/bench/gpu_same_speed.sh"
for f in "$OUT"/same_speed/offload40_*.log; do  # what the start-up said of the host (threads, GB/s) and its waits
  echo "-- $(basename "$f")"; grep -E "offload: host optimizer|rc " "$f" | tail -2; grep "host waited" "$f" | tail -2
done
echo "== done in $((SECONDS - T0)) s"
