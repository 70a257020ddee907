#!/usr/bin/env bash
# Two builds of accel side by side in one run: the same ddp_throughput
# training (2 ranks under accel launch) from build A and from build B,
# interleaved round by round so that the machine's drift hits both alike;
# prints each round's global samples/s and the median ratio B/A per strategy.
#
#   bash bench/ab_throughput.sh BUILD_A BUILD_B [ROUNDS] [STRATEGIES]
#   e.g. git worktree add /tmp/head HEAD && meson setup /tmp/head/build --buildtype=release &&
#        ninja -C /tmp/head/build bench/ddp_throughput &&
#        bash bench/ab_throughput.sh /tmp/head/build build 5 "ddp zero2 zero3"
# Each build must hold bench/ddp_throughput; build B's tools/accel launches both.
# Environment: RANKS (default 2), STEPS (timed steps per run, default 40: the
# default model's runs take about a second, and single rounds range 0.85-1.2;
# 200 steps narrow that), WARMUP (default 5), ARGS (more ddp_throughput flags,
# e.g. "--shard_group_size 2" for hybrid on RANKS=4, or --widths).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
a="$1"; b="$2"; rounds="${3:-5}"; strategies="${4:-ddp zero2}"
launcher="$b/tools/accel"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
for prog in "$a/bench/ddp_throughput" "$b/bench/ddp_throughput" "$launcher"; do
  [[ -x "$prog" ]] || { echo "error: $prog is missing (build it first)" >&2; exit 1; }
done
log="$(mktemp -d)"; trap 'rm -rf "$log"' EXIT
rate() {  # global samples/s of one run of build $1 with strategy $2
  # shellcheck disable=SC2086  # ARGS: several flags
  "$launcher" launch -q --num_processes "${RANKS:-2}" --timeout 300 "$1/bench/ddp_throughput" --strategy "$2" \
    --optimizer adam --steps "${STEPS:-40}" --warmup "${WARMUP:-5}" --phases 0 ${ARGS:-} > "$log/out" 2>&1 || { cat "$log/out" >&2; exit 1; }
  grep -o "RESULT .*" "$log/out" | tail -1 | grep -o "global_samples_per_s=[0-9.]*" | cut -d= -f2
}
for strategy in $strategies; do
  ratios=()
  for ((r = 1; r <= rounds; r++)); do
    ra=$(rate "$a" "$strategy"); rb=$(rate "$b" "$strategy")
    ratio=$(awk -v x="$rb" -v y="$ra" 'BEGIN {printf "%.3f", x / y}')
    ratios+=("$ratio")
    echo "$strategy round $r: A $ra B $rb samples/s, B/A $ratio"
  done
  echo "$strategy: median B/A $(printf '%s\n' "${ratios[@]}" | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}') over $rounds rounds"
done
