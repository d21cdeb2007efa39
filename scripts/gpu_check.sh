#!/usr/bin/env bash
# Proves a GPU machine: builds against its CUDA PyTorch or LibTorch (as
# build.sh chooses), runs the GPU tests (ctest -L cuda), trains a short
# epoch per hook with one NCCL worker per GPU and with two workers sharing
# GPU 0 over Gloo, and writes a table of what ran (hook, backend, workers,
# ms/step, test top-1) to a markdown file, printed as well.
#
#   bash scripts/gpu_check.sh [--build-dir DIR] [--data-dir DIR] [--steps N] [--out FILE]
#
# --build-dir: an already configured build to use (for example one made with
# CMake by hand), rebuilt in place; default: build/ through build.sh.
# --data-dir: holds FashionMNIST/raw or MNIST/raw (default data/, where MNIST
# is fetched when neither is there). --steps: training steps per run (300).
# --out: default docs/gpu_check-<commit>.md. Without an NVIDIA GPU it says so
# and exits 0, having checked nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/libtorch.sh
build_dir="" data_dir="data" steps=300 out=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --build-dir) build_dir="$2"; shift 2 ;;
    --data-dir) data_dir="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "usage: bash scripts/gpu_check.sh [--build-dir DIR] [--data-dir DIR] [--steps N] [--out FILE]" >&2; exit 2 ;;
  esac
done
if ! has_nvidia_gpu; then
  echo "gpu_check.sh: no NVIDIA GPU here (no /dev/nvidia0, nvidia-smi lists none): nothing checked"
  exit 0
fi
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
out="${out:-docs/gpu_check-$commit.md}"

# The build, with the tests: googletest besides what building needs.
if [ -n "$build_dir" ]; then
  [ -f "$build_dir/CMakeCache.txt" ] || { echo "gpu_check.sh: --build-dir $build_dir holds no configured build" >&2; exit 2; }
  cmake --build "$build_dir" -j "$(nproc)"
else
  bash scripts/install_deps.sh build
  bash scripts/install_deps.sh googletest
  bash scripts/build.sh
  build_dir=build
fi
torch_dir="$(sed -n 's/^Torch_DIR:PATH=//p' "$build_dir/CMakeCache.txt")"
torch_has_cuda "$torch_dir" || { echo "gpu_check.sh: $build_dir is built against a LibTorch without CUDA ($torch_dir): see README.md, Quick start on GPUs" >&2; exit 1; }
binary="$build_dir/mnist_ddp"

dataset=""
for d in fashion-mnist:FashionMNIST mnist:MNIST; do
  [ -d "$data_dir/${d#*:}/raw" ] && { dataset="${d%:*}"; break; }
done
if [ -z "$dataset" ]; then
  bash scripts/fetch_data.sh mnist "$data_dir"
  dataset=mnist
fi

gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
{
  echo "# GPU check at $commit"
  echo
  echo "\`bash scripts/gpu_check.sh\`, $(date -u +%Y-%m-%d), on $(nvidia-smi -L 2>/dev/null | sed -n '1s/ (UUID.*//p')${gpus:+ ($gpus GPUs visible)}."
  echo "Each run: one epoch of $dataset stopped after $steps steps (--max-steps), PowerSGD from step 10, then the test set."
  echo
} >"$out.part"

status=0
# CudaEndToEnd trains on the MNIST of data/ (tests/e2e_test.cpp), whatever --data-dir says.
if [ ! -d data/MNIST/raw ] && ! bash scripts/fetch_data.sh mnist >/dev/null 2>&1; then
  echo "gpu_check.sh: no data/MNIST/raw and no way to fetch it here: CudaEndToEnd will fail; copy data/MNIST in from a machine that has it"
fi
echo "gpu_check.sh: ctest -L cuda in $build_dir"
if ctest_out="$(cd "$build_dir" && ctest -L cuda --output-on-failure --timeout 900 2>&1)"; then
  echo "- \`ctest -L cuda\`: $(grep -E 'tests passed' <<<"$ctest_out" | tail -n 1)" >>"$out.part"
else
  status=1
  echo "$ctest_out"
  echo "- \`ctest -L cuda\`: FAILED: $(grep -E 'tests passed|tests failed' <<<"$ctest_out" | tail -n 1)" >>"$out.part"
fi

runs="$(mktemp -d)"
trap 'rm -rf "$runs"' EXIT
table=("| hook | backend | workers | ms/step | test top-1 |" "|---|---|---:|---:|---:|")
runtime=""
for hook in none fp16 powersgd powersgd_fp16 batched_powersgd_fp16; do
  for placement in "--backend nccl" "--backend gloo --gpus 0,0"; do
    path="$runs/$hook-${placement// /}"
    echo "gpu_check.sh: $hook, $placement"
    # shellcheck disable=SC2086  # $placement is two or four words
    if ! "$binary" $placement --compression "$hook" --epochs 1 --max-steps "$steps" --start-powersgd-iter 10 \
        --dataset "$dataset" --data-dir "$data_dir" --path "$path" >"$path.log" 2>&1; then
      status=1
      tail -n 5 "$path.log"
      table+=("| $hook | ${placement#--backend } | | failed: $(tail -n 1 "$path.log") | |")
      continue
    fi
    table+=("$(python3 - "$path/summary.json" "$hook" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
w = s["world"]
ms = s.get("training", {}).get("ms_per_step")
top1 = s.get("best_test_top1")
print(f"| {sys.argv[2]} | {w['backend']} | {w['ranks']} | {'-' if ms is None else f'{ms:.2f}'} | {'-' if top1 is None else f'{top1:.2f}%'} |")
EOF
    )")
    [ -n "$runtime" ] || runtime="$(grep -m1 -o 'Runtime: .*' "$path.log" || true)"
  done
done
{
  echo "- $runtime"
  echo
  printf '%s\n' "${table[@]}"
} >>"$out.part"
mv "$out.part" "$out"
cat "$out"
echo "gpu_check.sh: written to $out"
exit "$status"
