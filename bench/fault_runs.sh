#!/usr/bin/env bash
# Fault runs: start the MLP example on N ranks, SIGKILL one rank at a random
# moment of training, and record whether every survivor (without a
# launcher, as torchrun or srun would start them) or `accel launch` named the
# dead rank, and whether anything hung (a survivor still running 60 s after
# the kill). NOTE [Naming the dead rank] in include/accel/comm/liveness.hpp.
#
#   bench/fault_runs.sh [BUILD_DIR] [RUNS]      # default: build 20
#
# Prints one line per configuration: runs, named, hung, and the runs that
# were not named (with what the survivors said).
set -uo pipefail
build="${1:-build}"
runs="${2:-20}"
prog="$build/examples/mlp"
accel="$build/tools/accel"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
log="$(mktemp -d)"
trap 'rm -rf "$log"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
random_delay() { awk -v r="$RANDOM" 'BEGIN { printf "%.2f", 1.5 + (r % 300) / 100 }'; }  # 1.5-4.5 s

# $1 world: ranks started by hand with torchrun's variables.
without_launcher() {
  local world=$1 named=0 hung=0 missed=""
  for ((i = 1; i <= runs; ++i)); do
    local port victim pids=()
    port="$(free_port)"
    victim=$((RANDOM % world))
    for ((r = 0; r < world; ++r)); do
      RANK=$r LOCAL_RANK=$r WORLD_SIZE=$world LOCAL_WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        "$prog" --epochs 1000 >"$log/out_$r" 2>"$log/err_$r" &
      pids+=($!)
    done
    sleep "$(random_delay)"
    kill -9 "${pids[$victim]}"
    local ok=1
    for ((r = 0; r < world; ++r)); do
      ((r == victim)) && continue
      local waited=0
      while kill -0 "${pids[$r]}" 2>/dev/null && ((waited < 600)); do sleep 0.1; waited=$((waited + 1)); done
      if kill -0 "${pids[$r]}" 2>/dev/null; then hung=$((hung + 1)); kill -9 "${pids[$r]}"; ok=0; continue; fi
      grep -q "rank $victim is gone" "$log/err_$r" || { ok=0; missed+=" [run $i: victim $victim, rank $r said: $(grep -o 'accel: rank.*' "$log/err_$r" | head -1 | cut -c1-200)]"; }
    done
    wait 2>/dev/null
    named=$((named + ok))
  done
  echo "without launcher, $world ranks: runs $runs, every survivor named the dead rank $named, hung $hung${missed:+, not named:$missed}"
}

# $1 world: under `accel launch`; the launcher's report must name the rank.
with_launcher() {
  local world=$1 named=0 hung=0 missed=""
  for ((i = 1; i <= runs; ++i)); do
    local victim launcher pid
    victim=$((RANDOM % world))
    "$accel" launch --num_processes "$world" --main_process_port "$(free_port)" "$prog" --epochs 1000 \
      >"$log/launch" 2>&1 &
    launcher=$!
    sleep "$(random_delay)"
    pid=""
    for child in $(pgrep -P "$launcher"); do
      if tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null | grep -qx "RANK=$victim"; then pid=$child; fi
    done
    [[ -n "$pid" ]] && kill -9 "$pid"
    local waited=0
    while kill -0 "$launcher" 2>/dev/null && ((waited < 600)); do sleep 0.1; waited=$((waited + 1)); done
    if kill -0 "$launcher" 2>/dev/null; then hung=$((hung + 1)); pkill -9 -P "$launcher"; kill -9 "$launcher"; fi
    wait 2>/dev/null
    if grep -q "rank $victim" "$log/launch" && grep -qi "killed\|signal\|SIGKILL" "$log/launch"; then
      named=$((named + 1))
    else
      missed+=" [run $i: victim $victim: $(tail -2 "$log/launch" | tr '\n' ' ' | cut -c1-200)]"
    fi
  done
  echo "accel launch, $world ranks: runs $runs, launcher named the dead rank $named, hung $hung${missed:+, not named:$missed}"
}

for world in ${WORLDS:-2 3}; do without_launcher "$world"; done
for world in ${LAUNCH_WORLDS:-2 3}; do with_launcher "$world"; done
