#!/usr/bin/env bash
# Train on this machine with N ranks through mpiexec (the `mpich` wheel's or the system's).
#   launch/local.sh 4 configs/tiny.toml --set train.steps=50
# Same as `mpitrain launch -n N CONFIG ...`: sets BLAS threads per rank and MPICH's yield settings when ranks
# outnumber cores, so that oversubscribed ranks do not spin on each other's cores.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 N CONFIG [train options]" >&2; exit 2; fi
n=$1; shift
exec mpitrain launch -n "$n" "$@"
