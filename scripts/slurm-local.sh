#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for running jobs with srun in tests:
#
#   scripts/slurm-local.sh start   # prints `export SLURM_CONF=...` for the caller to eval
#   scripts/slurm-local.sh stop    # stops what `start` started (nothing it did not start)
#
# Installs Debian's slurm-wlm and munge when missing. munged runs as the munge user;
# slurmctld and slurmd run in the foreground (-D) as root (SlurmUser=root), with
# ProctrackType=proctrack/linuxproc and TaskPlugin=task/none (no cgroups needed), one node
# with this machine's CPUs, and a partition with OverSubscribe=FORCE so that `srun -n 4
# --overcommit` runs 4 tasks on 2 cores. Needs root or sudo. The daemons' output goes to
# log files in the state folder ($NCCL_SAFE_SLURM_DIR, default /tmp/nccl-safe-slurm), which
# `start` prints when the cluster does not come up.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ci-lib.sh
dir="${NCCL_SAFE_SLURM_DIR:-/tmp/nccl-safe-slurm}"
conf="$dir/slurm.conf"
sudo_cmd=""
[ "$(id -u)" = 0 ] || sudo_cmd="sudo"
fail() { echo "slurm-local: FAILED: $*" >&2; exit 1; }

stop() {
  local f
  for f in slurmd slurmctld munged; do
    if [ -f "$dir/$f.started" ]; then
      $sudo_cmd kill "$(cat "$dir/$f.started")" 2>/dev/null || true
      rm -f "$dir/$f.started"
    fi
  done
}

# up: whether the cluster answers and its node is ready for jobs.
up() {
  SLURM_CONF="$conf" timeout 5 sinfo -h -o '%T' 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'
}

# spawn NAME CMD...: starts a daemon in its own session, output to a log, pid recorded.
spawn() {
  local name="$1"; shift
  $sudo_cmd setsid "$@" >"$dir/$name.out" 2>&1 </dev/null &
  echo $! >"$dir/$name.started"
}

start() {
  for c in srun sinfo slurmctld slurmd munged munge; do
    command -v "$c" >/dev/null 2>&1 || [ -x "/usr/sbin/$c" ] || {
      echo "slurm-local: installing Debian's slurm-wlm and munge (no $c)" >&2
      apt_install slurm-wlm munge
      break
    }
  done
  export PATH="$PATH:/usr/sbin"
  mkdir -p "$dir/state" "$dir/spool"
  if [ -f "$conf" ] && up; then
    echo "export SLURM_CONF=$conf"
    return
  fi
  # munge: a key (Debian's package makes one), then the daemon as its own user.
  [ -f /etc/munge/munge.key ] || $sudo_cmd mungekey --create
  if ! munge -n >/dev/null 2>&1; then
    $sudo_cmd mkdir -p /run/munge /var/log/munge /var/lib/munge
    $sudo_cmd chown munge:munge /run/munge /var/log/munge /var/lib/munge
    spawn munged $sudo_cmd runuser -u munge -- munged --foreground
    for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n >/dev/null 2>&1 || { cat "$dir/munged.out" >&2; fail "munged did not start"; }
  fi
  local host cpus
  host="$(hostname -s)"
  cpus="$(nproc)"
  cat >"$conf" <<CONF
ClusterName=nccl-safe-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES OverSubscribe=FORCE MaxTime=INFINITE State=UP
CONF
  spawn slurmctld "$(command -v slurmctld)" -D -f "$conf"
  spawn slurmd "$(command -v slurmd)" -D -f "$conf"
  for _ in $(seq 100); do up && break; sleep 0.3; done
  if ! up; then
    tail -n 20 "$dir"/*.out "$dir"/*.log >&2 || true
    stop
    fail "the one-node cluster did not come up within 30 s"
  fi
  echo "export SLURM_CONF=$conf"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
