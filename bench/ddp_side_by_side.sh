#!/usr/bin/env bash
# DDP side-by-side on this machine, in one go:
#   (a) PyTorch DDP, gloo, 2 ranks      (bench/pytorch_ddp.py, Debian's python3-torch)
#   (b) accel DDP, 2 ranks              (accel launch --num_processes 2 build/bench/ddp_throughput)
#   (c) accel, one process              (the same program alone; 2x this is the naive ceiling)
#   (d) two independent accel processes at once (the measured 2-core ceiling)
# MLP 512-1024-1024-1024-10, batch 64 per rank, SGD(lr=0.01), synthetic data,
# one thread per process. ROUNDS rounds (default 3), alternating whether
# PyTorch or accel goes first; medians over rounds, and ratios taken within
# each round (the host's speed drifts) then the median of those.
#
#   bench/ddp_side_by_side.sh [BUILD_DIR]        # default: build
#   ninja -C build bench-ddp                     # the same, as a run_target
#
# Environment: ROUNDS (3), SECONDS_PER_RUN (4: the timed part of each run; the
# step counts are calibrated from a short single-process run), PYTHON
# (/usr/bin/python3), EXTRA_ACCEL_ARGS (e.g. "--bucket_cap_mb 4").
# The last line is exactly: accel_ddp/pytorch_ddp global samples/s ratio: X
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/bench_lib.sh"
bench_setup 4 "$@"

# global_samples_per_s from a RESULT line in file $1
result_of() { field_of "$1" global_samples_per_s; }

# Calibrate the step counts so that each run's timed part takes ~$seconds.
calibrate
steps_single="$(steps_for 1.0)"
steps_ddp="$(steps_for 0.5)"
steps_torch="$(steps_for 0.45)"
echo "calibration: one accel process ran $single_steps_per_s steps/s; steps per run: single $steps_single," \
     "accel DDP $steps_ddp, PyTorch DDP $steps_torch (+10% warm-up); $rounds rounds"

run_torch() {
  timeout 150 "$python" "$here/pytorch_ddp.py" --nprocs 2 --steps "$steps_torch" --warmup "$(warm "$steps_torch")" \
    --batch 64 >"$log/torch" 2>&1 || { cat "$log/torch" >&2; exit 1; }
  result_of "$log/torch"
}
run_accel_ddp() {
  timeout 150 "$launcher" launch --num_processes 2 "$prog" --steps "$steps_ddp" --warmup "$(warm "$steps_ddp")" \
    --batch 64 "${extra_accel_args[@]}" >"$log/ddp" 2>&1 || { cat "$log/ddp" >&2; exit 1; }
  result_of "$log/ddp"
}
run_single() {
  timeout 150 "$prog" --steps "$steps_single" --warmup "$(warm "$steps_single")" --batch 64 --tag single \
    >"$log/single" 2>&1 || { cat "$log/single" >&2; exit 1; }
  result_of "$log/single"
}
run_two_independent() {
  local a b
  "$prog" --steps "$steps_single" --warmup "$(warm "$steps_single")" --batch 64 --tag indepA >"$log/ia" 2>&1 &
  a=$!
  "$prog" --steps "$steps_single" --warmup "$(warm "$steps_single")" --batch 64 --tag indepB >"$log/ib" 2>&1 &
  b=$!
  wait "$a" || { cat "$log/ia" >&2; exit 1; }
  wait "$b" || { cat "$log/ib" >&2; exit 1; }
  awk -v a="$(result_of "$log/ia")" -v b="$(result_of "$log/ib")" 'BEGIN {printf "%.1f", a + b}'
}

torch_v=() ddp_v=() single_v=() pair_v=() r_ddp_torch=() r_ddp_pair=() r_torch_pair=() r_ddp_2single=()
for ((r = 1; r <= rounds; ++r)); do
  if ((r % 2)); then
    t="$(run_torch)"; d="$(run_accel_ddp)"; s="$(run_single)"; p="$(run_two_independent)"
  else
    p="$(run_two_independent)"; s="$(run_single)"; d="$(run_accel_ddp)"; t="$(run_torch)"
  fi
  torch_v+=("$t"); ddp_v+=("$d"); single_v+=("$s"); pair_v+=("$p")
  r_ddp_torch+=("$(ratio "$d" "$t")"); r_ddp_pair+=("$(ratio "$d" "$p")"); r_torch_pair+=("$(ratio "$t" "$p")")
  r_ddp_2single+=("$(ratio "$d" "$(awk -v s="$s" 'BEGIN {print 2 * s}')")")
  printf 'round %d: global samples/s  pytorch_ddp %s  accel_ddp %s  accel_single %s  two_independent %s  (accel/pytorch %s)\n' \
    "$r" "$t" "$d" "$s" "$p" "${r_ddp_torch[-1]}"
done

echo
echo "Where time goes, last round (per rank, median ms per step; CPU ms per step):"
grep -h 'per-step ms\|CPU ms per step' "$log/ddp" | sed 's/^/  accel DDP /'
grep -h 'per-step ms' "$log/torch" | sed 's/^/  PyTorch DDP /'
grep -h 'per-step ms\|CPU ms' "$log/single" | sed 's/^/  accel single /'
grep -h 'buckets (MiB)' "$log/ddp" | head -1 | sed 's/^/  accel DDP /'
echo
printf 'medians over %d rounds, global samples/s (MLP 512-1024-1024-1024-10, batch 64/rank, 1 thread/process):\n' "$rounds"
printf '  (a) PyTorch DDP, gloo, 2 ranks:        %10.1f\n' "$(median "${torch_v[@]}")"
printf '  (b) accel DDP, 2 ranks:                %10.1f\n' "$(median "${ddp_v[@]}")"
printf '  (c) accel, one process:                %10.1f   (2x: %.1f)\n' "$(median "${single_v[@]}")" \
  "$(awk -v s="$(median "${single_v[@]}")" 'BEGIN {print 2 * s}')"
printf '  (d) two independent accel processes:   %10.1f   (the 2-core ceiling)\n' "$(median "${pair_v[@]}")"
echo "ratios (median of per-round ratios):"
printf '  accel_ddp / 2-core ceiling (d):        %.3f\n' "$(median "${r_ddp_pair[@]}")"
printf '  pytorch_ddp / 2-core ceiling (d):      %.3f\n' "$(median "${r_torch_pair[@]}")"
printf '  accel_ddp / (2 x one process):         %.3f\n' "$(median "${r_ddp_2single[@]}")"
printf 'accel_ddp/pytorch_ddp global samples/s ratio: %.2f\n' "$(median "${r_ddp_torch[@]}")"
