"""The `hang` fault (MPITRAIN_FAULT=hang:rank=R:step=N, parsed by faults.py): the rank stops at the start of step N.

It sends itself SIGSTOP, as `kill -STOP PID` would: the whole process freezes, its watchdog thread and heartbeat
included, so its peers block in their next collective until their watchdogs end the job (mpitrain/comm/watchdog.py).
One line first names the rank, host and step, so that a test or a demo can tell the injected fault from a real one.
(`kill` is resilience/restart.py's strike_kill; nan, slow and flip change the computation inside the step.)
"""

from __future__ import annotations

import os
import signal
import socket
import sys


def strike_hang(faults, rank: int, step: int) -> None:
    """Stop this process if the fault plan says `hang` for `step` (from 1). Free when the plan is empty."""
    if not faults or faults.due("hang", step) is None:
        return
    sys.stdout.flush()
    sys.stderr.write(f"fault injection: rank {rank} stops itself (SIGSTOP, pid {os.getpid()} on "
                     f"{socket.gethostname()}) at the start of step {step} (MPITRAIN_FAULT)\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSTOP)
