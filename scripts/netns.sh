# Two network namespaces joined by a veth pair, for the benchmarks that play
# two machines on this one; sourced, not run. netns_make OUT sets $ns_a,
# $ns_b (the namespaces, node 0's at 10.231.9.1 and node 1's at
# 10.231.9.2) and $dev_a, $dev_b (their ends of the veth), and returns 1
# with the reason in OUT/netns.txt where this machine cannot make them.
# netns_remove ends every process in them (what the script started there)
# and deletes them; the script calls it at its exit. netns_usable WHO
# returns 1, saying why as WHO, where this process cannot make them (no
# root, no iproute2); netns_shape RATE shapes both ends of the veth with a
# token bucket (none: unshaped).
ns_a="mnddp_na$$" ns_b="mnddp_nb$$" dev_a="nva$$" dev_b="nvb$$"

netns_remove() {
  local ns pid
  for ns in "$ns_a" "$ns_b"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do [ "$pid" -gt 1 ] && kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
}

netns_make() {
  { ip netns add "$ns_a" && ip netns add "$ns_b" &&
    ip link add "$dev_a" netns "$ns_a" type veth peer name "$dev_b" netns "$ns_b" &&
    ip -n "$ns_a" addr add 10.231.9.1/24 dev "$dev_a" && ip -n "$ns_b" addr add 10.231.9.2/24 dev "$dev_b" &&
    ip -n "$ns_a" link set "$dev_a" up && ip -n "$ns_b" link set "$dev_b" up &&
    ip -n "$ns_a" link set lo up && ip -n "$ns_b" link set lo up; } 2>"$1/netns.txt"
}

netns_usable() {
  [ "$(id -u)" -eq 0 ] || { echo "$1: network namespaces need root; nothing measured" >&2; return 1; }
  local tool
  for tool in ip tc taskset; do
    command -v "$tool" >/dev/null || { echo "$1: no '$tool' command (iproute2, util-linux); nothing measured" >&2; return 1; }
  done
}

netns_shape() {
  local ns_dev ns dev
  for ns_dev in "$ns_a:$dev_a" "$ns_b:$dev_b"; do
    ns="${ns_dev%%:*}" dev="${ns_dev#*:}"
    tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
    [ "$1" = none ] || tc -n "$ns" qdisc add dev "$dev" root tbf rate "$1" burst 256kb latency 200ms
  done
}
