#!/usr/bin/env bash
# One entry point for a fresh Debian bookworm machine (as root):
#   bash tools/run.sh demo   install what is missing, build, run the MLP example on 2 processes
#   bash tools/run.sh test   install what is missing, build, run the test suite
#   bash tools/run.sh build  install what is missing and build
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-demo}"
build_dir="${ACCEL_BUILD_DIR:-build}"

# Debian packages: LibTorch (CPU) and the Gloo headers its c10d includes,
# OpenBLAS (without it LibTorch falls back to a 20x slower reference BLAS),
# the build tools, the test/benchmark libraries, and python3-torch as the
# PyTorch reference of the side-by-side checks.
packages=(g++ meson ninja-build pkg-config ccache libtorch-dev libgloo-dev libopenblas0-pthread
          nlohmann-json3-dev doctest-dev libbenchmark-dev libgoogle-glog-dev python3 python3-torch)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "accel: installing ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -f "$build_dir/build.ninja" ]; then
  meson setup "$build_dir" --buildtype=release
fi
start=$(date +%s)
ninja -C "$build_dir"
echo "accel: build took $(( $(date +%s) - start )) s"

case "$what" in
  build) ;;
  demo)
    "$build_dir/tools/accel" launch --num_processes 2 "$build_dir/examples/mlp" --epochs 3 ;;
  test)
    status=0
    meson test -C "$build_dir" --print-errorlogs --num-processes 1 || status=$?
    # One summary line any CI reads: "N passed, N failed".
    /usr/bin/python3 - "$build_dir/meson-logs/testlog.json" <<'PY'
import json, sys
results = [json.loads(line)["result"] for line in open(sys.argv[1]) if line.strip()]
passed = sum(r in ("OK", "EXPECTEDFAIL") for r in results)
skipped = sum(r == "SKIP" for r in results)
print(f"{passed} passed, {len(results) - passed - skipped} failed, {skipped} skipped")
PY
    exit $status ;;
  *) echo "usage: bash tools/run.sh [demo|test|build]" >&2; exit 2 ;;
esac
