#!/usr/bin/env bash
# What debug mode costs per step (NOTE [Debug mode] in
# include/accel/comm/communicator.hpp): the compare_strategies example (the
# GPT example's model under DDP, ZeRO-1/2/3, tensor 2, pipeline 2 and
# DDP+BF16 on 2 forked ranks) run with ACCELERATE_DEBUG_MODE=false and =true,
# alternately, ROUNDS times each. Prints, per strategy, the median step time
# of each mode, their ratio (debug / off), and the checks per step (rank 0's
# all-gathers in debug mode beyond the strategy's own).
#
#   bench/debug_mode_cost.sh [BUILD_DIR]      # ROUNDS=3 by default
set -euo pipefail
build="${1:-build}"
rounds="${ROUNDS:-3}"
prog="$build/examples/compare_strategies"
[[ -x "$prog" ]] || ninja -C "$build" examples/compare_strategies >&2
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
log="$(mktemp -d)"
trap 'rm -rf "$log"' EXIT
for ((i = 0; i < rounds; ++i)); do
  for mode in false true; do
    ACCELERATE_DEBUG_MODE=$mode "$prog" --steps 10 --rounds 1 --json "$log/$mode.jsonl" >/dev/null
  done
done
python3 - "$log" <<'PY'
import json, statistics, sys, collections
runs = {m: collections.defaultdict(list) for m in ("false", "true")}
gathers = {m: collections.defaultdict(list) for m in runs}
for mode in runs:
    for line in open(f"{sys.argv[1]}/{mode}.jsonl"):
        r = json.loads(line)
        if not r["ok"]:
            print(f"{r['name']} ({mode}): failed: {r['error']}"); continue
        runs[mode][r["name"]].append(r["median_ms"])
        gathers[mode][r["name"]].append(r["ranks"][0]["calls_per_step"].get("all_gather", 0))
print(f"{'strategy':<34}{'off ms':>9}{'debug ms':>10}{'ratio':>8}{'checks/step':>13}")
for name, off in runs["false"].items():
    on = runs["true"].get(name)
    if not on: continue
    a, b = statistics.median(off), statistics.median(on)
    # The checks are all-gathers: those of debug mode beyond the strategy's own.
    checks = statistics.median(gathers["true"][name]) - statistics.median(gathers["false"][name])
    print(f"{name:<34}{a:9.2f}{b:10.2f}{b / a:8.3f}{checks:13.1f}")
PY
