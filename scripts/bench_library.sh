#!/usr/bin/env bash
# The library on a model that is not Net: examples/resnet_model.hpp's ResNet
# (Fashion-MNIST-shaped, batch 32 a process, one core a process), five
# ways taking turns step by step in one run (the machine's drift moves them
# alike), --rounds runs, medians:
#   - the floor: two processes at once, each training alone (no DDP); and
#     the same two meeting at a barrier after each step, the floor of any
#     DDP, whose ranks meet every step: each step waits for the slower rank;
#   - our DDP on 2 ranks (mnist_ddp_bench library), with BatchNorm and with
#     SyncBatchNorm, and with nothing communicated (each rank's own
#     gradients, no buffer broadcast): DDP's own bookkeeping;
#   - PyTorch's Python DDP on 2 ranks, python_ddp.py's way (BatchNorm: its
#     SyncBatchNorm refuses CPU tensors).
# Each figure is ms per step after 5 steps of warm-up, on the processes' own
# clocks, so start-up is left out. --against BENCH runs another build's
# mnist_ddp_bench (an older commit's) right after this one's in every
# round and prints its rows beside: a before/after in one run.
#
#   bash scripts/bench_library.sh [--steps 100] [--rounds 5] [--against BENCH]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=100 rounds=5 against=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --against) against="$2"; shift 2 ;;
    *) echo "usage: bash scripts/bench_library.sh [--steps N] [--rounds R] [--against BENCH]" >&2; exit 2 ;;
  esac
done
[ -z "$against" ] || [ -x "$against" ] || { echo "bench_library: --against $against: not an executable" >&2; exit 2; }
bash scripts/install_deps.sh test >/dev/null  # mnist_ddp_bench is built beside the tests; PyTorch for its Python DDP
bash scripts/fetch_data.sh fashion-mnist >/dev/null
bash scripts/build.sh --target mnist_ddp_bench >/dev/null
python=""
for p in python3 /usr/bin/python3; do
  if "$p" -c "import torch.distributed" 2>/dev/null; then python="$p"; break; fi
done
[ -n "$python" ] || echo "bench_library: no Python with torch: Python DDP is left out" >&2

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for round in $(seq 1 "$rounds"); do
  echo "bench_library: round $round of $rounds" >&2
  OMP_NUM_THREADS=1 ./build/tests/mnist_ddp_bench library "$steps" >>"$out/ours"
  [ -z "$against" ] || OMP_NUM_THREADS=1 "$against" library "$steps" | awk '{for (i = 1; i <= NF; i += 2) $i = "against_" $i} 1' >>"$out/ours"
  if [ -n "$python" ]; then
    "$python" scripts/python_ddp.py --model resnet --steps $((steps + 5)) --warmup 5 --dataset fashion-mnist \
      >"$out/python.txt" 2>&1 || { echo "bench_library: Python DDP failed:" >&2; tail -n 5 "$out/python.txt" >&2; exit 1; }
    sed -n 's/^steps \([0-9]*\) in \([0-9.]*\) s$/\1 \2/p' "$out/python.txt" >>"$out/python"
  fi
done
python3 - "$out" "$steps" "$rounds" "$against" <<'EOF'
import os, statistics, sys
out, steps, rounds, against = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = {}
for line in open(os.path.join(out, "ours")):
    words = line.split()
    for name, value in zip(words[0::2], words[1::2]):
        rows.setdefault(name, []).append(float(value))
if os.path.exists(os.path.join(out, "python")):
    for line in open(os.path.join(out, "python")):
        n, seconds = line.split()
        rows.setdefault("python_ddp", []).append(1000 * float(seconds) / int(n))
floor = statistics.median(rows["floor"])
met = statistics.median(rows["floor_met"])
labels = {"floor": "the floor: 2 processes at once, each alone",
          "floor_met": "the same, meeting after each step",
          "ddp": "our DDP, 2 ranks, BatchNorm",
          "ddp_syncbn": "our DDP, 2 ranks, SyncBatchNorm",
          "ddp_local": "our DDP, 2 ranks, nothing communicated",
          "python_ddp": "PyTorch's Python DDP, 2 ranks, BatchNorm"}
print(f"examples/resnet's model, batch 32 a process, 1 core a process; medians of {rounds} interleaved "
      f"round(s) of {steps} steps\n")
print("| run | ms/step | x the floor | x met |" + (f" {against} ms/step | change |" if against else "")
      + "\n|---|---:|---:|---:|" + ("---:|---:|" if against else ""))
for name in ["floor", "floor_met", "ddp_local", "ddp", "ddp_syncbn", "python_ddp"]:
    if name in rows:
        ms = statistics.median(rows[name])
        line = f"| {labels[name]} | {ms:.1f} | {ms / floor:.2f} | {ms / met:.2f} |"
        if against and "against_" + name in rows:
            before = statistics.median(rows["against_" + name])
            line += f" {before:.1f} | {100 * (ms / before - 1):+.1f}% |"
        print(line)
EOF
