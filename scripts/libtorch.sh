# Sourced by the scripts: which LibTorch to build against (see build.sh).
# libtorch_prefix prints a prefix for CMAKE_PREFIX_PATH, or nothing for
# Debian's own (libtorch-dev, or libtorch-cuda-dev on Debian 13), which
# CMake finds by itself.
libtorch_prefix() {
  if [ -n "${MNIST_DDP_LIBTORCH:-}" ]; then
    echo "$MNIST_DDP_LIBTORCH"
  elif python3 -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
    local prefix
    prefix="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
    # Debian's python3-torch-cuda has no CMake files of its own: its LibTorch is the system's.
    [ -f "$prefix/Torch/TorchConfig.cmake" ] && echo "$prefix"
  fi
  return 0
}
