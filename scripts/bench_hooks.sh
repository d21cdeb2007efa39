#!/usr/bin/env bash
# Compares the five communication hooks: 2 Gloo worker processes on
# Fashion-MNIST (or, with --gpu, one NCCL worker per GPU), PowerSGD
# compressing from step 10. Prints one table.
#
#   bash scripts/bench_hooks.sh [--steps 300] [--rounds 3] [--keep DIR] [--gpu] [--against BINARY]
#
# The hooks run in turn, --rounds times over, and each figure is the median
# of its rounds: on a shared 2-core machine a single run is noisy. --keep
# leaves each run's --path (log and metrics.csv) in DIR/<hook>.<round>.
# --against BINARY runs another mnist_ddp (an older build) right after each
# of this build's runs and prints its table too: a before/after in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=300 rounds=3 keep="" placement=(--backend gloo --nproc 2) against=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --keep) keep="$2"; shift 2 ;;
    --gpu) placement=(--backend nccl); shift ;;
    --against) against="$2"; shift 2 ;;
    *) echo "usage: bash scripts/bench_hooks.sh [--steps N] [--rounds R] [--keep DIR] [--gpu] [--against BINARY]" >&2; exit 2 ;;
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
[ -z "$against" ] || [ -x "$against" ] || { echo "bench_hooks: --against $against: not an executable" >&2; exit 2; }
runs=() others=()
# bench BINARY DIR HOOK: one run, its --path DIR.
bench() {
  if ! "$1" "${placement[@]}" --dataset fashion-mnist --epochs 1 --max-steps "$steps" \
      --start-powersgd-iter 10 --compression "$3" --log-interval 50 --checkpoint-every 0 \
      --path "$2" >"$2.txt" 2>&1; then
    echo "bench_hooks: the $3 run of $1 failed:" >&2
    tail -n 5 "$2.txt" >&2
    exit 1
  fi
}
for round in $(seq 1 "$rounds"); do
  for hook in none fp16 powersgd powersgd_fp16 batched_powersgd_fp16; do
    bench ./build/mnist_ddp "$out/$hook.$round" "$hook"
    runs+=("$out/$hook.$round")
    if [ -n "$against" ]; then
      bench "$against" "$out/$hook.$round.against" "$hook"
      others+=("$out/$hook.$round.against")
    fi
  done
done
[ -z "$against" ] || echo "This build:"
python3 scripts/bench_report.py hooks "${runs[@]}"
if [ -n "$against" ]; then
  echo
  echo "$against:"
  python3 scripts/bench_report.py hooks "${others[@]}"
fi
