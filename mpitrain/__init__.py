"""mpitrain: train transformer language models across many MPI ranks, one readable piece at a time."""
import os
import sys

# Idle OpenBLAS threads sleep after 2^4 cycles instead of spinning for 2^28 (~0.1 s) on the cores that mpitrain's
# elementwise tile threads need (mpitrain/tiles.py). A value the user set wins. OpenBLAS reads the variable when numpy
# loads it, so if numpy came first, OpenBLAS re-reads it and restarts its threads; the value in force is recorded for
# tiles.thread_count(), which keeps its pool off where the spin stayed long (None: OpenBLAS's default).
if "numpy" not in sys.modules:
    OPENBLAS_THREAD_TIMEOUT_AT_LOAD = os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
elif "OPENBLAS_THREAD_TIMEOUT" in os.environ:
    OPENBLAS_THREAD_TIMEOUT_AT_LOAD = os.environ["OPENBLAS_THREAD_TIMEOUT"]
else:
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = "4"
    from mpitrain import tiles
    OPENBLAS_THREAD_TIMEOUT_AT_LOAD = "4" if tiles.restart_openblas_threads() else None

__version__ = "0.1.0"
