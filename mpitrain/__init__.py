"""mpitrain: train transformer language models across many MPI ranks, one readable piece at a time."""
import os
import sys

# Before numpy loads OpenBLAS (it reads this once, at load): idle OpenBLAS threads sleep after 2^4 cycles instead of
# spinning for 2^28 (~0.1 s) on the cores that mpitrain's elementwise tile threads need (mpitrain/tiles.py). A value
# the user set wins. If numpy came first, OpenBLAS has already read whatever was set then (None: nothing, the long
# default spin); tiles.thread_count() reads this to keep its pool off where the spin would cost more than it gains.
OPENBLAS_THREAD_TIMEOUT_AT_LOAD = (os.environ.get("OPENBLAS_THREAD_TIMEOUT") if "numpy" in sys.modules
                                   else os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4"))
if "numpy" in sys.modules:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # for child processes, which load their own OpenBLAS

__version__ = "0.1.0"
