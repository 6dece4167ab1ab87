#!/usr/bin/env bash
# .ci/slurm/start.sh - stand up a throw-away SLURM cluster on this machine for CI (tests/test_slurm.py).
# Adapted from the reference recipe ../shared/slurm/start-slurm.sh; the project owns this copy.
# Run as root on Debian/Ubuntu (apt):   bash .ci/slurm/start.sh
# Afterwards, as any user:              source "${SLURM_CI_DIR:-/tmp/mpitrain-slurm}/env.sh"   (SLURM_CONF, sbatch_wait)
# Stop with:                            bash .ci/slurm/stop.sh   (kills only the PIDs recorded here)
# Settings (environment): SLURM_CI_DIR (default /tmp/mpitrain-slurm), SLURM_CI_CPUS (advertised CPUs, default 8),
# SLURM_CI_NODE, SLURM_CI_MEM_MB, SLURM_CI_GPUS (fake gres gpus), SLURM_CI_CTLD_PORT / SLURM_CI_SLURMD_PORT,
# SLURM_CI_NODES (default 2: nodes node1, node2, one slurmd each on this host, so that a test can exclude a node;
# MPI sees them as separate nodes and talks between them over loopback; 1: one node named after this host).
set -euo pipefail

BASE=${SLURM_CI_DIR:-/tmp/mpitrain-slurm}     # everything lives here
CPUS=${SLURM_CI_CPUS:-8}                      # advertised CPUs (may exceed real cores)
NODE=${SLURM_CI_NODE:-$(hostname -s)}
NODES=${SLURM_CI_NODES:-2}                    # >1: that many nodes node1..nodeN, one slurmd each, on this host
MEM=${SLURM_CI_MEM_MB:-$(awk '/MemTotal/{print int($2/1024)}' /proc/meminfo)}
GPUS=${SLURM_CI_GPUS:-0}                      # >0: advertise that many FAKE gpus (gres), no devices
CTLD_PORT=${SLURM_CI_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_CI_SLURMD_PORT:-6818}
CONF=$BASE/etc/slurm.conf
SOCK=$BASE/munge/run/munge.socket.2

[ "$(id -u)" = 0 ] || { echo "start.sh: run as root" >&2; exit 1; }

# 1. packages (skipped when already installed)
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  timeout 300 apt-get update -qq
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi

# 2. fresh directories (a previous cluster in $BASE must be stopped first)
if [ -f "$BASE/pids" ]; then
  echo "start.sh: $BASE/pids exists - a cluster is (or was) running: bash .ci/slurm/stop.sh first" >&2; exit 1
fi
rm -rf "$BASE"
mkdir -p "$BASE"/{etc,state,spool,log,munge/run}
chmod 755 "$BASE" "$BASE"/{etc,log,munge,munge/run}
chmod 700 "$BASE/state"

# 3. munge: private key + private socket, daemon runs as user munge
chown munge:munge "$BASE/munge" "$BASE/munge/run"
if command -v mungekey >/dev/null; then
  runuser -u munge -- mungekey --create --keyfile="$BASE/munge/munge.key"
else
  dd if=/dev/urandom of="$BASE/munge/munge.key" bs=1024 count=1 status=none
  chown munge:munge "$BASE/munge/munge.key"
fi
chmod 600 "$BASE/munge/munge.key"
runuser -u munge -- munged \
  --key-file="$BASE/munge/munge.key" --socket="$SOCK" \
  --pid-file="$BASE/munge/run/munged.pid" --log-file="$BASE/munge/munged.log" \
  --seed-file="$BASE/munge/munged.seed"
for i in $(seq 50); do [ -S "$SOCK" ] && [ -s "$BASE/munge/run/munged.pid" ] && break; sleep 0.1; done
echo "munged $(cat "$BASE/munge/run/munged.pid")" > "$BASE/pids"     # stop.sh kills exactly these
munge -S "$SOCK" -n | unmunge -S "$SOCK" >/dev/null

# 4. slurm.conf (+ optional fake-GPU gres.conf)
GRES_TYPES=""; NODE_GRES=""
HW="CPUs=${CPUS} Boards=1 SocketsPerBoard=1 CoresPerSocket=${CPUS} ThreadsPerCore=1"
if [ "$NODES" -gt 1 ]; then   # several slurmd on one host: each its own NodeName and port
  NODE_NAMES=$(seq -f 'node%g' 1 "$NODES"); NODE_LIST="node[1-${NODES}]"
  NODE_LINE="NodeName=${NODE_LIST} NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=${SLURMD_PORT}-$((SLURMD_PORT+NODES-1)) ${HW} RealMemory=$((MEM/NODES))"
  SLURMD_PORT_LINE=""
else
  NODE_NAMES=$NODE; NODE_LIST=$NODE
  NODE_LINE="NodeName=${NODE} NodeAddr=127.0.0.1 ${HW} RealMemory=${MEM}"
  SLURMD_PORT_LINE="SlurmdPort=${SLURMD_PORT}"
fi
if [ "$GPUS" -gt 0 ]; then GRES_TYPES="GresTypes=gpu"; NODE_GRES=" Gres=gpu:${GPUS}"; fi
cat > "$CONF" <<EOF
ClusterName=ci
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# private munge socket; cred_expire also sets the requeue hold time (default 120 s)
AuthInfo=socket=${SOCK},cred_expire=10
SlurmctldPort=${CTLD_PORT}
${SLURMD_PORT_LINE}
StateSaveLocation=${BASE}/state
SlurmdSpoolDir=${BASE}/spool/slurmd-%n
SlurmctldPidFile=${BASE}/state/slurmctld.pid
SlurmdPidFile=${BASE}/spool/slurmd-%n.pid
SlurmctldLogFile=${BASE}/log/slurmctld.log
SlurmdLogFile=${BASE}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# no cgroups needed
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=${BASE}/log/jobcomp.txt
SchedulerType=sched/backfill
# re-run the scheduler every 5 s (default 60 s main / 30 s backfill): requeued jobs restart promptly
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmi2
# trust the CPU/memory numbers below even if the hardware has fewer
SlurmdParameters=config_overrides
ReturnToService=2
# <=5 keeps "sbatch --wait" polling every 2 s (larger values back off to 8 s, then 32 s); 22.05 rejects 0
MinJobAge=5
KillWait=5
InactiveLimit=0
Waittime=0
JobRequeue=1
# job ids differ from those of earlier (or concurrent) clusters on this machine, which a fresh state directory would
# start again at 1: MPICH names its shared-memory segments after "JOBID.STEPID", and a killed job's leftovers in
# /dev/shm break a later job of that id (two live jobs of one id would share one)
FirstJobId=$(( (RANDOM * 32768 + RANDOM) % 60000000 + 1 ))
# reject impossible requests (e.g. -n > CPUs) at submit time instead of leaving them PENDING forever
EnforcePartLimits=ALL
${GRES_TYPES}
${NODE_LINE}${NODE_GRES} State=UNKNOWN
PartitionName=debug Nodes=${NODE_LIST} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
if [ "$GPUS" -gt 0 ]; then   # fake gpus = char devices (copies of /dev/null); Count= alone drains the node
  mkdir -p "$BASE/dev"; : > "$BASE/etc/gres.conf"
  for i in $(seq 0 $((GPUS-1))); do
    mknod -m 666 "$BASE/dev/gpu$i" c 1 3
    echo "NodeName=${NODE_LIST} Name=gpu File=$BASE/dev/gpu$i" >> "$BASE/etc/gres.conf"
  done
fi
chmod 644 "$BASE"/etc/*
cat > "$BASE/env.sh" <<EOF
export SLURM_CONF=$CONF
# sbatch_wait ARGS... : submit a batch job and wait for it; fails unless the job ends COMPLETED.
# Polls instead of 'sbatch --wait' (which can return 0 for TIMEOUT and for jobs cancelled while pending), survives
# requeues (a requeued job is PENDING again, not finished), and gives up after SBATCH_WAIT_TIMEOUT seconds
# (default 900), cancelling the job: a job that can never run stays PENDING forever.
sbatch_wait() {
  local jid st deadline=\$((SECONDS + \${SBATCH_WAIT_TIMEOUT:-900}))
  jid=\$(timeout 60 sbatch --parsable "\$@") || return 1
  jid=\${jid%%;*}
  [ -n "\$jid" ] || return 1
  echo "job \$jid: submitted" >&2
  while :; do
    st=\$(timeout 30 scontrol show job -o "\$jid" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
    case \$st in ""|COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE) break ;; esac
    if [ "\$SECONDS" -ge "\$deadline" ]; then
      echo "job \$jid: still \$st after \${SBATCH_WAIT_TIMEOUT:-900} s; cancelling it" >&2
      scancel "\$jid"; return 1
    fi
    sleep 1
  done
  # the record is gone MinJobAge (5 s) after the end: then the job-completion log says how it ended
  [ -n "\$st" ] || st=\$(sacct -c -n -j "\$jid" -o State | tail -n 1 | tr -d ' ')
  echo "job \$jid: state=\$st" >&2
  [ "\$st" = COMPLETED ]
}
EOF

# 5. daemons (they daemonize themselves and write the pid files named above)
slurmctld -f "$CONF" || echo "slurmctld failed to start" >&2
for n in $NODE_NAMES; do slurmd -f "$CONF" -N "$n" || echo "slurmd $n failed to start" >&2; done
export SLURM_CONF=$CONF
all_idle() {  # every node of the cluster answers idle
  [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle"' | sort -u | wc -l)" -ge "$NODES" ]
}
for i in $(seq 120); do
  [ -s "$BASE/state/slurmctld.pid" ] && all_idle && break
  sleep 0.5
done
[ -s "$BASE/state/slurmctld.pid" ] && echo "slurmctld $(cat "$BASE/state/slurmctld.pid")" >> "$BASE/pids"
for n in $NODE_NAMES; do
  [ -s "$BASE/spool/slurmd-$n.pid" ] && echo "slurmd $(cat "$BASE/spool/slurmd-$n.pid")" >> "$BASE/pids"
done
if ! all_idle; then
  echo "start.sh: not every node ($(echo $NODE_NAMES)) became idle" >&2
  sinfo -R >&2 || true; tail -n 30 "$BASE"/log/*.log "$BASE"/munge/munged.log >&2; exit 1
fi
sinfo
echo "SLURM up. Use: source $BASE/env.sh   (pids in $BASE/pids; stop: bash .ci/slurm/stop.sh)"
