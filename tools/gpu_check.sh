#!/usr/bin/env bash
# The GPU check, for a machine with a GPU and a PyTorch 2.x (CUDA) install:
# builds accel against that PyTorch's LibTorch, runs the CUDA tests and the
# side-by-side with the Python Accelerate (bf16 on the GPU), and prints one
# summary.
#
#   bash tools/gpu_check.sh [PYTHON]        # PYTHON: the one with torch and accelerate (default python3)
#
# Needs meson and ninja. PyPI wheels ship no Gloo headers: the build takes
# Debian's (libgloo-dev), or a folder holding gloo/ named by ACCEL_GLOO_INCLUDE
# (`cp -r /usr/include/gloo <folder>/` on a Debian machine). ACCEL_GPU_BUILD
# names the build folder (default build-gpu); an existing one is reused.
# ACCEL_GPU_MESON_ARGS adds meson options (--wrap-mode=nodownload offline).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${1:-python3}
build=${ACCEL_GPU_BUILD:-build-gpu}
summary=()
say() { summary+=("$*"); echo "gpu_check: $*"; }

torch_dir=$("$python" -c 'import torch, os; print(os.path.dirname(torch.__file__))') || { echo "no torch in $python"; exit 2; }
say "torch $("$python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)'),"\
    "GPU: $("$python" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")')"

setup=(--buildtype=release -Dtorch_dir="$torch_dir" -Dpython="$(command -v "$python")")
[ -n "${ACCEL_GLOO_INCLUDE:-}" ] && setup+=(-Dgloo_include="$(realpath "$ACCEL_GLOO_INCLUDE")")
# Extra meson options, e.g. --wrap-mode=nodownload on a machine without a network.
read -r -a extra <<<"${ACCEL_GPU_MESON_ARGS:-}"
setup+=("${extra[@]}")
start=$(date +%s)
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" "${setup[@]}" >"$build.setup.log" 2>&1 || { tail -20 "$build.setup.log"; say "meson setup FAILED"; exit 1; }
fi
if ninja -C "$build" tests/test_cuda tools/accel bench/accelerate_parity >"$build.ninja.log" 2>&1; then
  say "build against $torch_dir: OK in $(( $(date +%s) - start )) s"
else
  grep -E "error|Error" "$build.ninja.log" | head -20
  say "build FAILED (see $build.ninja.log)"; printf '%s\n' "== summary" "${summary[@]}"; exit 1
fi

status=0
cuda_log=$("$build/tests/test_cuda" ${ACCEL_GPU_TEST_ARGS:-} 2>&1); cuda_status=$?
echo "$cuda_log" | tail -30
if [ $cuda_status -gt 128 ] && command -v gdb >/dev/null; then  # a crash: where
  gdb -batch -ex run -ex bt --args "$build/tests/test_cuda" ${ACCEL_GPU_TEST_ARGS:-} 2>&1 | grep -E "^#|signal" | head -40
fi
say "CUDA tests (exit $cuda_status): $(echo "$cuda_log" | grep -E '^\[doctest\] (test cases|assertions)' | tr '\n' ' ')"
[ $cuda_status -eq 0 ] || status=1

side=$(bash bench/accelerate_side_by_side.sh "$build" "$python" --device cuda 2>&1); side_status=$?
echo "$side"
say "Accelerate side by side (exit $side_status): $(echo "$side" | grep -E 'PARITY|ratio' | tr '\n' ' ')"
[ $side_status -eq 0 ] || status=1

printf '%s\n' "== summary" "${summary[@]}"
exit $status
