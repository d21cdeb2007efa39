#!/usr/bin/env bash
# The collective check's own cost between two nodes, paired: two network
# namespaces joined by a veth pair (scripts/netns.sh), each end shaped by a
# token bucket, one process in each, pinned to a core of its own, one
# thread. Each process trains Net with SyncBatchNorm under our DDP and a
# hook, as mnist_ddp does (PowerSGD from step 10), on two groups at once:
# one that checks every collective and one that does not, taking turns
# step by step (mnist_ddp_bench check-cost), so the machine's drift, which
# moves whole runs by 10% here, moves both alike. Each round prints both
# ms/step; the table gives the median of the rounds' checked/unchecked
# ratios per link and hook. Unshaped and at each --rate.
#
#   bash scripts/bench_check.sh [--rate 1gbit]... [--steps 150] [--rounds 4] [--hooks none,powersgd_fp16]
#
# The namespaces and every process in them go when the script ends; where
# namespaces cannot be made (no root, no iproute2) it says why and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
rates=() steps=150 rounds=4 hooks_list="none,powersgd_fp16"
usage="usage: bash scripts/bench_check.sh [--rate 1gbit]... [--steps 150] [--rounds 4] [--hooks LIST]"
while [ "$#" -gt 0 ]; do
  case "$1" in
    --rate) rates+=("$2"); shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --hooks) hooks_list="$2"; shift 2 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
[[ "$steps" =~ ^[0-9]+$ && "$steps" -ge 1 && "$rounds" =~ ^[0-9]+$ && "$rounds" -ge 1 ]] ||
  { echo "bench_check: --steps and --rounds take a positive count" >&2; exit 2; }
[ "${#rates[@]}" -gt 0 ] || rates=(1gbit)
IFS=, read -r -a hooks <<<"$hooks_list"
for hook in "${hooks[@]}"; do
  [[ " none fp16 powersgd powersgd_fp16 batched_powersgd_fp16 " == *" $hook "* ]] ||
    { echo "bench_check: --hooks: no hook '$hook'" >&2; exit 2; }
done

say() { echo "bench_check: $*" >&2; }
source scripts/netns.sh
netns_usable bench_check || exit 0
bash scripts/install_deps.sh test >/dev/null
bash scripts/build.sh --target mnist_ddp_bench >/dev/null
bench="$PWD/build/tests/mnist_ddp_bench"

out="$(mktemp -d)"
trap 'netns_remove; rm -rf "$out"' EXIT
trap 'exit 130' INT TERM
if ! netns_make "$out"; then
  say "could not make network namespaces ($(head -n 1 "$out/netns.txt")); nothing measured"
  exit 0
fi
port=29650
for rate in none "${rates[@]}"; do
  netns_shape "$rate"
  for round in $(seq 1 "$rounds"); do
    for hook in "${hooks[@]}"; do
      port=$((port + 1))
      say "$rate, $hook, round $round of $rounds"
      pids=()
      for node in 0 1; do
        ns="$ns_a"; [ "$node" = 1 ] && ns="$ns_b"
        ip netns exec "$ns" taskset -c "$node" env OMP_NUM_THREADS=1 timeout 600 "$bench" check-cost "$node" \
          10.231.9.1 "$port" "10.231.9.$((node + 1))" "$hook" "$steps" >"$out/$node.txt" 2>&1 &
        pids+=($!)
      done
      ok=1
      for pid in "${pids[@]}"; do wait "$pid" || ok=""; done
      [ -n "$ok" ] || { say "a node failed:"; tail -n 3 "$out/0.txt" "$out/1.txt" >&2; exit 1; }
      echo "$rate $hook $(tail -n 1 "$out/0.txt")" | tee -a "$out/rounds"
    done
  done
done
python3 - "$out/rounds" "$steps" "$rounds" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    rate, hook, _, checked, _, unchecked = line.split()
    rows.setdefault((rate, hook), []).append((float(checked), float(unchecked)))
print(f"\nNet with SyncBatchNorm, batch 32, 2 nodes x 1 process; {sys.argv[3]} round(s) of {sys.argv[2]} steps per way\n")
print("| link | hook | checked, ms/step | unchecked, ms/step | check's cost: median of rounds | rounds |\n|---|---|---:|---:|---:|---|")
for (rate, hook), pairs in rows.items():
    ratios = [c / u - 1 for c, u in pairs]
    link = "unshaped" if rate == "none" else rate
    print(f"| {link} | {hook} | {statistics.median(c for c, _ in pairs):.1f} | {statistics.median(u for _, u in pairs):.1f} "
          f"| {100 * statistics.median(ratios):+.1f}% | {' '.join(f'{100 * r:+.1f}%' for r in ratios)} |")
EOF
