#!/usr/bin/env bash
# Installs, from the distribution's archive, what is missing of a list:
#
#   bash scripts/install_deps.sh build       # to build and run (run_mnist_ddp.sh)
#   bash scripts/install_deps.sh test        # that, and what only the tests use (scripts/test.sh)
#   bash scripts/install_deps.sh PACKAGE...  # those Debian packages
#
# Nothing missing: nothing asked of anyone, root or not. Something missing:
# apt-get as root, or through sudo where that works without a password;
# otherwise one line naming the packages and the command that installs
# them, and exit 1. Without apt, one line naming what is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
me="install_deps.sh"

# What building and running need. LibTorch and Gloo's headers are added
# below, as they go with the LibTorch chosen.
build_packages=(
  g++ cmake ninja-build
  libcli11-dev libspdlog-dev libfmt-dev zlib1g-dev nlohmann-json3-dev
  python3 curl ca-certificates    # scripts/fetch_data.sh
)
# What only the tests use.
test_packages=(
  googletest                      # built with LibTorch's flags (cmake/GoogleTest.cmake)
  gnuplot-nox                     # scripts/plot_metrics.sh
  iproute2                        # two nodes in two network namespaces
  slurm-wlm munge                 # a one-node Slurm cluster (tests/slurm/cluster.sh)
  openmpi-bin mpich               # real mpirun and mpiexec (tests/launchers_test.cpp)
  dataset-fashion-mnist           # the examples/ train on it (tests/package_test.sh)
)

case "${1:-}" in
  build | test)
    source scripts/libtorch.sh
    choose_libtorch  # stops here on a GPU machine whose LibTorch has no CUDA
    if [ "$LIBTORCH_DEBIAN" = libtorch-cuda-dev ]; then
      build_packages+=(libgloo-cuda-dev)    # Debian 13's CUDA LibTorch conflicts with libgloo-dev
      test_packages+=(python3-torch-cuda)   # Python loads the models we save; torchrun
    elif [ "$LIBTORCH_DEBIAN" = libtorch-dev ]; then
      build_packages+=(
        libgloo-dev
        libtorch-dev                  # Debian's LibTorch (CPU) with c10d: 1.13 on Debian 12, 2.6 on 13
        libopenblas0-openmp           # becomes LibTorch's BLAS: 2x faster steps than the reference BLAS
      )
      test_packages+=(python3-torch)
    else
      build_packages+=(libgloo-dev)   # a PyTorch's or an unpacked LibTorch ships no Gloo headers
    fi
    packages=("${build_packages[@]}")
    [ "$1" = test ] && packages+=("${test_packages[@]}")
    ;;
  "" | -*)
    echo "usage: bash scripts/install_deps.sh build|test|PACKAGE..." >&2
    exit 2
    ;;
  *) packages=("$@") ;;
esac

if ! command -v dpkg-query >/dev/null || ! command -v apt-get >/dev/null; then
  echo "$me: no apt here, so nothing is checked or installed; needed (Debian's names): ${packages[*]}"
  exit 0
fi

# One dpkg-query for all: a package is there when its status says installed.
installed="$(dpkg-query -W -f='${Package} ${Status}\n' "${packages[@]}" 2>/dev/null | awk '/ install ok installed$/ {print $1}')" || true
missing=()
for p in "${packages[@]}"; do
  grep -qx -- "$p" <<<"$installed" || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "$me: the ${#packages[@]} packages needed are installed"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "$me: missing Debian packages ${missing[*]}; install them with: sudo apt-get install --no-install-recommends ${missing[*]}" >&2
  exit 1
fi
echo "$me: installing ${missing[*]}"
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
