#!/usr/bin/env bash
# Compares the five communication hooks: 2 Gloo worker processes on
# Fashion-MNIST, PowerSGD compressing from step 10. Prints one table.
#
#   bash scripts/bench_hooks.sh [STEPS] [ROUNDS]     (defaults: 300 steps, 3 rounds)
#
# The hooks run in turn, ROUNDS times over, and each figure is the median
# of its rounds: on a shared 2-core machine a single run is noisy.
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-300}"
rounds="${2:-3}"
bash scripts/install_deps.sh >/dev/null
bash scripts/fetch_data.sh fashion-mnist >/dev/null
bash scripts/build.sh --target mnist_ddp >/dev/null

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
runs=()
for round in $(seq 1 "$rounds"); do
  for hook in none fp16 powersgd powersgd_fp16 batched_powersgd_fp16; do
    dir="$out/$hook.$round"
    if ! ./build/mnist_ddp --backend gloo --nproc 2 --dataset fashion-mnist --epochs 1 --max-steps "$steps" \
        --start-powersgd-iter 10 --compression "$hook" --log-interval 1000 --path "$dir" >"$dir.txt" 2>&1; then
      echo "bench_hooks: the $hook run failed:" >&2
      tail -n 5 "$dir.txt" >&2
      exit 1
    fi
    runs+=("$dir")
  done
done
python3 scripts/runlog.py hooks "${runs[@]}"
