#!/usr/bin/env bash
# Configures and builds Release into build/. Arguments go to cmake --build
# (for example: --target mnist_ddp).
#
# The LibTorch is scripts/libtorch.sh's choice, named in one line before
# configuring. build/ is configured afresh when the LibTorch changes, but a
# CUDA build there is replaced by a CPU one only with MNIST_DDP_CPU=1.
# What configuring finds missing (a CUDA toolkit, NCCL's header, an
# unsupported LibTorch) is one line naming the fix: cmake/LibTorch.cmake.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/libtorch.sh
choose_libtorch
echo "build.sh: $(describe_libtorch)"
[ -n "$LIBTORCH_DIR" ] || { echo "build.sh: no LibTorch installed: bash scripts/install_deps.sh build installs Debian's" >&2; exit 1; }

built="$(sed -n 's/^Torch_DIR:PATH=//p' build/CMakeCache.txt 2>/dev/null)" || true
if [ -n "$built" ] && [ "$(readlink -f "$built")" != "$(readlink -f "$LIBTORCH_DIR")" ]; then
  if torch_has_cuda "$built" && [ -z "$LIBTORCH_CUDA" ] && [ "${MNIST_DDP_CPU:-}" != 1 ]; then
    echo "build.sh: build/ holds a CUDA build (LibTorch at $built) and the LibTorch found now has no CUDA: activate the PyTorch it was built with, or set MNIST_DDP_CPU=1 to replace it by a CPU build" >&2
    exit 1
  fi
  echo "build.sh: the LibTorch changed (was $built); configuring build/ afresh"
  rm -rf build
fi
args=(-DCMAKE_BUILD_TYPE=Release "-DTorch_DIR=$LIBTORCH_DIR")
command -v ninja >/dev/null && [ ! -f build/Makefile ] && args+=(-G Ninja)
if ! configure="$(cmake -S . -B build "${args[@]}" 2>&1)"; then
  # Our own checks say what is missing in one line; anything else in full.
  grep -E '^ +mnist_ddp: ' <<<"$configure" | sed 's/^ *//' >&2 || echo "$configure" >&2
  exit 1
fi
grep '^-- mnist_ddp:' <<<"$configure" || true  # the LibTorch, and whether the CUDA/NCCL path is built
cmake --build build -j "$(nproc)" "$@"
