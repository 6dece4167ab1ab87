"""No silent hangs (docs/architecture.md, Failure handling): an exception on any rank ends the whole job.

If one rank raises while the others wait in a collective, they would wait forever. `abort_on_error` prints which
rank failed and why, then calls `comm.Abort`, which makes mpiexec kill every rank.

    with abort_on_error(MPI.COMM_WORLD):
        train(config)
"""

from __future__ import annotations

import sys
import time
import traceback
from contextlib import contextmanager

from mpitrain.errors import MpitrainError

ABORT_GRACE_SECONDS = 1.0


def format_failure(exc: BaseException, rank: int, size: int) -> str:
    """One line for errors the user can fix (MpitrainError); the full traceback otherwise, every line prefixed."""
    prefix = f"[rank {rank}/{size}]"
    if isinstance(exc, MpitrainError):
        return f"{prefix} ERROR: {exc}"
    lines = [f"{prefix} ERROR: {type(exc).__name__}: {exc}"]
    for chunk in traceback.format_exception(exc):
        lines.extend(f"{prefix} {line}" for line in chunk.rstrip("\n").split("\n"))
    return "\n".join(lines)


def report_and_abort(exc: BaseException, comm, code: int = 1):
    """Print the failure to stderr, then abort every rank (size > 1) or exit with `code` (a single process)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    sys.stderr.write(format_failure(exc, rank, size) + "\n")  # one write, so lines of ranks do not interleave
    sys.stderr.flush()
    sys.stdout.flush()
    if size > 1:
        # Let the other ranks print too (a bad config or checkpoint fails on every rank at once; the first Abort
        # would otherwise kill them mid-message) and let mpiexec forward the output, then end the job.
        time.sleep(ABORT_GRACE_SECONDS)
        abort_job(comm, code)
    raise SystemExit(code)


def abort_device_communicators() -> int:
    """ncclCommAbort on this rank's NCCL groups, so that kernels stuck in a collective stop before MPI Abort (a rank
    blocked on its stream could otherwise outlive the abort). Nothing to do where no NCCL group exists (the module is
    looked up, not imported: CPU runs never load it)."""
    nccl_group = sys.modules.get("mpitrain.comm.nccl_group")
    return nccl_group.abort_all_communicators() if nccl_group is not None else 0


def abort_job(comm, code: int) -> None:
    """End every rank: this rank's NCCL communicators first, then MPI Abort on `comm` (the failure path above and
    the watchdog both end a job this way)."""
    abort_device_communicators()
    comm.Abort(code)


@contextmanager
def abort_on_error(comm=None, code: int = 1):
    """Run the body; on any exception (or a non-zero sys.exit) report it and end the job. comm: world by default."""
    try:
        yield
    except SystemExit as exc:
        if exc.code in (None, 0):
            raise
        report_and_abort(exc, comm or _comm_world(), code)
    except BaseException as exc:  # noqa: BLE001 -- KeyboardInterrupt too: the other ranks would hang all the same
        report_and_abort(exc, comm or _comm_world(), code)


def run_or_abort(fn, comm=None, code: int = 1):
    """Call fn() under abort_on_error and return its result."""
    with abort_on_error(comm, code):
        return fn()


def _comm_world():
    from mpi4py import MPI

    return MPI.COMM_WORLD
