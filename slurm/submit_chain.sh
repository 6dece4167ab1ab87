#!/usr/bin/env bash
# slurm/submit_chain.sh - submit N jobs of slurm/train.sbatch that run one after another on the same run.
#
#   slurm/submit_chain.sh N CONFIG [mpitrain train options...]
#   slurm/submit_chain.sh 5 configs/quickstart.toml --out runs/qs --set train.steps=20000
#
# Job k+1 waits for job k to end in any state (--dependency=afterany), so a run longer than the time limit continues
# even when a job is stopped by the limit itself, or fails to requeue; every job runs `mpitrain train CONFIG
# --resume auto ...` with the same arguments and so continues from the newest committed checkpoint. Give --out (the
# same run directory for all). Jobs that start after the run has reached train.steps end quickly.
# sbatch options for every job: the environment (SBATCH_TIMELIMIT, SBATCH_PARTITION, ... as sbatch reads them), or
# MPITRAIN_SBATCH_ARGS="--time=4:00:00 -N 2 --ntasks-per-node=4" (split on spaces). Prints the job ids, one a line.
set -euo pipefail
if [ $# -lt 2 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 N CONFIG [mpitrain train options...]   (N >= 1 jobs, each continuing the previous)" >&2
    exit 2
fi
count=$1
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
read -ra sbatch_args <<< "${MPITRAIN_SBATCH_ARGS:-}"
previous=""
for i in $(seq "$count"); do
    dependency=()
    [ -n "$previous" ] && dependency=(--dependency="afterany:$previous")
    submitted=$(sbatch --parsable "${dependency[@]}" "${sbatch_args[@]}" "$here/train.sbatch" "$@")
    previous=${submitted%%;*}   # "id" or "id;cluster"
    echo "$previous"
done
