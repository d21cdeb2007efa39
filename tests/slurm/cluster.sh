#!/usr/bin/env bash
# A one-node Slurm cluster for the tests, in a state directory of its own:
# munged (as the munge user), slurmctld and slurmd, with no systemd and no
# cgroups. A job in partition "urgent" preempts one in "test" (the default)
# as a scheduler does: SIGTERM to the job's tasks, 60 s of grace, requeue. Every daemon runs in the foreground of a background job of this
# script's, and is stopped by the pid recorded for it.
#
#   bash tests/slurm/cluster.sh up DIR     # prints SLURM_CONF=DIR/slurm.conf once the node is idle
#   bash tests/slurm/cluster.sh down DIR   # stops what `up` started in DIR
#
# Exit 77 from `up`: Slurm is not installed (scripts/install_deps.sh installs it).
set -euo pipefail
action="${1:-}" dir="${2:-}"
[ -n "$dir" ] || { echo "usage: cluster.sh up|down DIR" >&2; exit 2; }

stop() {
  local f pid
  for f in "$dir"/slurmd.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
    [ -f "$f" ] || continue
    pid="$(cat "$f")"
    if [[ "$pid" =~ ^[0-9]+$ ]] && [ "$pid" -gt 1 ]; then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
}

case "$action" in
  down) stop; exit 0 ;;
  up) ;;
  *) echo "usage: cluster.sh up|down DIR" >&2; exit 2 ;;
esac

for tool in munged slurmctld slurmd sbatch; do
  command -v "$tool" >/dev/null || { echo "cluster.sh: $tool is not installed" >&2; exit 77; }
done
[ -r /etc/munge/munge.key ] || { echo "cluster.sh: no /etc/munge/munge.key" >&2; exit 77; }

mkdir -p "$dir/munge" "$dir/state" "$dir/spool"
chmod o+x "$dir"  # the munge user reaches its socket below it
chown munge: "$dir/munge"
chmod 700 "$dir/munge"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
node="$(uname -n)"; node="${node%%.*}"
cat >"$dir/slurm.conf" <<CONF
ClusterName=mnistddptest
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.daemon.pid
SlurmdPidFile=$dir/slurmd.daemon.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=test Nodes=$node Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=urgent Nodes=$node MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
CONF
# Slurm 23 and later start a cgroup plugin in slurmd unless told not to.
major="$(slurmd -V | sed -E 's/^[^0-9]*([0-9]+).*/\1/')"
[ "$major" -ge 23 ] && echo "CgroupPlugin=disabled" >"$dir/cgroup.conf"
export SLURM_CONF="$dir/slurm.conf"

runuser -u munge -- munged --foreground --socket="$dir/munge/munge.socket" --pid-file="$dir/munge/munged.pid" \
  --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" --force >/dev/null 2>&1 &
for _ in $(seq 50); do [ -S "$dir/munge/munge.socket" ] && [ -s "$dir/munge/munged.pid" ] && break; sleep 0.1; done
cp "$dir/munge/munged.pid" "$dir/munged.pid"  # munged's own, not runuser's
slurmctld -D -f "$SLURM_CONF" >"$dir/slurmctld.out" 2>&1 &
echo $! >"$dir/slurmctld.pid"
slurmd -D -f "$SLURM_CONF" >"$dir/slurmd.out" 2>&1 &
echo $! >"$dir/slurmd.pid"
for _ in $(seq 300); do
  if sinfo -h -o %t 2>/dev/null | grep -qx idle; then
    echo "SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.1
done
echo "cluster.sh: the node never became idle within 30 s; see $dir/slurmctld.log and $dir/slurmd.log" >&2
stop
exit 1
