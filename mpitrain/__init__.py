"""mpitrain: train transformer language models across many MPI ranks, one readable piece at a time."""
import os

# Before numpy loads OpenBLAS (it reads this once, at load): idle OpenBLAS threads sleep after 2^4 cycles instead of
# spinning for 2^28 (~0.1 s) on the cores that mpitrain's elementwise tile threads need (mpitrain/tiles.py). A value
# the user set wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"
