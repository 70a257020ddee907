#!/usr/bin/env bash
# Peak memory per rank over a whole run (prepare included), DDP and ZeRO-1/2/3
# on 2 and 3 ranks, beside what each should hold: its model state (the
# Trainer's own count, which the estimate suite checks against the formulas
# to the byte; ZeRO-3's plus the step buffers it keeps, four of its largest
# units; ZeRO-2's plus its gradient buckets in flight) + the activations
# (estimate) + the process baseline (the same program on the same launcher
# with an 8x8 model). Adam, batch 64 per rank.
# zero3-meta: ZeRO-3 with the model built on the meta device (each rank computes
# only its shards at prepare, NOTE [Models built on meta]).
#
#   bench/memory_peaks.sh [BUILD_DIR]          # default: build
#
# Four peaks per run, the worst rank's: "allocated", the most LibTorch had
# allocated at once (counted at its allocator); "resident", the resident set
# (VmHWM) as the Trainer leaves it by default, with host blocks kept for reuse
# (NOTE [Host blocks kept for reuse], TrainerOptions::cache_host_memory), and
# how far that is from the expectation; "uncached", the resident set with
# glibc's malloc as it comes (--cache_host_memory 0, the default before the
# cache); "returned", the resident set with freed blocks over 1 MiB given back
# to the system (NOTE [Returning host memory], TrainerOptions::return_host_memory).
# Two more columns say where the default run's resident set went: "cache_held", the most the host block
# cache held at once (in use and idle), and "malloc", what glibc's malloc holds from the system at the
# end (its heaps, which rarely shrink, and its mappings: Gloo's buffers, allocations under the cache's
# 128 KiB, the process's own).
# Environment: WIDTHS (default 512,2048 x10,10: 38.8 M parameters, 148 MiB;
# each layer 16 MiB, one ZeRO-3 unit), RANKS ("2 3"), STEPS (timed steps, default 3;
# glibc's heaps grow over more of them, ZeRO-3's step buffers do not).
# Takes about 4 minutes on the 2-core development VM.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
build="${1:-$root/build}"
widths="${WIDTHS:-512,2048,2048,2048,2048,2048,2048,2048,2048,2048,2048,10}"
ranks_list="${RANKS:-2 3}"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
prog="$build/bench/ddp_throughput"
launcher="$build/tools/accel"
[[ -x "$prog" && -x "$launcher" ]] || ninja -C "$build" bench/ddp_throughput tools/accel >&2
log="$(mktemp -d)"
trap 'rm -rf "$log"' EXIT

# run OUT RANKS STRATEGY WIDTHS [RETURN [CACHE]]: one run's output in OUT (STRATEGY zero3-meta: ZeRO-3
# with the model built on the meta device)
run() {
  local strategy="${3%-meta}" meta=0
  [[ "$3" == *-meta ]] && meta=1
  "$launcher" launch -q --num_processes "$2" "$prog" --strategy "$strategy" --optimizer adam --widths "$4" --steps "${STEPS:-3}" \
    --warmup 1 --phases 0 --memory 1 --return_host_memory "${5:-0}" --cache_host_memory "${6:-1}" --build_on_meta "$meta" >"$1" 2>&1 ||
    { cat "$1" >&2; exit 1; }
}
# the largest value of FIELD over the MEMORY lines of OUT
worst() { grep -o "MEMORY .*" "$1" | grep -o "\b$2=[0-9]*" | cut -d= -f2 | sort -n | tail -1; }
result() { grep -o "RESULT .*" "$1" | grep -o "\b$2=[0-9]*" | head -1 | cut -d= -f2; }
mib() { awk -v b="$1" 'BEGIN { printf "%.0f", b / 1048576 }'; }
# bytes of the largest two adjacent gradient buckets (fp32) of the run OUT: the buckets the engine
# built, in bucket order (ddp_throughput's BUCKETS line)
in_flight_buckets() {
  grep -o "BUCKETS .*" "$1" | head -1 | grep -o "numels=[0-9,]*" | cut -d= -f2 | tr ',' '\n' | awk '{
    b = 4 * $1; if (b + prev > pair) pair = b + prev; prev = b } END { printf "%.0f", pair }'
}

# bytes of the largest gradient bucket (fp32) of the run OUT: under ZeRO-3 its largest unit (a unit's
# parameters of one optimizer group are one bucket)
largest_bucket() {
  grep -o "BUCKETS .*" "$1" | head -1 | grep -o "numels=[0-9,]*" | cut -d= -f2 | tr ',' '\n' |
    awk '$1 > m { m = $1 } END { printf "%.0f", 4 * m }'
}

echo "widths $widths, Adam, batch 64 per rank; MiB per rank (worst rank)"
fmt='%-6s %-10s %11s %11s %8s %8s %9s %8s %11s %8s %8s %11s %6s\n'
printf "$fmt" ranks strategy model_state activations baseline expected allocated resident vs_expected uncached returned \
  cache_held malloc
for n in $ranks_list; do
  run "$log/base" "$n" ddp 8,8 1
  baseline="$(worst "$log/base" resident_peak_bytes)"
  # the bare process (the baseline) on a row of its own, for its malloc share
  printf "$fmt" "$n" bare - - - - "$(mib "$(worst "$log/base" allocated_peak_bytes)")" "$(mib "$baseline")" - - - - \
    "$(mib "$(worst "$log/base" malloc_system_bytes)")"
  for s in ddp zero1 zero2 zero3 zero3-meta; do
    run "$log/$s" "$n" "$s" "$widths"
    run "$log/$s.uncached" "$n" "$s" "$widths" 0 0
    run "$log/$s.returned" "$n" "$s" "$widths" 1
    state=$(($(result "$log/$s" param_bytes) + $(result "$log/$s" grad_bytes) + $(result "$log/$s" optim_bytes)))
    # ZeRO-3: the step buffers it keeps (NOTE [Buffers that live as long as the engine]), sized by what a
    # step has in flight at once: in backward, the computing layer's parameters and gradients, the next
    # layer's prefetched parameters and the previous layer's gradients while they are reduce-scattered,
    # four times the largest layer (the pool measured 72.2 MiB on 2 ranks against these 64)
    [[ "$s" == zero3* ]] && state=$((state + 4 * $(largest_bucket "$log/$s")))
    # ZeRO-2: its full gradient buckets exist only within backward (NOTE [Gradient buckets]), at most
    # two at once, neighbours: the one filling and the one reduce-scattered (the rule of ZeRO-3's
    # gradients in accel::estimate::step_buffers; Gloo's receive buffer of the launched one is not counted)
    [[ "$s" == zero2 ]] && state=$((state + $(in_flight_buckets "$log/$s")))
    activations="$(worst "$log/$s" activation_bytes)"
    expected=$((state + activations + baseline))
    resident="$(worst "$log/$s" resident_peak_bytes)"
    printf "$fmt" "$n" "$s" "$(mib "$state")" "$(mib "$activations")" "$(mib "$baseline")" "$(mib "$expected")" \
      "$(mib "$(worst "$log/$s" allocated_peak_bytes)")" "$(mib "$resident")" \
      "$(awk -v r="$resident" -v e="$expected" 'BEGIN { printf "%+.0f%%", 100 * (r - e) / e }')" \
      "$(mib "$(worst "$log/$s.uncached" resident_peak_bytes)")" "$(mib "$(worst "$log/$s.returned" resident_peak_bytes)")" \
      "$(mib "$(worst "$log/$s" cache_most_held_bytes)")" "$(mib "$(worst "$log/$s" malloc_system_bytes)")"
  done
done
