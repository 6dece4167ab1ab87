"""The faults that end or freeze a process (MPITRAIN_FAULT=kill|hang:rank=R:step=N, parsed by faults.py), struck at
the start of step N.

`kill` sends SIGKILL, as a crashed machine would. `hang` sends SIGSTOP, as `kill -STOP PID` would: the whole process
freezes, its watchdog thread and heartbeat included, so its peers block in their next collective until their
watchdogs end the job (mpitrain/comm/watchdog.py). One line first names the rank, host and step, so that a test or a
demo can tell the injected fault from a real one. (nan, slow and flip change the computation inside the step.)
"""

from __future__ import annotations

import os
import signal
import socket
import sys


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
