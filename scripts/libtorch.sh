# Sourced by the scripts: which LibTorch to build against (see build.sh).
# libtorch_prefix prints a prefix for CMAKE_PREFIX_PATH, or nothing for Debian's.
libtorch_prefix() {
  if [ -n "${MNIST_DDP_LIBTORCH:-}" ]; then
    echo "$MNIST_DDP_LIBTORCH"
  elif python3 -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
    python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'
  fi
}
