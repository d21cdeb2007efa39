# Which LibTorch mnist_ddp builds against, and why. Sourced by
# install_deps.sh and build.sh; run on its own, it prints its choice:
#
#   bash scripts/libtorch.sh
#
# The first that applies:
#   1. $MNIST_DDP_LIBTORCH: an unpacked LibTorch (the directory holding
#      include/, lib/, share/), or a PyTorch's torch.utils.cmake_prefix_path;
#   2. the PyTorch with CUDA of the first of these Pythons that has one:
#      $VIRTUAL_ENV's (an active venv), $CONDA_PREFIX's (an active conda
#      env), python3, python;
#   3. the system's LibTorch (Debian's libtorch-dev, CPU; or on Debian 13
#      libtorch-cuda-dev);
#   4. a PyTorch without CUDA of one of those Pythons, when the system has no
#      LibTorch;
#   5. Debian's libtorch-dev, which install_deps.sh then installs.
# A machine with an NVIDIA GPU stops here when that LibTorch has no CUDA,
# unless MNIST_DDP_CPU=1 asks for a CPU build.

# CUDA major.minor of a cuXYZ tag (cu124 -> 12.4, cu130 -> 13.0).
cuda_of_tag() { if [[ "$1" =~ cu([0-9]+)([0-9])$ ]]; then echo "${BASH_REMATCH[1]}.${BASH_REMATCH[2]}"; fi; }

# The directory holding TorchConfig.cmake under a LibTorch or CMake prefix.
torch_config_dir() {
  local d
  for d in "$1" "$1/Torch" "$1/share/cmake/Torch" "$1/lib/cmake/Torch" "$1"/lib/*/cmake/Torch; do
    [ -f "$d/TorchConfig.cmake" ] && { (cd "$d" && pwd -P); return 0; }
  done
  return 1
}
torch_version() { sed -n 's/^set(PACKAGE_VERSION "\([^"]*\)").*/\1/p' "$1/TorchConfigVersion.cmake" 2>/dev/null; }
# The same test cmake/LibTorch.cmake makes: Caffe2's config says whether it was built with CUDA.
torch_has_cuda() { grep -q 'set(CAFFE2_USE_CUDA ON)' "$1/../Caffe2/Caffe2Config.cmake" 2>/dev/null; }
# The Debian package a TorchConfig.cmake directory comes from, if one.
debian_package_of() { dpkg-query -S "$1/TorchConfig.cmake" 2>/dev/null | cut -d: -f1 || true; }

has_nvidia_gpu() {
  [ -e /dev/nvidia0 ] || { command -v nvidia-smi >/dev/null && timeout 20 nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }
}

# The Pythons users keep a PyTorch in, each once.
pythons() {
  local py seen=" " key
  for py in ${VIRTUAL_ENV:+"$VIRTUAL_ENV/bin/python"} ${CONDA_PREFIX:+"$CONDA_PREFIX/bin/python"} python3 python; do
    py="$(command -v "$py" 2>/dev/null)" || continue
    key="$(dirname "$py"):$(readlink -f "$py")"  # venv/bin/python and venv/bin/python3 are one
    [[ "$seen" == *" $key "* ]] && continue
    seen+="$key "
    echo "$py"
  done
}

# Sets LIBTORCH_DIR (TorchConfig.cmake's directory; empty when Debian's is
# yet to be installed), LIBTORCH_VERSION, LIBTORCH_CUDA (a version, "yes"
# where unknown, or empty for a CPU LibTorch), LIBTORCH_WHY and
# LIBTORCH_DEBIAN (the Debian package it comes from, if one). Exits with
# one line where no LibTorch will do.
choose_libtorch() {
  local me="${0##*/}" py out version cuda prefix dir looked="" cpu_dir="" cpu_why=""
  LIBTORCH_DIR="" LIBTORCH_VERSION="" LIBTORCH_CUDA="" LIBTORCH_WHY="" LIBTORCH_DEBIAN=""
  if [ -n "${MNIST_DDP_LIBTORCH:-}" ]; then
    LIBTORCH_DIR="$(torch_config_dir "$MNIST_DDP_LIBTORCH")" || {
      echo "$me: MNIST_DDP_LIBTORCH=$MNIST_DDP_LIBTORCH holds no TorchConfig.cmake: set it to an unpacked LibTorch (the directory holding include/, lib/, share/) or to python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'" >&2
      exit 2
    }
    LIBTORCH_WHY="set by MNIST_DDP_LIBTORCH"
    local root="$LIBTORCH_DIR/../../.."
    if torch_has_cuda "$LIBTORCH_DIR"; then
      LIBTORCH_CUDA="$(cuda_of_tag "$(cat "$root/build-version" 2>/dev/null)")"
      LIBTORCH_CUDA="${LIBTORCH_CUDA:-yes}"
    fi
  else
    while read -r py; do
      out="$(timeout 120 "$py" -c 'import torch, torch.utils; print(torch.__version__); print(torch.version.cuda or ""); print(torch.utils.cmake_prefix_path)' 2>/dev/null)" ||
        { looked+="${looked:+, }$py: no torch"; continue; }
      { read -r version; read -r cuda; read -r prefix; } <<<"$out"
      dir="$(torch_config_dir "$prefix")" || dir=""
      looked+="${looked:+, }$py: torch $version"
      if [ -n "$cuda" ]; then looked+=" with CUDA $cuda"; else looked+=" without CUDA"; fi
      [ -n "$dir" ] || { looked+=" (no CMake files)"; continue; }
      if [ -n "$cuda" ]; then
        LIBTORCH_DIR="$dir" LIBTORCH_CUDA="$cuda" LIBTORCH_WHY="the PyTorch of $py"
        break
      fi
      [ -n "$cpu_dir" ] || { cpu_dir="$dir"; cpu_why="the PyTorch of $py"; }
    done < <(pythons)
    if [ -z "$LIBTORCH_DIR" ]; then
      local why="no Python here has a CUDA PyTorch with CMake files (${looked:-no python3, no python})"
      if dir="$(torch_config_dir /usr/local || torch_config_dir /usr)"; then
        local package from="the system's"
        package="$(debian_package_of "$dir")"
        [ -z "$package" ] || from="Debian's $package"
        LIBTORCH_DIR="$dir" LIBTORCH_WHY="$from, as $why"
        torch_has_cuda "$dir" && LIBTORCH_CUDA=yes
      elif [ -n "$cpu_dir" ]; then
        LIBTORCH_DIR="$cpu_dir" LIBTORCH_WHY="$cpu_why, as the system has no LibTorch and $why"
      else
        LIBTORCH_DEBIAN=libtorch-dev LIBTORCH_WHY="Debian's libtorch-dev, not installed yet, as $why"
      fi
    fi
  fi
  if [ -n "$LIBTORCH_DIR" ]; then
    LIBTORCH_VERSION="$(torch_version "$LIBTORCH_DIR")"
    LIBTORCH_DEBIAN="$(debian_package_of "$LIBTORCH_DIR")"
  fi
  if [ -z "$LIBTORCH_CUDA" ] && has_nvidia_gpu && [ "${MNIST_DDP_CPU:-}" != 1 ]; then
    echo "$me: this machine has an NVIDIA GPU but the LibTorch found has no CUDA ($(describe_libtorch)); activate the venv or conda env of a CUDA PyTorch, or set MNIST_DDP_LIBTORCH to an unpacked CUDA LibTorch; MNIST_DDP_CPU=1 builds for the CPU anyway" >&2
    exit 1
  fi
}

# One line: which LibTorch, where, CUDA or not, and why.
describe_libtorch() {
  local cuda
  case "$LIBTORCH_CUDA" in
    "") cuda="CPU only" ;;
    yes) cuda="with CUDA" ;;
    *) cuda="with CUDA $LIBTORCH_CUDA" ;;
  esac
  echo "LibTorch ${LIBTORCH_VERSION:-(to be installed)}, $cuda, at ${LIBTORCH_DIR:-/usr}: ${LIBTORCH_WHY}"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  choose_libtorch
  echo "libtorch.sh: $(describe_libtorch)"
fi
