#!/usr/bin/env bash
# Nothing slower (issue 58): the same jobs on one GPU under the code before this change and after, interleaved
# (old, new, old, new) so that drift of the machine falls on both. The old tree is a `git archive` of the commit to
# compare with, carried in .baseline/old.tgz; the new one is this working tree, or .baseline/new.tgz where it exists
# (a commit measured without the working tree's uncommitted changes):
#   git archive <commit> lins_ds bench lins_ds_autoload.py ds_configs | gzip > .baseline/old.tgz
#   run(command="OUT=$OUT bash bench/gpu_same_speed.sh", carry=[".whl", ".baseline"])
# Jobs: Qwen2-1.5B widths (SDPA), seq 4096, micro-batch 2, gas 2, bf16, AdamW, clip 1: GPU-resident (whole card) and
# with offload at 40 GiB. Writes $OUT/<job>_<tree>_<i>.json and prints the median step of each and their ratios.
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf .baseline/old.tgz -C /tmp/old || exit 1
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
NEW=$PWD
if [ -f .baseline/new.tgz ]; then
  rm -rf /tmp/new && mkdir -p /tmp/new && tar xzf .baseline/new.tgz -C /tmp/new && NEW=/tmp/new || exit 1
fi
# HOST=torch (or deepspeed) fixes lins.host_optimizer in the offload job: "auto" picks the faster of the two as the
# start-up measures them, and a close call can go either way between launches (ONLY=resident|offload40: one job)
OFFLOAD_ARGS=(); [ -n "${HOST:-}" ] && OFFLOAD_ARGS=(--ds-set "lins.host_optimizer=\"$HOST\"")
M=(--model bench/models/family-qwen2-h1536-l28.json --seq-len 4096 --micro-batch-size 2 --grad-accum 2 --steps 10
   --warmup-steps 3 --lins-init per_module)
run() {  # run <tree dir> <name> <args...>
  local dir=$1 name=$2; shift 2
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 300 torchrun --nproc_per_node 1 --master_port $((29500 + RANDOM % 500)) \
    -m bench.train "${M[@]}" "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1; echo "rc $?" >> "$OUT/$name.log")
  grep -E "rc |Error" "$OUT/$name.log" | tail -2 | sed "s/^/$name: /"
}
for i in $(seq 1 "${ROUNDS:-2}"); do
  for tree in old new; do
    dir=$([ $tree = old ] && echo /tmp/old || echo "$NEW")
    [ -z "${ONLY:-}" ] || [ "$ONLY" = resident ] && run "$dir" "resident_${tree}_$i" --deepspeed_config ds_configs/lins.json
    [ -z "${ONLY:-}" ] || [ "$ONLY" = offload40 ] && run "$dir" "offload40_${tree}_$i" \
      --deepspeed_config ds_configs/lins_offload.json --lins-memory-gb 40 "${OFFLOAD_ARGS[@]}"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(out, "*_*_*.json"))):
    job, tree, _ = os.path.basename(f)[:-5].rsplit("_", 2)
    r = json.load(open(f))
    rows.setdefault(job, {}).setdefault(tree, []).append(r["median_step_s"])
table = {}
for job, t in rows.items():
    old, new = statistics.median(t.get("old", [float("nan")])), statistics.median(t.get("new", [float("nan")]))
    table[job] = {"old_s": t.get("old"), "new_s": t.get("new"), "old_over_new": old / new}
    print(f"{job:10s} old {t.get('old')} new {t.get('new')}  old/new {old / new:.3f}")
json.dump(table, open(os.path.join(out, "same_speed.json"), "w"), indent=1)
PY
