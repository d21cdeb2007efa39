#!/usr/bin/env bash
# The collective check at scale: Net (two SyncBatchNorm layers) on
# Fashion-MNIST, every collective checked, first --ranks workers on this
# host, then two nodes of --ranks / 2 workers over two network namespaces
# (a veth, unshaped; each node pinned to a core of its own). A run that
# ends 0 raised no false alarm: any verdict ends it non-zero. Prints ms per
# step of each run (summary.json's training clock); where namespaces cannot
# be made it says why and runs the one-host part only.
#
#   bash scripts/bench_scale.sh [--ranks 32] [--steps 200]
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=32 steps=200
while [ "$#" -gt 0 ]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    *) echo "usage: bash scripts/bench_scale.sh [--ranks 32] [--steps 200]" >&2; exit 2 ;;
  esac
done
[ "$ranks" -ge 2 ] && [ $((ranks % 2)) -eq 0 ] || { echo "bench_scale: --ranks $ranks: an even number, 2 or more" >&2; exit 2; }
say() { echo "bench_scale: $*" >&2; }
bash scripts/install_deps.sh build >/dev/null
bash scripts/fetch_data.sh fashion-mnist >/dev/null
bash scripts/build.sh --target mnist_ddp >/dev/null

out="$(mktemp -d)"
source scripts/netns.sh
trap 'netns_remove; rm -rf "$out"' EXIT
trap 'exit 130' INT TERM
flags=(--backend gloo --dataset fashion-mnist --epochs 1 --max-steps "$steps" --checkpoint-every 0 --log-interval 1000
       --compression none --timeout 300)
ms_per_step() {
  python3 -c 'import json,sys; t=json.load(open(sys.argv[1]))["training"]; print("%.1f" % (1000*t["seconds"]/t["steps"]))' "$1/summary.json"
}

say "$ranks workers on this host, $steps steps"
if ! ./build/mnist_ddp "${flags[@]}" --nproc "$ranks" --path "$out/host" >"$out/host.txt" 2>&1; then
  say "the run on one host failed:"; tail -n 5 "$out/host.txt" >&2; exit 1
fi
echo "one host, $ranks ranks: $(ms_per_step "$out/host") ms/step, ended 0 (no false alarm)"

if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null || ! netns_make "$out"; then
  say "no two network namespaces here (root and iproute2 needed); the two-node part is left out"
  exit 0
fi
half=$((ranks / 2))
say "2 nodes x $half workers over two namespaces, $steps steps"
pids=()
for node in 0 1; do
  ns="$ns_a"
  [ "$node" = 1 ] && ns="$ns_b"
  ip netns exec "$ns" taskset -c "$node" ./build/mnist_ddp "${flags[@]}" --nnodes 2 --node-rank "$node" --nproc "$half" \
    --master-addr 10.231.9.1 --master-port 29650 --path "$out/node$node" >"$out/node$node.txt" 2>&1 &
  pids+=($!)
done
for node in 0 1; do
  if ! wait "${pids[$node]}"; then
    say "node $node of the two-node run failed:"; tail -n 5 "$out/node$node.txt" >&2; exit 1
  fi
done
echo "two namespaces, 2 x $half ranks: $(ms_per_step "$out/node0") ms/step, ended 0 (no false alarm)"
