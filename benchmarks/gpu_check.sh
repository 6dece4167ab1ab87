#!/usr/bin/env bash
# The GPU path's device check; its stages, limits and output are described in benchmarks/gpu_check.py. From the
# repository root, on a lent device machine (one call, with a 540 s limit; nothing comes from the network):
#     bash benchmarks/gpu_check.sh                                 the default plan, under 450 s (the fused
#                                                                  attention's parity and speed-up, MFU at 1.3b)
#     bash benchmarks/gpu_check.sh --stages bench --sizes 125m,350m   a second call: the smaller models, fused
#                                                                  attention on and off
#     bash benchmarks/gpu_check.sh --dry-run                        the plan and its limits, no GPU needed
# The log also goes to $OUT/gpu_check.log when $OUT is set. The last lines are the SUMMARY (one line per stage),
# then "GPU CHECK PASSED" (exit 0), "GPU CHECK FAILED: ..." (exit 1) or "GPU CHECK INCOMPLETE: ..." (exit 2).
#
# MPI: the machine's python3 may have mpi4py without an MPI library. Before the device call, fill .gpu_wheels/ here
#     pip download mpich --no-deps --python-version 3.12 --only-binary=:all: -d .gpu_wheels
# and carry it (run's carry: [".gpu_wheels"]; it is git-ignored). When it holds the wheel, MPICH is installed under
# a private prefix and used for both ends, the library mpi4py loads (MPI4PY_LIBMPI) and the mpiexec that starts the
# ranks, so they always match; if mpi4py ignores MPI4PY_LIBMPI, the machine's MPI is used instead.
# The fused attention needs cuDNN's Python frontend (and cuda-bindings, which it imports); if the machine lacks them,
# carry their wheels in the same folder (about 20 MB; the cuDNN library itself must be there, e.g. torch's):
#     pip download nvidia-cudnn-frontend==1.32.0 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 --no-deps \
#         --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 -d .gpu_wheels
# FP8's GEMMs go through nvmath-python's cuBLASLt binding (the features stage checks them); likewise, about 12 MB:
#     pip download nvmath-python==1.0.0 cuda-core==1.2.2 --no-deps --python-version 3.12 --only-binary=:all: \
#         --platform manylinux_2_28_x86_64 -d .gpu_wheels
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MPICH_PREFIX=${TMPDIR:-/tmp}/mpitrain-gpu-check/mpich
wheel=$(compgen -G ".gpu_wheels/mpich-*.whl" | head -n 1)
if [ -n "$wheel" ] && [ "${1:-}" != "--dry-run" ]; then
    # --prefix: no site-packages is touched (and PEP 668's refusal does not apply)
    if "$PYTHON" -m pip install -q --no-index --no-deps --ignore-installed --prefix "$MPICH_PREFIX" "$wheel"; then
        saved_path=$PATH
        export MPI4PY_LIBMPI="$MPICH_PREFIX/lib/libmpi.so.12" MPIEXEC="$MPICH_PREFIX/bin/mpiexec"
        export PATH="$MPICH_PREFIX/bin:$PATH"
        if ! "$PYTHON" -c 'import sys; from mpi4py import MPI; sys.exit("MPICH" not in MPI.Get_library_version())'
        then
            echo "gpu_check: mpi4py does not load the carried MPICH; using the machine's MPI" >&2
            unset MPI4PY_LIBMPI MPIEXEC
            PATH=$saved_path
        fi
    else
        echo "gpu_check: installing $wheel failed; using the machine's MPI" >&2
    fi
fi
# cuDNN's Python frontend (the fused attention) and the CUDA bindings it imports, from carried wheels, each only
# where the machine's Python lacks it: unpacked under a private directory put in front of PYTHONPATH
PY_TARGET=${TMPDIR:-/tmp}/mpitrain-gpu-check/python
carried=()
if [ "${1:-}" != "--dry-run" ]; then
    "$PYTHON" -c 'import cudnn' 2>/dev/null || carried+=($(compgen -G ".gpu_wheels/nvidia_cudnn_frontend-*.whl"))
    "$PYTHON" -c 'import cuda.bindings.driver' 2>/dev/null || carried+=($(compgen -G ".gpu_wheels/cuda_bindings-*.whl") \
        $(compgen -G ".gpu_wheels/cuda_pathfinder-*.whl"))
    "$PYTHON" -c 'import nvmath.bindings.cublasLt' 2>/dev/null || carried+=($(compgen -G ".gpu_wheels/nvmath_python-*.whl") \
        $(compgen -G ".gpu_wheels/cuda_core-*.whl"))
fi
if [ ${#carried[@]} -gt 0 ]; then
    if "$PYTHON" -m pip install -q --no-index --no-deps --upgrade --target "$PY_TARGET" "${carried[@]}"; then
        export PYTHONPATH="$PY_TARGET${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "gpu_check: installing ${carried[*]} failed; the attention stage will say what is missing" >&2
    fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
# gpu_check.py keeps to its 450 s budget; the margin lets its summary print before this limit ends it
if [ -n "${OUT:-}" ]; then
    timeout 480 "$PYTHON" benchmarks/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi
exec timeout 480 "$PYTHON" benchmarks/gpu_check.py "$@"
