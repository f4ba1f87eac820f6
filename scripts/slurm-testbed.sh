#!/usr/bin/env bash
# slurm-testbed.sh - a real, throw-away Slurm on this one machine, for hpcrl's tests.
#
#   scripts/slurm-testbed.sh start     install Debian's Slurm if missing, start munge, MariaDB +
#                                      slurmdbd (accounting), slurmctld and one slurmd per fake node
#   scripts/slurm-testbed.sh stop [--purge]
#   scripts/slurm-testbed.sh status
#
# Then: source /tmp/hpcrl-testbed/env.sh   (sets SLURM_CONF)
#
# Nodes n1..nN all run on this host (Debian's build has MULTIPLE_SLURMD); their GPUs are FAKE:
# gres.conf File= entries are symlinks to /dev/null, so jobs get CUDA_VISIBLE_DEVICES but no GPU.
# Adapted from ../shared/testbed/reference-start-slurm.sh, whose pitfall notes are kept inline.
#
# Knobs (environment variables):
#   SLURM_BASE=/tmp/hpcrl-testbed  state/config/log root (wiped on start)
#   SLURM_NODES=2         emulated compute nodes
#   SLURM_NODE_CPUS=8     CPUs per emulated node (may exceed real cores)
#   SLURM_NODE_MEM=16000  RealMemory (MB) per emulated node
#   SLURM_NODE_GPUS=4     fake GPUs per node
#   SLURM_ACCOUNTING=dbd  dbd (slurmdbd + MariaDB, full sacct) or none
#   SLURM_DB_PORT=3307    private MariaDB port (127.0.0.1 only)
#   SLURM_SKIP_INSTALL=1  do not run apt-get
#   SLURM_WARMUP=1        run one batch job across all nodes before returning
set -euo pipefail
log() { echo "[slurm-testbed $(date +%T)] $*"; }

clean_stale_mpich_shm() {   # segments of jobs killed inside MPI_Init: ~4 MB of memory each
  local inuse f
  inuse=$(ls -l /proc/[0-9]*/fd 2>/dev/null | grep -o '/dev/shm/mpich_shm_[^ ]*'; \
          grep -ho '/dev/shm/mpich_shm_[^ ]*' /proc/[0-9]*/maps 2>/dev/null) || true
  for f in /dev/shm/mpich_shm_*; do
    [ -e "$f" ] || continue
    grep -qxF "$f" <<<"$inuse" || rm -f "$f"
  done
}

start() {

SLURM_BASE=${SLURM_BASE:-/tmp/hpcrl-testbed}
SLURM_NODES=${SLURM_NODES:-2}
SLURM_NODE_CPUS=${SLURM_NODE_CPUS:-8}
SLURM_NODE_MEM=${SLURM_NODE_MEM:-16000}
SLURM_NODE_GPUS=${SLURM_NODE_GPUS:-4}
SLURM_ACCOUNTING=${SLURM_ACCOUNTING:-dbd}
SLURM_DB_PORT=${SLURM_DB_PORT:-3307}
SLURM_CLUSTER=${SLURM_CLUSTER:-testcluster}
B=$SLURM_BASE
HOST=$(hostname -s)


[ "$(id -u)" = 0 ] || { echo "slurm-testbed: must run as root" >&2; exit 1; }

# ---------------------------------------------------------------- install
pkgs=(slurmctld slurmd slurm-client munge libpmix-dev)
[ "$SLURM_ACCOUNTING" = dbd ] && pkgs+=(slurmdbd mariadb-server)
if [ -z "${SLURM_SKIP_INSTALL:-}" ]; then
  missing=()
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # policy-rc.d (if present) stops the packages' own service start; harmless otherwise
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

# ------------------------------------------------- refuse to double-start
if [ -f "$B/run/slurmctld.pid" ] && ps -o stat= -p "$(cat "$B/run/slurmctld.pid")" 2>/dev/null | grep -qv Z; then
  log "already running (slurmctld pid $(cat "$B/run/slurmctld.pid"))"
  echo "export SLURM_CONF=$B/etc/slurm.conf"
  return 0
fi

# ------------------------------------------------------------- directories
# Job ids must not repeat across restarts (the state below is wiped): MPICH names its shared
# memory after the job step, and a segment left by a killed job of the same id makes the new
# job's MPI_Init wait forever. The next first id is kept beside the base directory.
NEXT_ID_FILE="$B.next-job-id"
FIRST_JOB_ID=$(cat "$NEXT_ID_FILE" 2>/dev/null || echo 1)
case $FIRST_JOB_ID in ''|*[!0-9]*) FIRST_JOB_ID=1;; esac
[ "$FIRST_JOB_ID" -lt 60000000 ] || FIRST_JOB_ID=1
echo $((FIRST_JOB_ID + 100000)) > "$NEXT_ID_FILE"
clean_stale_mpich_shm
rm -rf "$B"
mkdir -p "$B"/{etc,state,spool,log,run,tmp,jobs,fakegpu,munge/etc,munge/run,munge/lib}
chmod 755 "$B" "$B/munge" "$B/munge/run"   # munged: socket dir must be a+x
chmod 700 "$B/munge/etc" "$B/munge/lib"
NODELIST="n[1-$SLURM_NODES]"
[ "$SLURM_NODES" = 1 ] && NODELIST=n1
for i in $(seq 1 "$SLURM_NODES"); do mkdir -p "$B/spool/n$i" "$B/tmp/n$i"; done

# ------------------------------------------------------------------ munge
dd if=/dev/urandom of="$B/munge/etc/munge.key" bs=1024 count=1 status=none
chmod 400 "$B/munge/etc/munge.key"
MSOCK=$B/munge/run/munge.socket
munged --socket="$MSOCK" --key-file="$B/munge/etc/munge.key" \
       --log-file="$B/log/munged.log" --pid-file="$B/run/munged.pid" \
       --seed-file="$B/munge/lib/munged.seed" --num-threads=4
for _ in $(seq 50); do [ -S "$MSOCK" ] && break; sleep 0.1; done
munge -n -S "$MSOCK" | unmunge -S "$MSOCK" >/dev/null
log "munged up (pid $(cat "$B/run/munged.pid"))"

# ----------------------------------------------------------- slurm.conf
PORT0=17000
cat > "$B/etc/slurm.conf" <<EOF
ClusterName=$SLURM_CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also holds a requeued job back before it may start again (default 120 s): short
# here so the requeue tests take seconds, not minutes.
AuthInfo=socket=$MSOCK,cred_expire=10
SlurmctldPort=6817
StateSaveLocation=$B/state
SlurmdSpoolDir=$B/spool/%n
TmpFS=$B/tmp/%n
SlurmctldPidFile=$B/run/slurmctld.pid
SlurmdPidFile=$B/run/slurmd-%n.pid
SlurmctldLogFile=$B/log/slurmctld.log
SlurmdLogFile=$B/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: plain /proc process tracking, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/filetxt
JobCompLoc=$B/log/jobcomp.txt
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=500
# hpcrl: requeue on preemption/time-limit signals; completed jobs stay visible to squeue for 5 min
JobRequeue=1
MinJobAge=300
ReturnToService=2
KillWait=5
MpiDefault=none
FirstJobId=$FIRST_JOB_ID
SwitchType=switch/none
MailProg=/bin/true
EOF
if [ "$SLURM_ACCOUNTING" = dbd ]; then
  cat >> "$B/etc/slurm.conf" <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
AccountingStoragePass=$MSOCK
AccountingStorageTRES=gres/gpu
EOF
else
  echo "AccountingStorageType=accounting_storage/none" >> "$B/etc/slurm.conf"
fi
GRES=""
if [ "$SLURM_NODE_GPUS" -gt 0 ]; then
  echo "GresTypes=gpu" >> "$B/etc/slurm.conf"
  GRES="Gres=gpu:$SLURM_NODE_GPUS"
  for g in $(seq 0 $((SLURM_NODE_GPUS - 1))); do ln -s /dev/null "$B/fakegpu/nvidia$g"; done
  cat > "$B/etc/gres.conf" <<EOF
AutoDetect=off
NodeName=$NODELIST Name=gpu File=$B/fakegpu/nvidia$([ "$SLURM_NODE_GPUS" = 1 ] && echo 0 || echo "[0-$((SLURM_NODE_GPUS - 1))]")
EOF
fi
cat >> "$B/etc/slurm.conf" <<EOF
NodeName=$NODELIST NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT0 + 1))-$((PORT0 + SLURM_NODES)) CPUs=$SLURM_NODE_CPUS Sockets=1 CoresPerSocket=$SLURM_NODE_CPUS ThreadsPerCore=1 RealMemory=$SLURM_NODE_MEM $GRES State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes=ALL MaxTime=00:30:00 State=UP
EOF
export SLURM_CONF=$B/etc/slurm.conf
echo "export SLURM_CONF=$SLURM_CONF" > "$B/env.sh"

# ------------------------------------------------- MariaDB + slurmdbd
if [ "$SLURM_ACCOUNTING" = dbd ]; then
  mkdir -p "$B/mysql"
  mariadb-install-db --no-defaults --datadir="$B/mysql/data" --user=root \
      --auth-root-authentication-method=socket --skip-test-db >"$B/log/mariadb-install.log" 2>&1
  /usr/sbin/mariadbd --no-defaults --datadir="$B/mysql/data" --user=root \
      --socket="$B/mysql/mysql.sock" --pid-file="$B/run/mariadbd.pid" \
      --bind-address=127.0.0.1 --port="$SLURM_DB_PORT" --log-error="$B/log/mariadb.log" \
      --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
  for _ in $(seq 150); do
    mariadb --no-defaults -S "$B/mysql/mysql.sock" -u root -e 'select 1' >/dev/null 2>&1 && break; sleep 0.2
  done
  mariadb --no-defaults -S "$B/mysql/mysql.sock" -u root -e "
    CREATE USER 'slurm'@'localhost' IDENTIFIED BY 'slurm';
    CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
  log "mariadbd up (pid $(cat "$B/run/mariadbd.pid"))"
  cat > "$B/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MSOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
DebugLevel=info
LogFile=$B/log/slurmdbd.log
PidFile=$B/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$SLURM_DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$B/etc/slurmdbd.conf"
  slurmdbd      # reads slurmdbd.conf next to $SLURM_CONF; daemonizes
  for _ in $(seq 150); do grep -q 'slurmdbd version .* started' "$B/log/slurmdbd.log" 2>/dev/null && break; sleep 0.2; done
  grep -q 'slurmdbd version .* started' "$B/log/slurmdbd.log" || { tail -20 "$B/log/slurmdbd.log"; exit 1; }
  log "slurmdbd up (pid $(cat "$B/run/slurmdbd.pid"))"
  sacctmgr -i add cluster "$SLURM_CLUSTER" >/dev/null
  sacctmgr -i add account default Description=default Organization=default >/dev/null
  sacctmgr -i add user root Account=default DefaultAccount=default >/dev/null
fi

# --------------------------------------------------- slurmctld + slurmd(s)
slurmctld
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.2; done
scontrol ping | grep -q 'is UP' || { tail -20 "$B/log/slurmctld.log" >&2; exit 1; }
log "slurmctld up (pid $(cat "$B/run/slurmctld.pid"))"
for i in $(seq 1 "$SLURM_NODES"); do slurmd -N "n$i"; done

deadline=$((SECONDS + 60))
until [ "$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l)" -eq "$SLURM_NODES" ]; do
  if [ $SECONDS -ge $deadline ]; then
    echo "nodes did not become idle:" >&2; sinfo -N -l >&2; tail -5 "$B"/log/slurmd-n1.log >&2; exit 1
  fi
  sleep 0.2
done
log "all $SLURM_NODES nodes idle"
# slurmctld's first scheduling pass for batch jobs comes ~3-4 s after it
# starts; batch jobs submitted earlier wait for it.  A warm-up batch job (with
# an srun step on every node) proves that jobs really run.
if [ "${SLURM_WARMUP:-1}" = 1 ]; then
  # (not "sbatch --wait": it polls with growing sleeps, ~10 s here)
  wj=$(cd "$B/jobs" && sbatch --parsable -J warmup -N "$SLURM_NODES" -n "$SLURM_NODES" \
      -o /dev/null --wrap 'srun true')
  for _ in $(seq 300); do
    st=$(scontrol show job "$wj" 2>/dev/null | grep -oP 'JobState=\K\S+')
    case $st in COMPLETED) break;; PENDING|RUNNING|COMPLETING|CONFIGURING|"") sleep 0.2;;
      *) echo "warm-up job $wj ended $st" >&2; exit 1;; esac
  done
  [ "$st" = COMPLETED ] || { echo "warm-up job $wj still $st after 60 s" >&2; exit 1; }
  log "warm-up batch job $wj across $SLURM_NODES node(s) done"
fi
sinfo -N -o '%N %P %T %c %m %G'
echo "export SLURM_CONF=$SLURM_CONF"
}

stop() {
SLURM_BASE=${SLURM_BASE:-/tmp/hpcrl-testbed}
B=$SLURM_BASE
export SLURM_CONF=$B/etc/slurm.conf

alive() {      # running and not a zombie (PID 1 here reaps orphans late)
  local st; st=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "${st#Z}" = "$st" ]
}
stop_pid() {   # stop_pid <pidfile> <name>
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f" 2>/dev/null) || return 0
  [ -n "$pid" ] && alive "$pid" || { rm -f "$f"; return 0; }
  kill "$pid" 2>/dev/null
  for _ in $(seq 150); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then echo "$2 ($pid) ignored SIGTERM, sending SIGKILL"; kill -9 "$pid"; fi
  rm -f "$f"
}

if [ -f "$SLURM_CONF" ] && [ -f "$B/run/slurmctld.pid" ]; then
  scancel --quiet --full --user=root 2>/dev/null || true      # kill running jobs first
  for _ in $(seq 50); do [ -z "$(squeue -h -t R,CG 2>/dev/null)" ] && break; sleep 0.2; done
fi
for f in "$B"/run/slurmd-*.pid; do [ -e "$f" ] && stop_pid "$f" slurmd; done
stop_pid "$B/run/slurmctld.pid" slurmctld
stop_pid "$B/run/slurmdbd.pid"  slurmdbd
stop_pid "$B/run/mariadbd.pid"  mariadbd
stop_pid "$B/run/munged.pid"    munged

if [ "${1:-}" = --purge ]; then rm -rf "$B"; fi
log "stopped"
}

status() {
  SLURM_BASE=${SLURM_BASE:-/tmp/hpcrl-testbed}
  export SLURM_CONF=$SLURM_BASE/etc/slurm.conf
  [ -f "$SLURM_CONF" ] || { echo "slurm-testbed: not set up (no $SLURM_CONF)"; return 1; }
  scontrol ping && sinfo -N -o '%N %P %T %c %m %G'
}

case "${1:-}" in
  start) start ;;
  stop) shift; stop "$@" ;;
  status) status ;;
  *) echo "usage: $0 start|stop [--purge]|status" >&2; exit 2 ;;
esac
