#!/usr/bin/env bash
# Installs what is missing (what building and the tests need), fetches MNIST
# if absent, builds, runs every test but the slow ones. Arguments, if any,
# choose the tests instead, as ctest takes them:
#
#   bash scripts/test.sh                      # every test but -L slow
#   bash scripts/test.sh -L 'unit|package'    # the in-process suites and the package's
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh test
bash scripts/fetch_data.sh mnist
bash scripts/build.sh
cd build
# As many tests at once as there are cores; a test that trains with two
# worker processes claims two (tests/CMakeLists.txt). Long variants
# (label slow) run with: cd build && ctest -L slow
[ "$#" -gt 0 ] || set -- --label-exclude slow
ctest --output-on-failure --no-tests=error --timeout 900 -j "$(nproc)" "$@"
