"""The faults that end or freeze a process (MPITRAIN_FAULT=kill|hang:rank=R:step=N, parsed by faults.py), struck at
the start of step N.

`kill` sends SIGKILL, as a crashed machine would. `hang` sends SIGSTOP, as `kill -STOP PID` would: the whole process
freezes, its watchdog thread and heartbeat included, so its peers block in their next collective until their
watchdogs end the job (mpitrain/comm/watchdog.py). One line first names the rank, host and step, so that a test or a
demo can tell the injected fault from a real one. (nan, gradflip, slow and flip change the computation inside the step.)

`enospc`, `edquot`, `erofs` and `eio` (MPITRAIN_FAULT=enospc:rank=R:step=N) make the rank's write of the checkpoint
of step N fail halfway with that OSError (checkpoint/store.py writes through a file that raises it), as a full disk,
an exceeded quota, a read-only or a failing filesystem would.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys
from pathlib import Path

from mpitrain.resilience.faults import STORAGE_KINDS


def strike_kill(faults, rank: int, step: int) -> None:
    """Kill this process if the fault plan says `kill` for `step` (from 1). Free when the plan is empty."""
    _strike(faults, "kill", signal.SIGKILL, "kills itself", rank, step)


def strike_hang(faults, rank: int, step: int) -> None:
    """Stop this process if the fault plan says `hang` for `step` (from 1). Free when the plan is empty."""
    _strike(faults, "hang", signal.SIGSTOP, "stops itself", rank, step)


def _strike(faults, kind: str, sig: signal.Signals, action: str, rank: int, step: int) -> None:
    if not faults or faults.due(kind, step) is None:
        return
    sys.stdout.flush()  # what the step printed so far comes before the fault's line, and survives the signal
    sys.stderr.write(f"fault injection: rank {rank} {action} ({sig.name}) at the start of step {step} "
                     f"(MPITRAIN_FAULT; pid {os.getpid()} on {socket.gethostname()})\n")
    sys.stderr.flush()
    os.kill(os.getpid(), sig)


def storage_fault(faults, step: int, path: Path) -> OSError | None:
    """The error an injected storage fault makes this rank's write of `path`, the checkpoint of `step`, raise; None
    when none strikes (free when the plan is empty)."""
    for kind in STORAGE_KINDS if faults else ():
        if faults.due(kind, step) is not None:
            code = getattr(errno, kind.upper())
            return OSError(code, os.strerror(code), str(path))
    return None
