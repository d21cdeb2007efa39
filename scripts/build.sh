#!/usr/bin/env bash
# Configures and builds Release into build/. Arguments go to cmake --build
# (for example: --target mnist_ddp).
#
# LibTorch: Debian's CPU build by default. For the NCCL path, point CMake at
# a CUDA LibTorch with CMAKE_PREFIX_PATH, e.g. the one inside PyTorch:
#   CMAKE_PREFIX_PATH="$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')" bash scripts/build.sh
set -euo pipefail
cd "$(dirname "$0")/.."
generator=()
command -v ninja >/dev/null && [ ! -f build/Makefile ] && generator=(-G Ninja)
cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" "$@"
