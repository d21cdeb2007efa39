#!/usr/bin/env bash
# Installs what is missing, fetches MNIST if absent, builds, runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/fetch_data.sh mnist
bash scripts/build.sh
cd build
# One test at a time: the process tests time signals and training runs.
# Long variants (label slow) run with: cd build && ctest -L slow
ctest --output-on-failure --timeout 900 --label-exclude slow
