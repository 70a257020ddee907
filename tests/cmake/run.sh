#!/usr/bin/env bash
# Installs this build of accel into a temporary prefix, builds tests/cmake
# with CMake against it and the LibTorch it was built with, and runs it.
#   tests/cmake/run.sh BUILD_DIR TORCH_DIR
# Exits 77 (skipped) where that LibTorch has no CMake package (Debian's).
set -euo pipefail
build=$(realpath "$1"); torch_dir=$2
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "$torch_dir" ] || [ ! -f "$torch_dir/share/cmake/Torch/TorchConfig.cmake" ]; then
  echo "SKIP: this LibTorch has no share/cmake/Torch (the PyPI build, ACCEL_TORCH=pypi, has one)"; exit 77
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
meson install -C "$build" --no-rebuild --quiet --destdir "$tmp/root" >/dev/null
prefix=$(meson introspect "$build" --buildoptions | python3 -c \
  'import json,sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"] == "prefix"))')
cmake -S "$here" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$tmp/root$prefix" -DTorch_DIR="$torch_dir/share/cmake/Torch" >"$tmp/cmake.log" 2>&1 \
  || { tail -30 "$tmp/cmake.log"; exit 1; }
cmake --build "$tmp/build" >"$tmp/build.log" 2>&1 || { grep -E "error|Error|undefined" "$tmp/build.log" | cut -c1-400 | head -20; exit 1; }
OMP_NUM_THREADS=1 "$tmp/build/consumer"
