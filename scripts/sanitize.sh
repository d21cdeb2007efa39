#!/usr/bin/env bash
# The library, its launcher and its tests built with AddressSanitizer and
# UndefinedBehaviorSanitizer (LibTorch stays as it is, uninstrumented) in
# build-asan/, then the tests that exercise the library's lifetimes: the
# in-process suites (label unit, but for the Docs and Layout ones, which
# read files) and the Mistakes and Legit groups, whose programs run under
# the instrumented launcher, but for the Legit ones that only pause a rank
# for seconds (their code is the others'). Any report fails the run.
#
#   bash scripts/sanitize.sh            # configure, build, test
#   bash scripts/sanitize.sh -R Join    # the same, these tests only (ctest's arguments)
#
# CI runs it as a leg of its own (.ci/run). It uses the LibTorch
# scripts/build.sh would, and what scripts/install_deps.sh test installs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh test
bash scripts/fetch_data.sh mnist
source scripts/libtorch.sh
choose_libtorch
echo "sanitize.sh: $(describe_libtorch)"
[ -n "$LIBTORCH_DIR" ] || { echo "sanitize.sh: no LibTorch installed: bash scripts/install_deps.sh build installs Debian's" >&2; exit 1; }

# vptr needs every class's type information instrumented alike: LibTorch's
# is not. Leaks are not looked for: a shut-down group's streams and the
# store's helper threads are left to the process's end by design.
sanitizers="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
args=(-DCMAKE_BUILD_TYPE=Release "-DTorch_DIR=$LIBTORCH_DIR" "-DCMAKE_CXX_FLAGS=$sanitizers"
      -DCMAKE_CXX_FLAGS_RELEASE=-O1 "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined")
command -v ninja >/dev/null && [ ! -f build-asan/Makefile ] && args+=(-G Ninja)
cmake -S . -B build-asan "${args[@]}" >/dev/null
cmake --build build-asan -j "$(nproc)" --target mnist_ddp mnist_ddp_tests

# Container-overflow annotations need every std::vector's user
# instrumented, LibTorch included: off. Every report ends the process
# (exitcode 86 for ASan, halt for UBSan), so ctest sees it fail.
export ASAN_OPTIONS="detect_leaks=0:detect_container_overflow=0:abort_on_error=0:exitcode=86:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
cd build-asan
run() { ctest --output-on-failure --no-tests=error --timeout 900 -j "$(nproc)" "$@"; }
if [ "$#" -gt 0 ]; then
  run "$@"
else
  run -L unit -E '^(Docs|Layout)$'
  run -R '^(Mistakes|Legit)\.' -E '^Legit\.ARankPaused'
fi
