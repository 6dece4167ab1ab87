#!/usr/bin/env bash
# The GPU path's device check: one script, under 8 minutes on one H200. From the repository root:
#     bash benchmarks/gpu_check.sh            (the log also goes to $OUT/gpu_check.log when $OUT is set)
# It installs nothing from the network: the machine's python3 must have CuPy (cupy-cuda12x/13x), NCCL, mpi4py,
# h5py, click and ml-dtypes. Without an MPI library or mpiexec there, carry the mpich wheel in .gpu_wheels/
# (pip download mpich --no-deps -d .gpu_wheels) and it is installed from there. Stages and output: gpu_check.py.
# On a lent device machine, one call: `bash benchmarks/gpu_check.sh` with a 540 s limit. Its last lines are the
# SUMMARY (every number, one line per stage), "GPU CHECK PASSED" or "GPU CHECK FAILED: <stages>", and the exit status
# is 1 on any failure, a skipped GPU test, parity above 1e-10 or the 1.3B MFU under 35%.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! command -v mpiexec >/dev/null 2>&1 && compgen -G ".gpu_wheels/mpich*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps .gpu_wheels/mpich*.whl
    PATH="$("$PYTHON" -c 'import sys, os; print(os.path.dirname(sys.executable))'):$PATH"
fi
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-kernel-cache}
export MPIR_CVAR_POLLS_BEFORE_YIELD=1 MPIR_CVAR_CH4_PROGRESS_THROTTLE=true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
if [ -n "${OUT:-}" ]; then
    timeout 470 "$PYTHON" benchmarks/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi
exec timeout 470 "$PYTHON" benchmarks/gpu_check.py "$@"
