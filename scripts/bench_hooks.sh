#!/usr/bin/env bash
# Compares the five communication hooks: 2 Gloo worker processes on
# Fashion-MNIST (or, with --gpu, one NCCL worker per GPU), PowerSGD
# compressing from step 10. Prints one table.
#
#   bash scripts/bench_hooks.sh [--steps 300] [--rounds 3] [--keep DIR] [--gpu]
#
# The hooks run in turn, --rounds times over, and each figure is the median
# of its rounds: on a shared 2-core machine a single run is noisy. --keep
# leaves each run's --path (log and metrics.csv) in DIR/<hook>.<round>.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=300 rounds=3 keep="" placement=(--backend gloo --nproc 2)
while [ "$#" -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --keep) keep="$2"; shift 2 ;;
    --gpu) placement=(--backend nccl); shift ;;
    *) echo "usage: bash scripts/bench_hooks.sh [--steps N] [--rounds R] [--keep DIR] [--gpu]" >&2; exit 2 ;;
  esac
done
bash scripts/install_deps.sh build >/dev/null
bash scripts/fetch_data.sh fashion-mnist >/dev/null
bash scripts/build.sh --target mnist_ddp >/dev/null

out="$keep"
if [ -z "$out" ]; then
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"
runs=()
for round in $(seq 1 "$rounds"); do
  for hook in none fp16 powersgd powersgd_fp16 batched_powersgd_fp16; do
    dir="$out/$hook.$round"
    if ! ./build/mnist_ddp "${placement[@]}" --dataset fashion-mnist --epochs 1 --max-steps "$steps" \
        --start-powersgd-iter 10 --compression "$hook" --log-interval 50 --checkpoint-every 0 \
        --path "$dir" >"$dir.txt" 2>&1; then
      echo "bench_hooks: the $hook run failed:" >&2
      tail -n 5 "$dir.txt" >&2
      exit 1
    fi
    runs+=("$dir")
  done
done
python3 scripts/bench_report.py hooks "${runs[@]}"
