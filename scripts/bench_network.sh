#!/usr/bin/env bash
# The network benchmark: what each hook gains on a link between two
# machines, played on this one. Two network namespaces joined by a veth
# pair, each end shaped by a token bucket (tc tbf: netem is not available
# here), one node in each (--nproc 1, pinned to a core of its own, one
# thread: OMP_NUM_THREADS=1, as builds before a66cb20 counted the
# machine's cores, not the node's), on
# Fashion-MNIST at batch 32, PowerSGD compressing from step 10. Prints one
# table per rate, and the targets met or not.
#
#   bash scripts/bench_network.sh [--rate 1gbit]... [--steps 100] [--rounds 1] [--against BINARY]
#                                 [--hooks none,powersgd_fp16] [--no-python]
#
# --against BINARY runs another mnist_ddp (an older build) for none and
# powersgd_fp16 in the same rounds and prints its figures beside.
# --hooks measures those hooks only, --no-python leaves PyTorch's DDP out:
# a comparison of builds in a quarter of the time.
#
# Each figure is a slope, so start-up and the end cancel: the difference in
# training time (summary.json's training.seconds; Python DDP's own clock)
# and in bytes the node-0 end of the veth sent, between a run of --steps and
# one of --steps / 5, over the steps between them. Every hook runs on the
# shaped link and on the same link unshaped (the compute floor), none and
# powersgd_fp16 also with --no-check-collectives (the collective check's
# cost; scripts/bench_check.sh measures it paired, step by step), and,
# where python3 has torch, PyTorch's Python DDP beside ours
# (scripts/python_ddp.py: plain BatchNorm, Gloo, the hooks it can run on
# the CPU: none and fp16).
# --rounds repeats everything in turn and takes medians. The namespaces and
# every process in them go when the script ends, however it ends; where
# namespaces cannot be made (no root, no iproute2) it says why and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
rates=() steps=100 rounds=1 against="" only="" no_python=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --rate) rates+=("$2"); shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --against) against="$(realpath "$2")"; shift 2 ;;
    --hooks) only="$2"; shift 2 ;;
    --no-python) no_python=1; shift ;;
    *) echo "usage: bash scripts/bench_network.sh [--rate 1gbit]... [--steps 100] [--rounds 1] [--against BINARY] [--hooks LIST] [--no-python]" >&2; exit 2 ;;
  esac
done
[ -z "$against" ] || [ -x "$against" ] || { echo "bench_network: --against: not an executable" >&2; exit 2; }
[ "${#rates[@]}" -gt 0 ] || rates=(1gbit)
[ "$steps" -ge 25 ] || { echo "bench_network: --steps $steps: at least 25, so that the slope spans 20 steps" >&2; exit 2; }
short=$((steps / 5))
hooks=(none fp16 powersgd powersgd_fp16 batched_powersgd_fp16)
if [ -n "$only" ]; then
  IFS=, read -r -a hooks <<<"$only"
  for hook in "${hooks[@]}"; do
    case "$hook" in none | fp16 | powersgd | powersgd_fp16 | batched_powersgd_fp16) ;; *) echo "bench_network: --hooks: no hook '$hook'" >&2; exit 2 ;; esac
  done
fi

say() { echo "bench_network: $*" >&2; }
source scripts/netns.sh
netns_usable bench_network || exit 0
[ "$(nproc)" -ge 2 ] || say "one core only: both nodes share it, and the figures say little"

bash scripts/install_deps.sh test >/dev/null
bash scripts/fetch_data.sh fashion-mnist >/dev/null
bash scripts/build.sh --target mnist_ddp >/dev/null
python=""
[ -n "$no_python" ] || for p in python3 /usr/bin/python3; do
  if "$p" -c "import torch.distributed" 2>/dev/null; then python="$p"; break; fi
done
[ -n "$python" ] || [ -n "$no_python" ] || say "no Python with torch: Python DDP is left out"

out="$(mktemp -d)"
# Every figure is of the training steps: the test pass after them runs on
# 1,000 of the test images, not 10,000 (a tenth of each run's time).
bash scripts/fetch_data.sh fashion-mnist "$out/data" 1000 >/dev/null
a="$ns_a" b="$ns_b" va="$dev_a" vb="$dev_b"
trap 'netns_remove; rm -rf "$out"' EXIT
trap 'exit 130' INT TERM
if ! netns_make "$out"; then
  say "this machine does not allow two network namespaces and a veth pair ($(head -n 1 "$out/netns.txt")); nothing measured"
  exit 0
fi

sent() { ip netns exec "$a" cat "/sys/class/net/$va/statistics/tx_bytes"; }

port=29600
# run WHO HOOK STEPS: one two-node run; prints "<training seconds> <bytes node 0 sent>".
run() {
  local who="$1" hook="$2" n="$3" before after seconds node pids=()
  port=$((port + 1))
  rm -rf "$out/run"
  mkdir -p "$out/run"
  before=$(sent)
  for node in 0 1; do
    local ns="$a" dev="$va"
    [ "$node" = 1 ] && ns="$b" dev="$vb"
    if [ "$who" != python ]; then
      local unchecked=() binary=./build/mnist_ddp
      [ "$who" = unchecked ] && unchecked=(--no-check-collectives)
      [ "$who" = against ] && binary="$against"
      ip netns exec "$ns" env OMP_NUM_THREADS=1 taskset -c "$node" "$binary" --backend gloo --nnodes 2 --node-rank "$node" \
        --nproc 1 --master-addr 10.231.9.1 --master-port "$port" --dataset fashion-mnist --data-dir "$out/data" --epochs 1 \
        --max-steps "$n" --compression "$hook" --start-powersgd-iter 10 --checkpoint-every 0 --log-interval 1000 \
        --timeout 120 --path "$out/run/$node" "${unchecked[@]}" >"$out/run/$node.txt" 2>&1 &
    else
      ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$dev" OMP_NUM_THREADS=1 taskset -c "$node" "$python" scripts/python_ddp.py \
        --steps "$n" --dataset fashion-mnist --compression "$hook" --nnodes 2 --node-rank "$node" --nproc 1 \
        --master-addr 10.231.9.1 --master-port "$port" >"$out/run/$node.txt" 2>&1 &
    fi
    pids+=($!)
  done
  if ! wait "${pids[0]}" || ! wait "${pids[1]}"; then
    say "a $who $hook run of $n steps failed:"
    tail -n 3 "$out/run/0.txt" "$out/run/1.txt" >&2
    exit 1
  fi
  after=$(sent)
  if [ "$who" != python ]; then
    seconds=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["training"]["seconds"])' "$out/run/0/summary.json")
  else
    seconds=$(sed -n 's/^steps [0-9]* in \([0-9.]*\) s$/\1/p' "$out/run/0.txt")
  fi
  echo "$seconds $((after - before))"
}

results="$out/results.txt"
for round in $(seq 1 "$rounds"); do
  for rate in none "${rates[@]}"; do
    netns_shape "$rate"
    for who in ours unchecked against python; do
      [ "$who" = python ] && [ -z "$python" ] && continue
      [ "$who" = against ] && [ -z "$against" ] && continue
      for hook in "${hooks[@]}"; do
        [ "$who" = python ] && [ "$hook" != none ] && [ "$hook" != fp16 ] && continue
        case "$who" in unchecked | against) [ "$hook" != none ] && [ "$hook" != powersgd_fp16 ] && continue ;; esac
        say "round $round, link ${rate/none/unshaped}: $who $hook"
        read -r s1 b1 < <(run "$who" "$hook" "$short")
        read -r s2 b2 < <(run "$who" "$hook" "$steps")
        echo "$round $rate $who $hook $s1 $b1 $s2 $b2" >>"$results"
      done
    done
  done
done

python3 - "$results" "$((steps - short))" "$(git rev-parse --short HEAD 2>/dev/null || echo '?')" "$against" "${rates[@]}" <<'EOF'
import statistics, sys
results, span, commit, against, rates = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
runs = {}
for line in open(results):
    rnd, rate, who, hook, s1, b1, s2, b2 = line.split()
    ms = (float(s2) - float(s1)) * 1000 / span
    wire = (int(b2) - int(b1)) / span
    runs.setdefault((rate, who, hook), []).append((ms, wire))
def fig(rate, who, hook):
    got = runs.get((rate, who, hook))
    if not got:
        return None, None
    return statistics.median(m for m, _ in got), statistics.median(w for _, w in got)
def bits(rate):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    return float(rate)
hooks = ["none", "fp16", "powersgd", "powersgd_fp16", "batched_powersgd_fp16"]
print(f"Two nodes, one worker each, over a veth (commit {commit}); ms/step and bytes node 0 sent per step,")
print(f"slopes over {span} steps; batch 32 per node, PowerSGD from step 10.\n")
verdicts = []
for rate in rates:
    print(f"### {rate}\n")
    print("| hook | ms/step | images/s | ratio to none | sent/step | unshaped ms/step | Python DDP ms/step | Python unshaped | ours vs Python |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    none_ms, _ = fig(rate, "ours", "none")
    none_ms = none_ms or float("nan")
    for hook in hooks:
        ms, wire = fig(rate, "ours", hook)
        if ms is None:
            continue  # not measured (--hooks)
        floor, _ = fig("none", "ours", hook)
        py, _ = fig(rate, "python", hook)
        py_floor, _ = fig("none", "python", hook)
        cell = lambda x, f="{:.1f}": f.format(x) if x is not None else "—"
        speedup = f"{py / ms:.2f}x" if py else "—"
        print(f"| {hook} | {ms:.1f} | {64000 / ms:.0f} | {none_ms / ms:.2f} | {wire / 1e6:.3f} MB | {cell(floor)} | "
              f"{cell(py)} | {cell(py_floor)} | {speedup} |")
    print()
    ms, wire = fig(rate, "ours", "none")
    floor, _ = fig("none", "ours", "none")
    if ms is None or fig(rate, "ours", "powersgd_fp16")[0] is None:
        continue  # the targets need none and powersgd_fp16 (--hooks)
    wire_ms = wire * 8 / bits(rate) * 1000
    bound = max(floor, wire_ms)
    # Each target: what, the measured ratio, and the most it may be.
    verdicts.append((f"{rate}: none within 1.2x of max(unshaped {floor:.1f}, wire {wire_ms:.1f}) = {bound:.1f} ms",
                     ms / bound, 1.2))
    limit = 1.15 if bits(rate) >= 1e9 else 1.5
    ms, _ = fig(rate, "ours", "powersgd_fp16")
    floor, _ = fig("none", "ours", "powersgd_fp16")
    verdicts.append((f"{rate}: powersgd_fp16 within {limit}x of its unshaped {floor:.1f} ms", ms / floor, limit))
    for hook in ("none", "fp16"):
        for link in (rate, "none") if bits(rate) >= 1e9 else ("none",):
            ours, _ = fig(link, "ours", hook)
            py, _ = fig(link, "python", hook)
            if py:
                name = "unshaped" if link == "none" else link
                verdicts.append((f"{name}: {hook} at least 1.5x Python DDP ({ours:.1f} vs {py:.1f} ms)",
                                 ours / py, 1 / 1.5))
def beside(title, first, second, heads):
    """none and powersgd_fp16 of `first` beside `second`, each link: ms/step and the change."""
    print(title + "\n")
    print(f"| link | hook | {heads[0]} | {heads[1]} | {heads[2]} |")
    print("|---|---|---:|---:|---:|")
    for rate in ["none"] + rates:
        for hook in ("none", "powersgd_fp16"):
            a, _ = fig(rate, first, hook)
            b, _ = fig(rate, second, hook)
            if a and b:
                print(f"| {rate.replace('none', 'unshaped')} | {hook} | {a:.1f} | {b:.1f} | {100 * (a / b - 1):+.1f}% |")
    print()
beside("The check's cost (ms/step checked against --no-check-collectives, the same rounds):", "ours", "unchecked",
       ("checked ms/step", "unchecked ms/step", "cost"))
if against:
    beside(f"This build against {against} (ms/step, the same rounds):", "ours", "against",
           ("this build", "against", "change"))
print("Targets (ratio: measured over its bound; met at or below the bound):")
seen = set()
for what, ratio, most in verdicts:
    if what not in seen:
        seen.add(what)
        print(f"- {what}: {ratio:.2f} against {most:.2f}, {'met' if ratio <= most else 'NOT met'}")
EOF
