#!/usr/bin/env bash
# ZeRO side-by-side on this machine, in one go, 2 ranks, Adam(lr=1e-3):
#   (a) PyTorch DDP + ZeroRedundancyOptimizer(Adam), gloo   (bench/pytorch_zero.py: the ZeRO-1 reference)
#   (b) accel DDP                                            (Trainer<accel::DDP>)
#   (c) accel ZeRO-1                                         (Trainer<accel::ZeRO<1>>: optimizer state sharded)
#   (d) accel ZeRO-2                                         (Trainer<accel::ZeRO<2>>: gradients sharded too)
#   (e) accel ZeRO-3                                         (Trainer<accel::ZeRO<3>>: parameters too; size-based units)
# (b)-(e) are build/bench/ddp_throughput --strategy ddp|zero1|zero2|zero3 --optimizer adam under
# `accel launch --num_processes 2`. The ZeRO-3 model-state bytes are measured
# between steps (the gathered unit of a running step comes on top).
#
# MLP 512-1024-1024-1024-10 (2.6 M params), batch 64 per rank, synthetic
# data, one thread per process. ROUNDS rounds (default 3), the order of the
# four runs reversed every other round; medians over rounds, and ratios vs
# the PyTorch ZeRO-1 reference taken within each round (the host's speed
# drifts) then the median of those.
#
# Model-state bytes are per rank after the timed steps, as
# trainer.model_state_bytes() counts them (parameters, gradients, and the
# optimizer's per-element state; Adam's scalar step not counted); the
# PyTorch script counts the same things (see its docstring). Where the
# two ranks differ both are shown as r0/r1.
#
#   bench/zero_side_by_side.sh [BUILD_DIR]        # default: build
#   ninja -C build bench-zero                     # the same, as a run_target
#
# Environment: ROUNDS (3), SECONDS_PER_RUN (5: the timed part of each run;
# the step counts are calibrated from a short single-process run), PYTHON
# (/usr/bin/python3), EXTRA_ACCEL_ARGS (e.g. "--bucket_cap_mb 4").
# Takes about 1.5-3 minutes on the 2-core development VM.
# The last line is exactly: accel_zero1/pytorch_zero1 global samples/s ratio: X
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/bench_lib.sh"
bench_setup 5 "$@"

# Calibrate the step counts so that each run's timed part takes ~$seconds.
calibrate --optimizer adam
steps_accel="$(steps_for 0.45)"
steps_torch="$(steps_for 0.25)"
echo "calibration: one accel process (Adam) ran $single_steps_per_s steps/s; steps per run: accel $steps_accel," \
     "PyTorch ZeRO-1 $steps_torch (+10% warm-up); $rounds rounds"

names=(pytorch_zero1 accel_ddp accel_zero1 accel_zero2 accel_zero3)
run_one() {  # $1: a name from names; leaves its output in $log/$1
  local out="$log/$1"
  case "$1" in
    pytorch_zero1)
      timeout 150 "$python" "$here/pytorch_zero.py" --nprocs 2 --steps "$steps_torch" --warmup "$(warm "$steps_torch")" \
        --batch 64 >"$out" 2>&1 || { cat "$out" >&2; exit 1; } ;;
    accel_*)
      timeout 150 "$launcher" launch --num_processes 2 "$prog" --strategy "${1#accel_}" --optimizer adam \
        --steps "$steps_accel" --warmup "$(warm "$steps_accel")" --batch 64 "${extra_accel_args[@]}" \
        >"$out" 2>&1 || { cat "$out" >&2; exit 1; } ;;
  esac
  field_of "$out" global_samples_per_s >/dev/null
}

declare -A sps step_ms r_sps
for ((r = 1; r <= rounds; ++r)); do
  if ((r % 2)); then order=("${names[@]}"); else order=(accel_zero3 accel_zero2 accel_zero1 accel_ddp pytorch_zero1); fi
  for n in "${order[@]}"; do run_one "$n"; done
  line="round $r ($(IFS=,; echo "${order[*]}")): global samples/s"
  t="$(field_of "$log/pytorch_zero1" global_samples_per_s)"
  for n in "${names[@]}"; do
    v="$(field_of "$log/$n" global_samples_per_s)"
    sps[$n]+="$v "
    step_ms[$n]+="$(field_of "$log/$n" step_ms) "
    r_sps[$n]+="$(ratio "$v" "$t") "
    line+="  $n $v"
  done
  echo "$line"
done

# Per-rank model-state bytes from the last round: "P G O" of rank $2 in run $1
state_of() {
  grep -o "process $2\] model state bytes: parameters [0-9]* gradients [0-9]* optimizer_state [0-9]*" "$log/$1" |
    tail -1 | awk '{print $7, $9, $11}'
}
mib() { awk -v b="$1" 'BEGIN {printf "%.2f", b / 1048576}'; }
# "x" or "x0/x1" (MiB) of column $2 (1 params, 2 grads, 3 optimizer state) in run $1
per_rank_mib() {
  local a b
  a="$(state_of "$1" 0 | cut -d' ' -f"$2")"; b="$(state_of "$1" 1 | cut -d' ' -f"$2")"
  if [[ -z "$a" || -z "$b" ]]; then echo "?"; return; fi
  if [[ "$a" == "$b" ]]; then mib "$a"; else echo "$(mib "$a")/$(mib "$b")"; fi
}
max_rank_bytes() {  # max over the two ranks of column $2 in run $1
  max "$(state_of "$1" 0 | cut -d' ' -f"$2")" "$(state_of "$1" 1 | cut -d' ' -f"$2")"
}

echo
echo "Where time goes, last round (per rank, median ms per step):"
for n in accel_ddp accel_zero1 accel_zero2 accel_zero3; do
  grep -h 'per-step ms' "$log/$n" | sed "s/^/  $n /"
done
grep -h 'per-step ms' "$log/pytorch_zero1" | sed 's/^/  pytorch_zero1 /'

echo
printf 'medians over %d rounds (MLP 512-1024-1024-1024-10, Adam, batch 64/rank, 2 ranks, 1 thread/process);\n' "$rounds"
printf 'model state per rank in MiB (r0/r1 where the ranks differ); ratios vs pytorch_zero1, median of per-round ratios:\n'
printf '  %-14s %9s %11s %8s %8s %13s %10s %11s\n' run "step ms" "samples/s" "params" "grads" "optim state" "x samples/s" "x optim(max)"
ref_optim="$(max_rank_bytes pytorch_zero1 3)"
for n in "${names[@]}"; do
  printf '  %-14s %9.1f %11.1f %8s %8s %13s %10.2fx %11.2fx\n' "$n" "$(median ${step_ms[$n]})" "$(median ${sps[$n]})" \
    "$(per_rank_mib "$n" 1)" "$(per_rank_mib "$n" 2)" "$(per_rank_mib "$n" 3)" "$(median ${r_sps[$n]})" \
    "$(ratio "$(max_rank_bytes "$n" 3)" "$ref_optim")"
done

# The ZeRO accounting, with P = parameter bytes and N = 2 ranks (Adam: 2P of
# state unsharded): DDP grads P, optim 2P; ZeRO-1 optim 2P/N; ZeRO-2 grads P/N
# too; ZeRO-3 parameters P/N too.
echo "model-state check against the ZeRO formulas (P = parameter bytes, N = 2; padding tolerated):"
full_p="$(state_of accel_ddp 0 | cut -d' ' -f1)"
for n in accel_ddp accel_zero1 accel_zero2 accel_zero3; do
  read -r p g o <<<"$(state_of "$n" 0)"
  case "$n" in
    accel_ddp) eg="$p"; eo=$((2 * p)) ;;
    accel_zero1) eg="$p"; eo="$p" ;;
    accel_zero2) eg=$((p / 2)); eo="$p" ;;
    accel_zero3) eg=$((full_p / 2)); eo="$full_p"
      awk -v p="$p" -v e=$((full_p / 2)) 'BEGIN { printf "  accel_zero3  parameters %d (expected %d): %s\n", p, e, (p >= e && p - e <= 4096) ? "ok" : "MISMATCH" }' ;;
  esac
  awk -v n="$n" -v g="$g" -v o="$o" -v eg="$eg" -v eo="$eo" 'BEGIN {
    ok = (g >= eg && g - eg <= 4096 && o >= eo && o - eo <= 8192);
    printf "  %-12s grads %d (expected %d), optimizer state %d (expected %d): %s\n", n, g, eg, o, eo, ok ? "ok" : "MISMATCH" }'
done
grep -o 'ddp_bucket_bytes=[0-9]*' "$log/pytorch_zero1" | head -1 |
  awk -F= '{printf "  note: PyTorch DDP (gradient_as_bucket_view=False) also keeps %.2f MiB of Reducer buckets per rank, not counted above\n", $2 / 1048576}'

printf 'accel_zero1/pytorch_zero1 global samples/s ratio: %.2f\n' "$(median ${r_sps[accel_zero1]})"
