"""What a rank is communicating: the progress record the watchdog reads, and handles of non-blocking operations.

Every operation a `Group` starts is *entered* in the rank's `ProgressRecord` with a sequence number per channel:
a collective's channel is its group (every member enters the group's collectives in the same order, as MPI
requires, so the n-th collective of a group is the same operation on every member); a point-to-point channel is one
direction between two ranks (the sender's k-th send to B matches B's k-th receive from A). While the rank blocks on
an operation (a blocking call, or `Handle.wait`), the record also holds that operation and when the wait began.

The watchdog thread (watchdog.py) publishes the record in the rank's heartbeat and, when the wait is older than the
timeout, compares its sequence number with what each peer has entered: a peer below it has not arrived. This costs
a counter increment and two attribute writes per operation: no extra communication.

With a flight recorder (flight.py, `ProgressRecord.flight`), each operation is also kept in the rank's ring of its
last N operations when entered, and stamped when it completes (a blocking call returning, or its Handle completing).
"""

from __future__ import annotations

import time
from typing import NamedTuple

# Above this many members a group's ranks are printed as a range ("ranks 0..4095").
LISTED_RANKS = 8
_POLL_SLEEP_S = 0.001  # between Test calls when the main thread polls against a deadline


class Operation(NamedTuple):
    """One entered operation. members/peers are world ranks; peers: who must take part besides this rank."""

    name: str  # the Group method: all_reduce, iall_gather, send, irecv, barrier, ...
    group: str  # the group's kind (dp, tp, pp, world, ...)
    members: tuple
    channel: str
    seq: int
    nbytes: int
    peers: tuple

    def describe(self) -> str:
        """E.g. 'all_reduce of 4.2 MB on group dp (world ranks 0,1)', 'recv of 16 kB from rank 3 on group pp (...)'."""
        what = f"{self.name} of {format_bytes(self.nbytes)}"
        if self.name.endswith("send"):
            what += f" to rank {self.peers[0]}"
        elif self.name.endswith("recv"):
            what += f" from rank {self.peers[0]}"
        return f"{what} on group {self.group} (world ranks {format_ranks(self.members)})"

    def as_dict(self) -> dict:
        return {"name": self.name, "group": self.group, "channel": self.channel, "seq": self.seq,
                "nbytes": self.nbytes, "peers": list(self.peers), "describe": self.describe()}


def format_bytes(nbytes: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def format_ranks(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) <= LISTED_RANKS:
        return ",".join(str(r) for r in ranks)
    return f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"


class ProgressRecord:
    """One per rank, shared by all its groups (the Mesh hands it to each). Written by the thread that communicates,
    read by the watchdog thread: each field is replaced by one assignment, which Python makes atomic."""

    def __init__(self, world_rank: int):
        self.world_rank = world_rank
        self.step = 0  # set by the training loop (from 1); shown in heartbeats and hang reports
        self.entered: dict[str, int] = {}  # channel -> sequence number of the last operation entered
        self.waiting: tuple | None = None  # (Operation, time.monotonic() when the wait began) while blocked on it
        # Without MPI_THREAD_MULTIPLE no other thread may call MPI_Abort, so the watchdog sets these and the blocked
        # thread itself polls with Test and calls on_timeout(operation, waited_s) once the deadline passes.
        self.poll_timeout_s: float = 0.0
        self.on_timeout = None
        # mpitrain/profile/breakdown.py's Breakdown (given to the Mesh): charges each wait to its kind of operation
        self.listener = None
        self.flight = None  # flight.py's FlightRecorder (fault.flight_ops > 0): the last operations, kept

    def enter(self, name, group, members: tuple, channel, peers: tuple, nbytes: int) -> Operation:
        seq = self.entered.get(channel, 0) + 1
        self.entered[channel] = seq
        operation = Operation(name, group, members, channel, seq, nbytes, peers)
        if self.flight is not None:
            self.flight.started(operation, self.step)
        return operation

    def completed(self, operation: Operation) -> None:
        """`operation` has finished on this rank (for the flight recorder)."""
        if self.flight is not None:
            self.flight.completed(operation)

    def begin_wait(self, operation: Operation) -> None:
        self.waiting = (operation, time.monotonic())
        if self.listener is not None:
            self.listener.begin_wait(operation)

    def end_wait(self) -> None:
        self.waiting = None
        if self.listener is not None:
            self.listener.end_wait()

    def snapshot(self) -> dict:
        """A consistent copy for the heartbeat (dict() of a str->int dict runs without releasing the GIL)."""
        waiting = self.waiting
        record = {"step": self.step, "entered": dict(self.entered), "operation": None}
        if waiting is not None:
            operation, since = waiting
            record["operation"] = dict(operation.as_dict(), waiting_s=round(time.monotonic() - since, 3))
        return record

    def wait_for(self, operation: Operation, run) -> None:
        """Run a blocking MPI call `run()` with `operation` recorded as what this rank waits on."""
        self.begin_wait(operation)
        try:
            run()
        finally:
            self.end_wait()
        self.completed(operation)

    def poll(self, request, operation: Operation) -> None:
        """Wait for `request` by testing it, so that this thread can act when the deadline passes (no MULTIPLE)."""
        self.begin_wait(operation)
        try:
            deadline = time.monotonic() + self.poll_timeout_s
            while not request.Test():
                now = time.monotonic()
                if now > deadline and self.on_timeout is not None:
                    self.on_timeout(operation, now - self.waiting[1])  # reports and aborts the job
                    deadline = float("inf")
                time.sleep(_POLL_SLEEP_S)
        finally:
            self.end_wait()


class Handle:
    """An operation in flight: the one such type, whatever starts it (a group's non-blocking call, a tensor-parallel
    or gradient reduction, a queued operation of the NCCL stand-in's streams).

    Holds the request it waits on (MPI's protocol: `Test()`, `Wait()`; None: already complete), its buffers so they
    cannot be freed before it completes, and the entered operation so that a wait on it is watched. What to do once
    it completes is added with `then` (e.g. a cast back to the caller's dtype): `wait()` returns the last
    continuation's value (`result`). `timed` hands the seconds a blocking `wait()` took to a timer."""

    def __init__(self, request=None, buffers=(), operation: Operation | None = None,
                 record: ProgressRecord | None = None):
        self._request = request  # None: already complete (size-1 groups)
        self._buffers = buffers
        self._operation = operation
        self._record = record
        self._continuations: list = []
        self._on_wait = None
        self.result = None  # what wait() returns: the last continuation's value

    @classmethod
    def completed(cls, result=None) -> Handle:
        """Nothing in flight (a group of one, a blocking path); wait() returns `result`."""
        handle = cls()
        handle.result = result
        return handle

    @classmethod
    def after(cls, handle) -> Handle:
        """A handle that completes when `handle` does: any object with `wait()` (and `test()` where it is polled),
        so that continuations and a timer can be added without touching the group's own handle."""
        if handle is None or getattr(handle, "done", False):
            return cls()
        return cls(_Awaiting(handle))

    @property
    def done(self) -> bool:
        return self._request is None

    def then(self, continuation) -> Handle:
        """Run `continuation()` when the operation completes (at once if it has); its value is what wait() returns
        from then on. Returns the handle."""
        if self.done:
            self.result = continuation()
        else:
            self._continuations.append(continuation)
        return self

    def timed(self, on_wait) -> Handle:
        """on_wait(seconds) is told how long a blocking wait() took. Returns the handle."""
        self._on_wait = on_wait
        return self

    def test(self) -> bool:
        """Drive progress once; True when the operation has completed."""
        if self._request is not None and self._request.Test():
            self._complete()
        return self.done

    def wait(self):
        """Block until the operation completes; returns `result`."""
        if self._request is None:
            return self.result
        start, record = time.perf_counter(), self._record
        if record is None or self._operation is None:
            self._request.Wait()
        elif record.poll_timeout_s:
            record.poll(self._request, self._operation)
        else:
            record.wait_for(self._operation, self._request.Wait)
        if self._on_wait is not None:
            self._on_wait(time.perf_counter() - start)
        self._complete()
        return self.result

    def _complete(self) -> None:
        self._request = None
        self._buffers = ()
        if self._record is not None and self._operation is not None:
            self._record.completed(self._operation)
        continuations, self._continuations = self._continuations, []
        for continuation in continuations:
            self.result = continuation()


class _Awaiting:
    """Another handle seen as a request, for `Handle.after`."""

    def __init__(self, handle):
        self._handle = handle

    def Test(self) -> bool:
        return self._handle.test()

    def Wait(self) -> None:
        self._handle.wait()


def progress(handles) -> int:
    """Test each pending handle once so MPI advances them while we compute; returns how many are still pending.

    Called between layers so that gradient all-reduces issued earlier overlap the backward pass.
    """
    return sum(not handle.test() for handle in handles)
