#!/usr/bin/env bash
# Installs what building and running need, where missing (nothing of the
# tests'), fetches MNIST if absent, builds Release, and trains with the
# default --compression powersgd_fp16: one worker per visible GPU (NCCL)
# when this build has CUDA, else 2 CPU worker processes (Gloo).
# Extra arguments go to mnist_ddp: bash run_mnist_ddp.sh --epochs 1 --compression none
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install_deps.sh build
bash scripts/fetch_data.sh mnist
bash scripts/build.sh --target mnist_ddp
exec ./build/mnist_ddp "$@"
