"""`python -m mpitrain.lab.worker NAME quick|full` on every rank: runs the lab's job, rank 0 prints its result."""
from __future__ import annotations

import json
import sys

from mpi4py import MPI

from mpitrain.lab import LABS
from mpitrain.lab.runner import RESULT_PREFIX


def main(name: str, mode: str) -> None:
    result = LABS[name].job(MPI.COMM_WORLD, mode == "quick")
    if MPI.COMM_WORLD.rank == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
