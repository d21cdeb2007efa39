#!/usr/bin/env bash
# Configures and builds Release into build/. Arguments go to cmake --build
# (for example: --target mnist_ddp).
#
# LibTorch, the first that applies:
#   1. $MNIST_DDP_LIBTORCH: a LibTorch prefix (an unpacked official archive, e.g. /opt/libtorch);
#   2. the LibTorch inside python3's PyTorch, when that PyTorch has CUDA: the NCCL path is built;
#   3. Debian's CPU LibTorch (libtorch-dev).
# build/ is rebuilt from scratch when the LibTorch changes.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/libtorch.sh
prefix="$(libtorch_prefix)"
if [ -f build/CMakeCache.txt ] && [ "$(cat build/.libtorch 2>/dev/null)" != "$prefix" ]; then
  echo "build.sh: LibTorch changed to ${prefix:-the Debian package}; configuring build/ afresh"
  rm -rf build
fi
args=(-DCMAKE_BUILD_TYPE=Release)
[ -n "$prefix" ] && args+=("-DCMAKE_PREFIX_PATH=$prefix")
command -v ninja >/dev/null && [ ! -f build/Makefile ] && args+=(-G Ninja)
configure="$(cmake -S . -B build "${args[@]}")" || { echo "$configure"; exit 1; }
grep '^-- mnist_ddp:' <<<"$configure" || true  # the LibTorch, and whether the CUDA/NCCL path is built
echo "$prefix" > build/.libtorch
cmake --build build -j "$(nproc)" "$@"
