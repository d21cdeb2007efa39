#!/usr/bin/env bash
# The benchmark: builds Release, then runs a fixed protocol on Fashion-MNIST
# (60,000 training and 10,000 test images), prints one markdown table and
# writes bench/results.json.
#
#   bash scripts/bench.sh [--gpu] [--steps 300] [--rounds 2]
#
# Every part's length follows --steps (300: the protocol below). Fewer, as
# CI runs it, shows that the script works, not what the figures are: the
# compute limit and the profile take at most --steps steps, the end-to-end
# runs stop after 3 x --steps, and the slopes span --steps x 0.8.
#
#   1. compute limit: one process, one core, no DDP and no communication,
#      Net's training step at batch 32, as set up here (OpenBLAS, worker
#      process settings) and as LibTorch comes (its reference BLAS, defaults);
#   2. each hook on 2 Gloo processes (--gpu: one NCCL process per GPU) for
#      --steps steps, --rounds alternating rounds, medians;
#   3. scaling efficiency: 2-process images/s over twice the per-core limit;
#   4. end to end: launch to the end of one full epoch, evaluation and model
#      save included, for none and for powersgd_fp16 (compressing from step 10);
#   5. on CPU, a profile by operator of rank 0's step (2 processes,
#      SyncBatchNorm, none), by self time;
#   6. against PyTorch's own Python DDP (scripts/python_ddp.py, same Net,
#      data, batch, threads and SGD), and 2 workers against 1 worker with
#      one worker's share of the cores: ms/step as
#      the slope between a 40-step and a 240-step run from launch to exit,
#      so start-up and the end cancel; alternating rounds, medians.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=300 rounds=2 gpu=()
placement=(--backend gloo --nproc 2)
while [ "$#" -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --gpu) gpu=(--gpu); placement=(--backend nccl); shift ;;
    *) echo "usage: bash scripts/bench.sh [--gpu] [--steps N] [--rounds R]" >&2; exit 2 ;;
  esac
done
bash scripts/install_deps.sh test >/dev/null  # mnist_ddp_bench is built beside the tests; PyTorch for its Python DDP
bash scripts/build.sh --target mnist_ddp --target mnist_ddp_bench >/dev/null
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
facts="$out/facts"
at_most() { echo $(($1 < steps ? $1 : steps)); }
limit_steps=$(at_most 200)
# One full epoch and the whole test set, or, when --steps is below the
# protocol's 300, 3 x --steps of one and the test set's first 1,000 images.
epoch=() data_dir=data
bash scripts/fetch_data.sh fashion-mnist >/dev/null
if [ "$steps" -lt 300 ]; then
  epoch=(--max-steps $((3 * steps))) data_dir="$out/data"
  bash scripts/fetch_data.sh fashion-mnist "$data_dir" 1000 >/dev/null
  echo "partial_epoch=yes" >>"$facts"
fi
slope_short=$((steps * 40 / 300 > 4 ? steps * 40 / 300 : 4))
slope_long=$((slope_short + (steps * 200 / 300 > 20 ? steps * 200 / 300 : 20)))
bench=./build/tests/mnist_ddp_bench

echo "bench: compute limit, 3 alternating rounds" >&2
# LibTorch as installed: Debian's reference BLAS, whatever BLAS alternative is
# selected now.
reference_blas=/usr/lib/x86_64-linux-gnu/blas
for round in 1 2 3; do
  if [ -n "${gpu[*]}" ]; then
    echo "limit_tuned=$("$bench" compute-limit "$limit_steps" --cuda)" >>"$facts"
  else
    echo "limit_tuned=$("$bench" compute-limit "$limit_steps")" >>"$facts"
    echo "limit_plain=$(LD_LIBRARY_PATH="$reference_blas" "$bench" compute-limit $((limit_steps / 2)) --plain)" >>"$facts"
  fi
done
if [ -z "${gpu[*]}" ]; then
  echo "bench: where a 2-process step's time goes" >&2
  echo "breakdown=$("$bench" breakdown "$(at_most 40)")" >>"$facts"
  echo "bench: a 2-process step under LibTorch's profiler" >&2
  profiled_ms=$("$bench" profile "$(at_most 30)" "$out/trace.json")
fi

echo "bench: the five hooks, $rounds round(s) of $steps steps" >&2
bash scripts/bench_hooks.sh --steps "$steps" --rounds "$rounds" --keep "$out/hooks" --data-dir "$data_dir" "${gpu[@]}" >/dev/null

for hook in none powersgd_fp16; do
  echo "bench: one epoch with $hook${epoch[*]:+ (${epoch[*]})}" >&2
  start=$(date +%s%N)
  if ! ./build/mnist_ddp "${placement[@]}" --dataset fashion-mnist --data-dir "$data_dir" --epochs 1 "${epoch[@]}" --compression "$hook" \
      --start-powersgd-iter 10 --checkpoint-every 0 --path "$out/e2e-$hook" >"$out/e2e-$hook.txt" 2>&1; then
    echo "bench: the one-epoch $hook run failed:" >&2
    tail -n 5 "$out/e2e-$hook.txt" >&2
    exit 1
  fi
  end=$(date +%s%N)
  echo "e2e_$hook=$out/e2e-$hook $(((end - start) / 1000000))" >>"$facts"
done

# A Python with torch (Debian's python3-torch runs under /usr/bin/python3);
# with --gpu, one with CUDA.
python="" runs=(mnist_ddp mnist_ddp_1)
for p in python3 /usr/bin/python3; do
  if "$p" -c "import sys, torch; sys.exit(0 if ${gpu[*]:+torch.cuda.is_available() and }True else 1)" 2>/dev/null; then
    python="$p" runs+=(python_ddp)
    break
  fi
done
[ -n "$python" ] || echo "bench: no Python with torch${gpu[*]:+ and CUDA}: the Python DDP comparison is left out" >&2
echo "bench: slopes against Python DDP and against 1 worker, $rounds round(s)" >&2
for round in $(seq 1 "$rounds"); do
  for steps_now in "$slope_short" "$slope_long"; do
    for run in "${runs[@]}"; do
      start=$(date +%s%N)
      case "$run" in
        mnist_ddp|mnist_ddp_1)
          # 1 worker gets one worker's share of the cores, as each of 2 has.
          threads=() where=("${placement[@]}")
          if [ "$run" = mnist_ddp_1 ]; then
            where=(--backend gloo --nproc 1) threads=(OMP_NUM_THREADS=$(($(nproc) / 2 > 0 ? $(nproc) / 2 : 1)))
            [ -n "${gpu[*]}" ] && where=(--backend nccl --gpus 0)
          fi
          env "${threads[@]}" ./build/mnist_ddp "${where[@]}" --dataset fashion-mnist --data-dir "$data_dir" --epochs 1 --max-steps "$steps_now" \
            --compression none --checkpoint-every 0 --log-interval 1000 --path "$out/slope" >"$out/slope.txt" 2>&1 ;;
        python_ddp)
          "$python" scripts/python_ddp.py --steps "$steps_now" --dataset fashion-mnist ${gpu[*]:+--cuda} \
            >"$out/slope.txt" 2>&1 ;;
      esac || { echo "bench: the $run run of $steps_now steps failed:" >&2; tail -n 5 "$out/slope.txt" >&2; exit 1; }
      end=$(date +%s%N)
      echo "slope_$run=$steps_now $(((end - start) / 1000000))" >>"$facts"
    done
  done
done

{
  echo "cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//') x $(nproc)"
  echo "blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3)"
  if [ -n "${gpu[*]}" ]; then
    echo "device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
    echo "processes=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)"
  else
    echo "device=cpu"
    echo "processes=2"
  fi
} >>"$facts"
mkdir -p bench
python3 scripts/bench_report.py bench "$facts" bench/results.json "$out"/hooks/*/
if [ -z "${gpu[*]}" ]; then
  echo
  echo "Where rank 0's step goes by operator (2 processes, SyncBatchNorm, none; $profiled_ms ms/step with the profiler on):"
  echo
  python3 scripts/bench_report.py profile "$out/trace.json" 30 "$profiled_ms"
fi
