#!/usr/bin/env bash
# One entry point for a fresh Debian bookworm machine (as root):
#   bash tools/run.sh demo   install what is missing, build, run the MLP example on 2 processes
#   bash tools/run.sh test   install what is missing, build, run the test suite against both LibTorches
#   bash tools/run.sh build  install what is missing and build
#
# Which LibTorch: ACCEL_TORCH=debian (Debian's 1.13.1, CPU), pypi (LibTorch 2.x
# from PyPI's torch wheel, a CUDA build that also runs on a CPU, with the
# Python accelerate beside it, in a venv outside the tree: $ACCEL_VENV, default
# ~/.cache/accel/torch-<version>) or both. `test` defaults to
# both; `demo` and `build` to debian, which installs in a minute where the
# wheel and its CUDA libraries are 5 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-demo}"
build_dir="${ACCEL_BUILD_DIR:-build}"
if [ "$what" = test ]; then torch="${ACCEL_TORCH:-both}"; else torch="${ACCEL_TORCH:-debian}"; fi
pypi_torch="${ACCEL_PYPI_TORCH:-2.15.0}"
pypi_accelerate="${ACCEL_PYPI_ACCELERATE:-1.15.0}"
pypi_transformers="${ACCEL_PYPI_TRANSFORMERS:-5.25.0}"
# Outside the source tree: meson refuses include paths inside it, and clones share it.
venv="${ACCEL_VENV:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/accel/torch-$pypi_torch}"
case "$torch" in debian|pypi|both) ;; *) echo "ACCEL_TORCH must be debian, pypi or both, not '$torch'" >&2; exit 2 ;; esac

# Debian packages: LibTorch (CPU) and the Gloo headers its c10d includes (the
# PyPI wheel ships no Gloo headers either, so both builds use Debian's),
# OpenBLAS (without it LibTorch falls back to a 20x slower reference BLAS),
# the build tools, the test/benchmark libraries, python3-torch as the
# PyTorch reference of the side-by-side checks, and stb (the image decoder of
# the vision example).
packages=(g++ meson ninja-build pkg-config ccache cmake libtorch-dev libgloo-dev libopenblas0-pthread
          nlohmann-json3-dev doctest-dev libbenchmark-dev libgoogle-glog-dev python3 python3-torch python3-venv
          libstb-dev)
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

# LibTorch 2.x: PyPI's torch wheel (its torch/ folder is a LibTorch: include/,
# lib/, share/cmake/Torch) and accelerate, the reference of the parity checks.
provision_pypi() {
  # tensorboard: its own reader checks the event files accel's tracker writes;
  # transformers: its GPT2LMHeadModel loads what accel saves, and the reverse.
  if ! "$venv/bin/python" -c "import torch, accelerate, tensorboard, transformers, sys; sys.exit(torch.__version__.split('+')[0] != '$pypi_torch')" \
       2>/dev/null; then
    echo "accel: installing torch==$pypi_torch, accelerate==$pypi_accelerate, transformers==$pypi_transformers and tensorboard from PyPI into $venv (about 5 GB)" >&2
    mkdir -p "$(dirname "$venv")" && /usr/bin/python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q --disable-pip-version-check "torch==$pypi_torch" "accelerate==$pypi_accelerate" \
      "transformers==$pypi_transformers" tensorboard >&2
  fi
  "$venv/bin/python" -c 'import torch, os; print(os.path.dirname(torch.__file__))'
}

# build DIR [meson options...]: everything, or for the demo only what it runs
# (the command line and the MLP example: a newcomer's first minutes count).
build() {
  local dir=$1; shift
  if [ -f "$dir/build.ninja" ]; then
    [ $# -eq 0 ] || meson configure "$dir" "$@" >/dev/null
  else
    meson setup "$dir" --buildtype=release "$@"
  fi
  local start; start=$(date +%s)
  if [ "$what" = demo ]; then ninja -C "$dir" tools/accel examples/mlp; else ninja -C "$dir"; fi
  echo "accel: build of $dir took $(( $(date +%s) - start )) s"
}

dirs=()
if [ "$torch" != pypi ]; then build "$build_dir"; dirs+=("$build_dir"); fi
if [ "$torch" != debian ]; then
  torch_dir=$(provision_pypi)
  # After the Debian build, the compile-time checks (the same sources) are sampled.
  checks=all; [ "$torch" = pypi ] || checks=sample
  build "$build_dir-pypi" -Dtorch_dir="$torch_dir" -Dcompile_checks="$checks"
  dirs+=("$build_dir-pypi")
fi

case "$what" in
  build) ;;
  demo)
    "${dirs[0]}/tools/accel" launch --num_processes 2 "${dirs[0]}/examples/mlp" --epochs 3 ;;
  test)
    status=0
    for dir in "${dirs[@]}"; do
      echo "accel: testing $dir"
      meson test -C "$dir" --print-errorlogs --num-processes 1 || status=$?
    done
    # One summary line any CI reads: "N passed, N failed".
    /usr/bin/python3 - "${dirs[@]}" <<'PY'
import json, sys
results = [json.loads(line)["result"] for d in sys.argv[1:]
           for line in open(f"{d}/meson-logs/testlog.json") if line.strip()]
passed = sum(r in ("OK", "EXPECTEDFAIL") for r in results)
skipped = sum(r == "SKIP" for r in results)
print(f"{passed} passed, {len(results) - passed - skipped} failed, {skipped} skipped")
PY
    exit $status ;;
  *) echo "usage: bash tools/run.sh [demo|test|build]" >&2; exit 2 ;;
esac
