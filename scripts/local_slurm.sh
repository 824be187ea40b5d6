#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the `slurm` tests: munged, slurmctld and slurmd on localhost
# (KillWait 2 s: a cancelled or requeued job dies 2 s after its SIGTERM, mid-work in the tests); state, spool,
# logs and pids under $PCS_SLURM_DIR (default /tmp/pcs-slurm). Needs root and Debian's packages:
#   apt-get install -y slurm-wlm munge
#   bash scripts/local_slurm.sh start     # about a minute; prints the node's state when it is idle
#   bash scripts/local_slurm.sh stop      # stops only the daemons this script started (by their pid files)
#   bash scripts/local_slurm.sh running   # exit status 0 when its controller runs
set -euo pipefail
DIR=${PCS_SLURM_DIR:-/tmp/pcs-slurm}
CONF=/etc/slurm/slurm.conf

running() {
  [ -s "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2> /dev/null
}

start() {
  command -v slurmctld > /dev/null || { echo "slurm-wlm is not installed: apt-get install -y slurm-wlm munge" >&2; exit 2; }
  if running; then
    echo "already running (state under $DIR)"
    sinfo
    return 0
  fi
  mkdir -p "$DIR"/{state,spool,log,munge} /etc/slurm /run/munge
  cpus=$(nproc)
  memory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 ))
  cat > "$CONF" <<EOF
ClusterName=pcs
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
JobRequeue=1
KillWait=2
MaxArraySize=1001
NodeName=localhost CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
  [ -s /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2> /dev/null; }
  chown root:root /etc/munge/munge.key /run/munge "$DIR/munge" 2> /dev/null || true
  chmod 400 /etc/munge/munge.key
  munged --force --socket=/run/munge/munge.socket.2 --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$DIR/munge/seed"
  slurmctld
  slurmd
  for _ in $(seq 60); do
    if sinfo -h -o "%T" 2> /dev/null | grep -q idle; then
      sinfo
      return 0
    fi
    sleep 1
  done
  echo "the node did not become idle; see $DIR/log" >&2
  exit 1
}

stop() {
  for name in slurmd slurmctld munged; do
    if [ -s "$DIR/$name.pid" ]; then
      kill "$(cat "$DIR/$name.pid")" 2> /dev/null || true
      rm -f "$DIR/$name.pid"
    fi
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  running) running ;;
  *) echo "usage: $0 start|stop|running" >&2; exit 2 ;;
esac
