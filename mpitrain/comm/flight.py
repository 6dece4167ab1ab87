"""The collective flight recorder: each rank's last N group operations, written out when something goes wrong.

Every operation a group enters (operations.py's `ProgressRecord.enter`) appends one entry to a fixed-size ring
(`collections.deque(maxlen=N)`); its completion stamps the entry's end time. An entry is a small list, filled from
what the operation already carries (no copy of its members tuple):

    [name, group, channel, seq, nbytes, step, start, end]     end None: started, never completed

`seq` is the group's count of this operation (the channel's sequence number: every member of a group gives the same
number to the same collective), so the files of all ranks line up without any clock. Times are wall clock
(time.time()) for reading, never for ordering.

What is written (`FlightRecorder.write`, RUN_DIR/flight/rank_NNNNN.json, atomically), when the watchdog fires on a
hang, when a rank fails (train.py's failure path) or on SIGUSR2 / SIGTERM (`flight_signals`):

    {"rank": 1, "host": "node07", "pid": 4242, "time": 1764570000.5, "reason": "hang", "step": 7,
     "phase": "backward_input", "waiting": {...} | null, "entered": {"dp@0": 40, ...},
     "channels": {"dp@0": {"group": "dp", "members": [0, 1]}},
     "ops": [{"name": "iall_reduce", "group": "dp", "channel": "dp@0", "seq": 40, "nbytes": 4096, "step": 7,
              "start": 1764569990.1, "end": null, "state": "started"}, ...]}

`mpitrain doctor hang RUN_DIR` reads them (mpitrain/doctor/hang.py).
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

from mpitrain.profile.jsonl import write_json_atomically

FLIGHT_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
EARLIER = "earlier"  # RUN_DIR/flight/earlier/: the records of the run's previous start, which doctor hang ignores
_NAME, _GROUP, _CHANNEL, _SEQ, _NBYTES, _STEP, _START, _END = range(8)


class FlightRecorder:
    """The ring of one rank. directory: where `write` puts rank_NNNNN.json; phase(): what the rank is doing now
    (a step-breakdown part such as "forward" or "optimizer"), or None."""

    def __init__(self, capacity: int, directory: Path, world_rank: int, phase=None):
        self.ops: deque = deque(maxlen=capacity)
        self._open: dict = {}  # (channel, seq) -> entry, until it completes (or leaves the ring)
        self._members: dict = {}  # channel -> (group name, members tuple), for the file's "channels"
        self.directory = Path(directory)
        self.world_rank = world_rank
        self.phase = phase
        self._writing = threading.Lock()
        self._set_aside_earlier()

    def _set_aside_earlier(self) -> None:
        """Move this rank's record of an earlier start of the run (a hang before a restart, a stop request) to
        flight/earlier/: left in place, `mpitrain doctor hang` would read it as this start's, and a rank that hangs
        now without writing would look as if it had. Kept, not deleted: the evidence of the earlier failure."""
        if not self.path.is_file():
            return
        try:
            (self.directory / EARLIER).mkdir(exist_ok=True)
            os.replace(self.path, self.directory / EARLIER / self.path.name)
        except OSError:
            self.path.unlink(missing_ok=True)  # where it cannot be kept, it must still not be read as this start's

    @property
    def path(self) -> Path:
        return self.directory / f"rank_{self.world_rank:05d}.json"

    def started(self, operation, step: int) -> None:
        name, group, members, channel, seq, nbytes, _ = operation
        entry = [name, group, channel, seq, nbytes, step, time.time(), None]
        self.ops.append(entry)
        self._open[(channel, seq)] = entry
        if len(self._open) > 2 * self.ops.maxlen:  # operations never completed and gone from the ring: forget them
            self._open = {(e[_CHANNEL], e[_SEQ]): e for e in self.ops if e[_END] is None}
        if channel not in self._members:
            self._members[channel] = (group, members)

    def completed(self, operation) -> None:
        entry = self._open.pop((operation.channel, operation.seq), None)
        if entry is not None:
            entry[_END] = time.time()

    def snapshot(self, reason: str, progress) -> dict:
        """Everything the file holds; safe from another thread (copying a deque runs without releasing the GIL)."""
        entries = [list(entry) for entry in self.ops.copy()]
        waiting = progress.waiting
        phase = None
        if self.phase is not None:
            try:
                phase = self.phase()
            except Exception:  # noqa: BLE001 -- a dump must never fail for want of a label
                phase = None
        return {"rank": self.world_rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                "reason": reason, "step": progress.step, "phase": phase,
                "waiting": None if waiting is None else waiting[0].as_dict(),
                "entered": dict(progress.entered),
                "channels": {channel: {"group": group, "members": list(members)}
                             for channel, (group, members) in dict(self._members).items()},
                "ops": [_entry_dict(entry) for entry in entries]}

    def write(self, reason: str, progress) -> Path | None:
        """Write the file (a temporary file, then a rename); returns its path, or None when it could not be
        written (said once on stderr: a full disk must not hide the failure that is being reported)."""
        try:
            with self._writing:
                record = self.snapshot(reason, progress)
                self.directory.mkdir(parents=True, exist_ok=True)
                write_json_atomically(self.path, record)
            return self.path
        except (OSError, RuntimeError, ValueError) as exc:
            sys.stderr.write(f"[rank {self.world_rank}] warning: flight record not written to {self.path}: {exc}\n")
            return None


def _entry_dict(entry: list) -> dict:
    return {"name": entry[_NAME], "group": entry[_GROUP], "channel": entry[_CHANNEL], "seq": entry[_SEQ],
            "nbytes": entry[_NBYTES], "step": entry[_STEP], "start": entry[_START], "end": entry[_END],
            "state": "started" if entry[_END] is None else "completed"}


@contextmanager
def flight_signals(progress):
    """While inside: SIGUSR2 and SIGTERM write the flight record of `progress` (which has one), then run whatever
    handler was there before (SIGTERM: the stop request of run/resilience.py when installed after it). Python runs
    handlers in the main thread between bytecodes, so a rank blocked inside an MPI call writes on its watchdog's
    timeout instead. Outside the main thread (tests, a library caller) nothing is installed."""
    flight = progress.flight
    if flight is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def handle(signum, frame):
        flight.write(signal.Signals(signum).name, progress)
        before = previous.get(signum)
        if callable(before):
            before(signum, frame)
        elif before == signal.SIG_DFL and signum == signal.SIGTERM:
            signal.signal(signum, signal.SIG_DFL)  # SIGTERM's default: end the process, by the signal itself
            os.kill(os.getpid(), signum)

    for sig in FLIGHT_SIGNALS:
        previous[sig] = signal.signal(sig, handle)
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
