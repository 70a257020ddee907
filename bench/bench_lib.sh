# Shared by bench/ddp_side_by_side.sh and bench/zero_side_by_side.sh; sourced
# after `set -euo pipefail` and after `here` (this folder) is set.

# bench_setup DEFAULT_SECONDS [BUILD_DIR]: sets root, build, rounds, seconds,
# python, extra_accel_args, prog, launcher and log (a temporary folder removed
# on exit), one thread per process; builds ddp_throughput and the launcher
# where they are missing, and checks that $python has torch.
bench_setup() {
  root="$(dirname "$here")"
  build="${2:-$root/build}"
  rounds="${ROUNDS:-3}"
  seconds="${SECONDS_PER_RUN:-$1}"
  python="${PYTHON:-/usr/bin/python3}"
  extra_accel_args=(${EXTRA_ACCEL_ARGS:-})
  prog="$build/bench/ddp_throughput"
  launcher="$build/tools/accel"

  export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

  if [[ ! -x "$prog" || ! -x "$launcher" ]]; then
    ninja -C "$build" bench/ddp_throughput tools/accel >&2
  fi
  "$python" -c 'import torch' 2>/dev/null || { echo "error: $python has no torch (apt-get install python3-torch)" >&2; exit 1; }

  log="$(mktemp -d)"
  trap 'rm -rf "$log"' EXIT
}

# field $2 (e.g. global_samples_per_s) of the RESULT line in file $1
field_of() {
  local v
  v="$(grep -o "RESULT .*" "$1" | tail -1 | grep -o "\b$2=[0-9.]*" | head -1 | cut -d= -f2)"
  if [[ -z "$v" ]]; then
    echo "error: no RESULT line with $2 in this run's output:" >&2
    cat "$1" >&2
    exit 1
  fi
  echo "$v"
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {if (NR % 2) print a[(NR+1)/2]; else printf "%.4f\n", (a[NR/2]+a[NR/2+1])/2}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.4f", a / b}'; }
max() { awk -v a="$1" -v b="$2" 'BEGIN {print (a > b ? a : b)}'; }

# calibrate [ARGS...]: one short single-process run of $prog ARGS sets
# single_steps_per_s, from which steps_for F gives the steps that make a run
# at F times that speed last ~$seconds (at least 20), and warm N the warm-up
# steps for N timed ones (10%, at least 5).
calibrate() {
  "$prog" "$@" --steps 30 --warmup 5 --tag calibrate >"$log/cal" 2>&1 || { cat "$log/cal" >&2; exit 1; }
  single_steps_per_s="$(field_of "$log/cal" steps_per_s)"
}
steps_for() { awk -v s="$single_steps_per_s" -v f="$1" -v t="$seconds" 'BEGIN {n = int(s * f * t); print (n < 20 ? 20 : n)}'; }
warm() { max 5 $(($1 / 10)); }
