#!/usr/bin/env bash
# .ci/slurm/stop.sh - stop only the daemons recorded by .ci/slurm/start.sh (adapted from ../shared/slurm).
# Cancels the private cluster's leftover jobs first; safe to run when no cluster is up.
set -u
BASE=${SLURM_CI_DIR:-/tmp/mpitrain-slurm}
[ -f "$BASE/pids" ] || { echo "stop.sh: no $BASE/pids (no cluster started there)"; exit 0; }
export SLURM_CONF=$BASE/etc/slurm.conf
timeout 20 scancel --quiet --partition=debug 2>/dev/null && sleep 1   # cancel leftover jobs (private cluster)
for d in slurmd slurmctld munged; do                                  # order matters: slurmd(s), ctld, then munge
  for pid in $(awk -v d=$d '$1==d{print $2}' "$BASE/pids"); do
    # only if that pid is still this daemon (a stale pids file, e.g. after a reboot, may name someone else's process)
    [ "$(ps -p "$pid" -o comm= 2>/dev/null)" = "$d" ] || { echo "stop.sh: $d ($pid) is not running"; continue; }
    kill "$pid" 2>/dev/null || continue
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && echo "stop.sh: warning: $d ($pid) still running"
  done
done
rm -f "$BASE/pids"
echo "stop.sh: stopped the cluster in $BASE"
