#!/usr/bin/env bash
# Install and start a one-node Slurm cluster (slurmctld + slurmd + munge) on
# this machine, for CI. Needs root and Debian's apt; no systemd is assumed.
# slurm.conf also lists the nodes of the emulated cluster (network namespaces
# hpx1..hpxN, partition "cluster"); .ci/cluster_up.sh starts their slurmds.
# Until then they are down and, in their own partition, in nobody's way.
#
# Idempotent: a second run leaves running daemons alone unless slurm.conf
# changed, in which case it restarts them.  Every wait is bounded.
#
# Usage:  .ci/slurm_up.sh
#   env SLURM_UP_TIMEOUT=60   seconds to wait for each daemon / the node
#       SLURM_UP_MIN_CPUS=4   CPUs the node advertises at least (oversubscribes small runners)
#       SLURM_UP_CLUSTER_NODES=3   emulated nodes listed for .ci/cluster_up.sh
# Then:   srun --mpi=pmi2 -n 2 /work/venv/bin/python -c \
#           "from mpi4py import MPI; print(MPI.COMM_WORLD.Get_rank())"
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin  # slurmd, munged live in sbin

timeout_s=${SLURM_UP_TIMEOUT:-60}
conf=/etc/slurm/slurm.conf
ctld_pidfile=/run/slurmctld.pid
slurmd_pidfile=/run/slurmd.pid

log() { echo "[slurm_up] $*" >&2; }

die() {
    log "ERROR: $*"
    for f in /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log /var/log/munge/munged.log; do
        if [[ -f $f ]]; then
            echo "----- tail $f -----" >&2
            tail -n 25 "$f" >&2 || true
        fi
    done
    exit 1
}

[[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts daemons)"

# True when the pid in file $1 is a live process (pid files, not process names,
# so unrelated processes are never touched).
pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# ---- 1. packages ----------------------------------------------------------
need=()
for cmd_pkg in slurmctld:slurmctld slurmd:slurmd sinfo:slurm-client munged:munge; do
    command -v "${cmd_pkg%%:*}" >/dev/null 2>&1 || need+=("${cmd_pkg#*:}")
done
if ((${#need[@]})); then
    log "installing ${need[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    timeout 600 apt-get update -qq || die "apt-get update failed"
    # policy-rc.d in containers stops postinst from starting services: fine, we start them below.
    timeout 900 apt-get install -y -qq --no-install-recommends slurmd slurmctld slurm-client munge \
        >/tmp/slurm_up.apt.log 2>&1 || { tail -n 30 /tmp/slurm_up.apt.log >&2; die "apt-get install failed"; }
fi

# ---- 2. munge -------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_ok; then
    if pid_alive /run/munge/munged.pid; then
        die "munged is running (pid $(cat /run/munge/munged.pid)) but munge -n | unmunge fails"
    fi
    log "starting munged"
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged || die "munged did not start"
    for ((i = 0; i < timeout_s * 2; i++)); do munge_ok && break; sleep 0.5; done
    munge_ok || die "munge -n | unmunge still fails after ${timeout_s}s"
fi
log "munge works"

# ---- 3. slurm.conf --------------------------------------------------------
host=$(hostname -s)
# Advertise at least SLURM_UP_MIN_CPUS (default 4) CPUs so CI can run 4-task jobs
# on a 2-core runner without --overcommit; config_overrides makes slurmd accept it.
cpus=$(nproc)
min_cpus=${SLURM_UP_MIN_CPUS:-4}
slurmd_parameters=""
if ((cpus < min_cpus)); then
    cpus=$min_cpus
    slurmd_parameters="SlurmdParameters=config_overrides"
fi
# slurmd -C reports what slurmd will detect; a node that claims more is drained.
real_memory=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n 1)
[[ -n $real_memory ]] || real_memory=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024))
# Leave headroom so a slightly different reading at slurmd start does not drain the node.
real_memory=$((real_memory * 95 / 100))

for d in /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /etc/slurm; do
    install -d -m 0755 "$d"
done

# The emulated nodes: names and addresses of `python -m hpcpax.cluster up
# --name-prefix hpx` (its default subnet 10.213.0.0/24, node I at .(10+I)).
cluster_nodes=${SLURM_UP_CLUSTER_NODES:-3}
if ! command -v ip >/dev/null; then
    log "no ip (iproute2): the emulated cluster's nodes are left out of slurm.conf"
    cluster_nodes=0
fi
if ((cluster_nodes > 0)); then
    # slurmctld keeps calling the nodes' addresses while they are down: make
    # them unreachable then (the bridge's own route wins while they are up),
    # never routed off the machine.
    ip route replace unreachable 10.213.0.0/24 metric 4242
fi
cluster_lines=""
cluster_partition=""
for ((i = 1; i <= cluster_nodes; i++)); do
    cluster_lines+="NodeName=hpx${i} NodeAddr=10.213.0.$((10 + i)) CPUs=${cpus} RealMemory=${real_memory} State=UNKNOWN"$'\n'
done
if ((cluster_nodes > 0)); then
    cluster_partition="PartitionName=cluster Nodes=hpx[1-${cluster_nodes}] MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
fi

new_conf=$(mktemp)
trap 'rm -f "$new_conf"' EXIT
cat >"$new_conf" <<EOF
# Written by hpcpax .ci/slurm_up.sh: a one-node cluster for CI. Do not edit.
ClusterName=hpcpax-ci
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=pmi2
# No cgroups in containers: track processes by parent pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
${slurmd_parameters}
SlurmctldPidFile=${ctld_pidfile}
SlurmdPidFile=${slurmd_pidfile}
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# The emulated nodes read a copy of this file that differs in SlurmctldHost
# and per-node paths (hpcpax/cluster/slurmd.py): expected, do not log it.
DebugFlags=NO_CONF_HASH
SlurmctldPort=6817
SlurmdPort=6818
# Keep finished jobs visible to scontrol for 5 minutes (there is no slurmdbd).
MinJobAge=300
KillWait=30
InactiveLimit=0
SlurmctldTimeout=120
SlurmdTimeout=300
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${real_memory} State=UNKNOWN
${cluster_lines}PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
${cluster_partition}
EOF

conf_changed=0
if ! cmp -s "$new_conf" "$conf"; then
    log "writing $conf"
    install -m 0644 "$new_conf" "$conf"
    conf_changed=1
fi

# ---- 4. daemons -----------------------------------------------------------
stop_pidfile() {
    local pidfile=$1 pid i
    pid_alive "$pidfile" || return 0
    pid=$(cat "$pidfile")
    log "stopping pid $pid ($pidfile)"
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < timeout_s * 2; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
    die "pid $pid ($pidfile) did not stop within ${timeout_s}s"
}

if ((conf_changed)); then
    stop_pidfile "$slurmd_pidfile"
    stop_pidfile "$ctld_pidfile"
fi
if ! pid_alive "$ctld_pidfile"; then
    log "starting slurmctld"
    slurmctld || die "slurmctld failed to start"
fi
if ! pid_alive "$slurmd_pidfile"; then
    log "starting slurmd"
    slurmd || die "slurmd failed to start"
fi

# ---- 5. wait for the node -------------------------------------------------
state=""
for ((i = 0; i < timeout_s; i++)); do
    state=$(timeout 10 sinfo -h -n "$host" -o '%T' 2>/dev/null | head -n 1 || true)
    case $state in
        idle | mixed | allocated | completing) break ;;
        down* | drain* | fail*)
            # A node left down by an earlier run (ReturnToService covers most cases).
            timeout 10 scontrol update NodeName="$host" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 1
done
case $state in
    idle | mixed | allocated | completing) ;;
    *) timeout 10 scontrol show node "$host" >&2 || true
       die "node $host not ready after ${timeout_s}s (state: '${state:-none}')" ;;
esac
log "node $host is $state"
timeout 10 sinfo
