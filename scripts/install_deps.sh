#!/usr/bin/env bash
# Installs, from Debian's archive, everything mnist_ddp needs to build, test
# and fetch its data. Installs only what is missing; safe to run again.
set -euo pipefail

cd "$(dirname "$0")/.."
source scripts/libtorch.sh
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
packages=(
  g++ cmake ninja-build pkg-config
  libcli11-dev libspdlog-dev libfmt-dev libgtest-dev zlib1g-dev nlohmann-json3-dev
  python3 curl ca-certificates    # scripts/fetch_data.sh
  gnuplot-nox                     # scripts/plot_metrics.sh
  iproute2                        # tests: two nodes in two network namespaces
  slurm-wlm munge                 # tests: a one-node Slurm cluster (tests/slurm/cluster.sh)
  openmpi-bin mpich               # tests: real mpirun and mpiexec (tests/launchers_test.cpp)
)
# Gloo's headers (no PyTorch install ships them) from the package that goes
# with the LibTorch: Debian 13's CUDA LibTorch conflicts with libgloo-dev.
if installed libtorch-cuda-dev; then
  packages+=(
    libgloo-cuda-dev
    python3-torch-cuda            # tests: Python loads the models we save
  )
elif [ -n "$(libtorch_prefix)" ]; then
  packages+=(libgloo-dev)         # build.sh uses a CUDA PyTorch's or $MNIST_DDP_LIBTORCH
else
  packages+=(
    libgloo-dev
    libtorch-dev                  # Debian's LibTorch (CPU) with c10d: 1.13 on Debian 12, 2.6 on 13
    libopenblas0-openmp           # becomes LibTorch's BLAS: 2x faster steps than the reference BLAS
    python3-torch                 # tests: Python loads the models we save
  )
fi

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
for p in "${packages[@]}"; do
  installed "$p" || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages are installed"
  exit 0
fi
echo "install_deps: installing ${missing[*]}"
as_root apt-get update -qq
as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install_deps: done"
