#!/usr/bin/env bash
# Compares the communication hooks (the reference's five and bf16), and
# float32 against --amp bf16 and --accumulate 2 (under none), and prints
# the collective check's cost (none and powersgd_fp16 again with
# --no-check-collectives, in the same rounds): 2 Gloo worker
# processes on Fashion-MNIST (or, with --gpu, one NCCL worker per GPU),
# PowerSGD compressing from step 10. Prints one table; a step of
# --accumulate 2 takes twice the images, so compare images/s.
#
#   bash scripts/bench_hooks.sh [--steps 300] [--rounds 3] [--keep DIR] [--gpu] [--against BINARY] [--data-dir DIR]
#
# The rows run in turn, --rounds times over, and each figure is the median
# of its rounds: on a shared 2-core machine a single run is noisy. --keep
# leaves each run's --path (log and metrics.csv) in DIR/<row>.<round>.
# --against BINARY runs another mnist_ddp (an older build) right after each
# of this build's runs and prints its table too: a before/after in one run.
# --data-dir: where Fashion-MNIST is (default data/, fetched there).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=300 rounds=3 keep="" placement=(--backend gloo --nproc 2) against="" data_dir=data
while [ "$#" -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --keep) keep="$2"; shift 2 ;;
    --gpu) placement=(--backend nccl); shift ;;
    --against) against="$2"; shift 2 ;;
    --data-dir) data_dir="$2"; shift 2 ;;
    *) echo "usage: bash scripts/bench_hooks.sh [--steps N] [--rounds R] [--keep DIR] [--gpu] [--against BINARY] [--data-dir DIR]" >&2; exit 2 ;;
  esac
done
bash scripts/install_deps.sh build >/dev/null
bash scripts/fetch_data.sh fashion-mnist "$data_dir" >/dev/null
bash scripts/build.sh --target mnist_ddp >/dev/null

out="$keep"
if [ -z "$out" ]; then
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"
[ -z "$against" ] || [ -x "$against" ] || { echo "bench_hooks: --against $against: not an executable" >&2; exit 2; }
runs=() others=()
# bench BINARY DIR HOOK [FLAGS...]: one run, its --path DIR.
bench() {
  if ! "$1" "${placement[@]}" --dataset fashion-mnist --data-dir "$data_dir" --epochs 1 --max-steps "$steps" \
      --start-powersgd-iter 10 --compression "$3" --log-interval 50 --checkpoint-every 0 \
      --path "$2" "${@:4}" >"$2.txt" 2>&1; then
    echo "bench_hooks: the ${*:3} run of $1 failed:" >&2
    tail -n 5 "$2.txt" >&2
    return 1
  fi
}
for round in $(seq 1 "$rounds"); do
  for row in none fp16 powersgd powersgd_fp16 batched_powersgd_fp16 bf16 "none --amp bf16" "none --accumulate 2" \
             "none --no-check-collectives" "powersgd_fp16 --no-check-collectives"; do
    read -r -a words <<<"$row"
    name="${row// /_}"
    bench ./build/mnist_ddp "$out/$name.$round" "${words[@]}" || exit 1
    runs+=("$out/$name.$round")
    # An older build may lack a row's flags: that row is left out of its table.
    if [ -n "$against" ] && bench "$against" "$out/$name.$round.against" "${words[@]}" 2>/dev/null; then
      others+=("$out/$name.$round.against")
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
