#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for the launcher tests and CI.
#
#   tools/slurm_cluster.sh install   apt-get install slurmctld slurmd slurm-client munge
#   tools/slurm_cluster.sh start     install if missing, configure, start, wait for idle nodes
#   tools/slurm_cluster.sh stop      stop the daemons this script started
#   tools/slurm_cluster.sh status    sinfo; exit 0 only when every node is up
#
# One host, SLURM_CLUSTER_NODES virtual nodes (4 unless set): `slurmd -N n1` ... `slurmd
# -N n4`, each on its own port, NodeHostname = this host, and n1..n4 resolve to 127.0.0.1
# through /etc/hosts. Then `srun -N4 -n4 ...` is a real four-node job step: a hostlist of
# more than two nodes, rank 0 on one node among several. Each node claims 2 CPUs (whatever
# the machine has: SlurmdParameters=config_overrides), so `srun -N1 -n2` fits on one node.
# Needs root (daemons, /etc/hosts, /etc/slurm). `start` is idempotent and bounded: it
# gives up after START_TIMEOUT_S seconds with the daemons' logs.
set -euo pipefail

STATE_DIR=${SLURM_CLUSTER_DIR:-/var/lib/engine-slurm}
CONF=/etc/slurm/slurm.conf
START_TIMEOUT_S=${START_TIMEOUT_S:-90}
NODE_COUNT=${SLURM_CLUSTER_NODES:-4}
[[ $NODE_COUNT =~ ^[1-9][0-9]?$ ]] || { echo "slurm_cluster: error: SLURM_CLUSTER_NODES=$NODE_COUNT: want a node count from 1 to 99" >&2; exit 2; }
NODES=() PORTS=()
for ((i = 1; i <= NODE_COUNT; i++)); do NODES+=("n$i"); PORTS+=($((17000 + i))); done
CPUS_PER_NODE=2
HOST=$(hostname)

log() { echo "slurm_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

need_root() { [ "$(id -u)" -eq 0 ] || die "run as root (it starts daemons and edits /etc/hosts)"; }

installed() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
              command -v sinfo >/dev/null && command -v munged >/dev/null; }

cmd_install() {
    need_root
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q slurmctld slurmd slurm-client munge
}

# True when the pid in file $1 is a live process.
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_config() {
    mkdir -p "$STATE_DIR" /etc/slurm
    local tmp
    tmp=$(mktemp)
    cat >"$tmp" <<EOF
# Written by tools/slurm_cluster.sh: one host ($HOST), $NODE_COUNT virtual nodes.
ClusterName=local
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=5
# A pending job (a requeued one once cred_expire has passed) starts at the next scheduling
# pass: every second here, not every 30 s (backfill) or 60 s (main loop) as by default.
SchedulerParameters=bf_interval=1,sched_interval=1
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool-%n
SlurmdPidFile=$STATE_DIR/slurmd-%n.pid
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmctldLogFile=$STATE_DIR/slurmctld.log
SlurmdLogFile=$STATE_DIR/slurmd-%n.log
SlurmctldPort=16817
SlurmdTimeout=60
InactiveLimit=0
# A pre-empted task writes its snapshot and exits 75; on a loaded machine that can take
# longer than 10 s, and srun then SIGKILLs it (the requeue test saw "task 0: Killed").
KillWait=30
# sbatch --wait polls a job at 2 s, then 8 s, then 32 s intervals while the interval is
# under MinJobAge/2: a 12 s job was seen as done after 42 s. MinJobAge=4 keeps it at 2 s
# (a finished job's record stays at least 4 s, past sbatch's next look).
MinJobAge=4
JobCompType=jobcomp/none
EOF
    local i
    for i in "${!NODES[@]}"; do
        echo "NodeName=${NODES[$i]} NodeHostname=$HOST NodeAddr=127.0.0.1" \
             "Port=${PORTS[$i]} CPUs=$CPUS_PER_NODE RealMemory=2000 State=UNKNOWN" >>"$tmp"
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES" \
         "MaxTime=INFINITE State=UP OverSubscribe=YES" >>"$tmp"
    if [ -f "$CONF" ] && cmp -s "$tmp" "$CONF"; then
        rm -f "$tmp"
        return 1  # unchanged
    fi
    mv "$tmp" "$CONF"
    chmod 644 "$CONF"
    return 0
}

add_hosts() {
    local n
    for n in "${NODES[@]}"; do
        grep -Eq "^[0-9.]+[[:space:]].*\\b$n\\b" /etc/hosts || echo "127.0.0.1 $n" >>/etc/hosts
    done
    getent hosts "$HOST" >/dev/null || echo "127.0.0.1 $HOST" >>/etc/hosts
}

start_munge() {
    mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
    if ! alive /run/munge/munged.pid; then
        runuser -u munge -- /usr/sbin/munged --force
    fi
    local deadline=$((SECONDS + 15))
    until munge -n </dev/null | unmunge >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || die "munged does not answer (see /var/log/munge/munged.log)"
        sleep 0.5
    done
}

stop_daemons() {
    local pidfile pid
    for pidfile in "$STATE_DIR"/slurmd-*.pid "$STATE_DIR"/slurmctld.pid; do
        [ -e "$pidfile" ] || continue
        if alive "$pidfile"; then
            pid=$(cat "$pidfile")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
}

nodes_idle() {
    # Every node idle (or busy with a job: mixed/allocated), none down or drained.
    local states
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
    local n
    for n in "${NODES[@]}"; do
        echo "$states" | grep -Eq "^$n (idle|mix|alloc|comp)\$" || return 1
    done
}

cmd_start() {
    need_root
    installed || cmd_install
    add_hosts
    local changed=0
    write_config && changed=1
    mkdir -p "$STATE_DIR/state"
    start_munge
    if [ $changed -eq 1 ]; then
        stop_daemons  # running daemons read the old configuration
    fi
    if ! alive "$STATE_DIR/slurmctld.pid"; then
        slurmctld
    fi
    local i
    for i in "${!NODES[@]}"; do
        mkdir -p "$STATE_DIR/spool-${NODES[$i]}"
        alive "$STATE_DIR/slurmd-${NODES[$i]}.pid" || slurmd -N "${NODES[$i]}"
    done
    local deadline=$((SECONDS + START_TIMEOUT_S)) resumed=0
    until nodes_idle; do
        if [ $SECONDS -ge $deadline ]; then
            sinfo -N -l >&2 || true
            tail -n 20 "$STATE_DIR"/slurmctld.log "$STATE_DIR"/slurmd-*.log >&2 || true
            die "nodes ${NODES[*]} not idle after ${START_TIMEOUT_S}s"
        fi
        # A node left down/drained by an earlier run comes back once asked to.
        if [ $resumed -eq 0 ] && sinfo -h -N -o '%t' 2>/dev/null | grep -Eq 'down|drain'; then
            scontrol update NodeName="$(IFS=,; echo "${NODES[*]}")" State=RESUME 2>/dev/null || true
            resumed=1
        fi
        sleep 1
    done
    log "up: $(sinfo -h -o '%P %a %D %t %N' | tr '\n' ' ')"
}

cmd_stop() {
    need_root
    stop_daemons
    # munged is left running: other tools on the machine may use it, and it is harmless.
    log "stopped"
}

cmd_status() {
    if ! command -v sinfo >/dev/null; then
        log "not installed (tools/slurm_cluster.sh install)"
        return 1
    fi
    sinfo -N -o '%N %P %t %c' 2>&1 || true
    nodes_idle
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
