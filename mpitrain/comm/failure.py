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


# ----------------------------------------------------------------------------- user errors: said once, no MPI Abort
USER_ERROR_GRACE_SECONDS = 10.0  # how long a rank with a user error waits for every other rank to report one too


def one_line(messages: list[str | None]) -> str:
    """The ranks' error messages as one line: the message when every rank has the same, else each distinct
    message after the ranks that raised it ("rank 1: ...; ranks 0, 2: ...")."""
    by_text: dict[str, list[int]] = {}
    for rank, text in enumerate(messages):
        if text is not None:
            by_text.setdefault(text, []).append(rank)
    if len(by_text) == 1 and len(next(iter(by_text.values()))) == len(messages):
        return next(iter(by_text))
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
                     for text, ranks in by_text.items())


def agree_on_user_errors(comm, check):
    """Collective, before any other: run check() on every rank and return its result, or, when it raised a user
    error (MpitrainError) on any rank, raise one on every rank, naming the ranks when they differ. Checks that only
    some ranks can fail (a file on one node's disk) so end every rank together instead of leaving the others in the
    next collective."""
    try:
        result, problem = check(), None
    except MpitrainError as exc:
        result, problem = None, exc
    messages = comm.allgather(None if problem is None else str(problem))
    if not any(message is not None for message in messages):
        return result
    line = one_line(messages)
    if problem is not None and str(problem) == line:
        raise problem
    raise MpitrainError(line)


@contextmanager
def end_job_on_error(comm, on_refused=None, grace_s: float = USER_ERROR_GRACE_SECONDS):
    """Like abort_on_error, but a user error (MpitrainError) that every rank raises ends the job cleanly: rank 0
    prints it once ("ERROR: ..."), rank 0 calls on_refused() (e.g. to remove what a refused start created) and every
    rank exits with status 1 through MPI's finalize, so mpiexec adds no abort report. Whether every rank failed is
    asked on a duplicate of `comm` with a non-blocking barrier: a rank that waits in a collective of `comm` never
    reaches it, and after grace_s the failing ranks end the job as abort_on_error does."""
    errors_comm = comm.Dup()  # collective: every rank enters together; its barrier never meets the run's collectives
    try:
        yield
    except MpitrainError as exc:
        if not _every_rank_arrives(errors_comm, grace_s):
            report_and_abort(exc, comm)
        line = one_line(errors_comm.allgather(str(exc)))
        if errors_comm.Get_rank() == 0:
            sys.stdout.flush()
            sys.stderr.write(f"ERROR: {line}\n")
            sys.stderr.flush()
            if on_refused is not None:
                on_refused()
        raise SystemExit(1) from None
    except SystemExit as exc:
        if exc.code in (None, 0):
            raise
        report_and_abort(exc, comm)
    except BaseException as exc:  # noqa: BLE001 -- as abort_on_error: the other ranks would hang all the same
        report_and_abort(exc, comm)


def _every_rank_arrives(comm, grace_s: float) -> bool:
    request = comm.Ibarrier()
    deadline = time.monotonic() + grace_s
    while not request.Test():
        if time.monotonic() > deadline:
            return False  # the request stays posted: the job is aborted next
        time.sleep(0.005)
    return True
