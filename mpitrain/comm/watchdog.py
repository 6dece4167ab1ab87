"""No silent hangs (docs/architecture.md, Failure handling): a watchdog thread per rank aborts the job when an
operation does not finish.

Every second or so the thread publishes the rank's progress record (operations.py) as its heartbeat. When the
operation this rank waits on is older than `fault.timeout_s`, it reads its peers' heartbeats twice, a few beats
apart: a peer whose entered sequence number on the operation's channel is below ours had not arrived; a peer whose
heartbeat did not move is stopped (`kill -STOP`, a dead node). It prints ONE line naming the operation, the group,
the step and those ranks with their hosts, records the suspects for RUN_DIR/faults.jsonl, and calls MPI Abort on
the world, which ends every rank (exit status HANG_EXIT_CODE). When several ranks wait on the same operation, the
lowest-ranked live one reports and the others leave it the word (they abort on their own a little later if it
does not). An operation that completes while being diagnosed was slow, not hung: the watchdog goes back to sleep.
Before diagnosing, a rank with a flight recorder (flight.py) writes it, for `mpitrain doctor hang`.

RUN_DIR/faults.jsonl (resilience/faulty_hosts.py appends; slurm/train.sbatch reads it to exclude a node on restart)
gets one object per suspected rank, none when no rank is suspected (fault.heartbeat = false, or every peer is alive
and has arrived: there is no host to exclude):

    {"host": "node07", "kind": "hang", "time": 1764570000.5, "rank": 1, "operation": "all_reduce",
     "group": "world", "step": 7, "reported_by": 0, "detail": "<the printed line>"}

    rank, host   the suspected rank (its heartbeat stopped, else it had not arrived) and its host, from its heartbeat
    operation    the Group method (all_reduce, iall_gather, recv, barrier, ...); group: its kind (dp, tp, pp, world)
    step         the training step (from 1; 0 during start-up) the reporting rank was in

MPI is initialised with MPI_THREAD_MULTIPLE by mpi4py, so the thread may call Abort while the main thread blocks
inside MPI (mpi4py releases the GIL there). Where MPI offers less, the blocked thread polls its request against the
deadline itself (`ProgressRecord.poll`: blocking calls run as their non-blocking forms; gather_object and
broadcast_object, which have none, stay unwatched) and the thread only publishes heartbeats.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import NamedTuple

from mpitrain.comm.failure import ABORT_GRACE_SECONDS, abort_job
from mpitrain.comm.operations import Operation, ProgressRecord, format_ranks

HANG_EXIT_CODE = 124  # as timeout(1): the job was ended because something did not finish in time
LISTED_PEERS = 8  # peers named in the line; the rest are counted
DIAGNOSE_BEATS = 3  # beats between the two reads of the peers' heartbeats
DEFER_MARGIN_S = 5.0  # how much longer than its report should take a rank waits for a lower rank to abort the job


class PeerState(NamedTuple):
    rank: int
    host: str | None
    heartbeat: bool  # a heartbeat file of this rank was found
    arrived: bool  # it has entered the operation (its sequence number on the channel reached ours)
    stopped: bool  # its heartbeat is missing or did not change between the two reads
    step: int | None
    waiting_on: str | None  # what it is blocked on, from its heartbeat
    age_s: float | None = None  # how old its last heartbeat is (by this rank's clock)

    def describe(self) -> str:
        where = f"rank {self.rank}" + (f" on {self.host}" if self.host else "")
        if not self.heartbeat:
            return f"{where} (no heartbeat file)"
        doing = f"in {self.waiting_on}" if self.waiting_on else "computing"
        if self.stopped:
            return f"{where} (stopped: last heartbeat {self.age_s:.0f} s ago, at step {self.step}, {doing})"
        return f"{where} (alive, at step {self.step}, {doing})"


def peer_states(operation: Operation, first: dict, second: dict, now: float | None = None) -> list[PeerState]:
    """Each peer of `operation` from two reads of its heartbeat ({world rank: record or None}), a few beats apart;
    now: the time of the second read (time.time())."""
    now = time.time() if now is None else now
    states = []
    for rank in operation.peers:
        before, after = first.get(rank), second.get(rank)
        if after is None:
            states.append(PeerState(rank, None, False, False, True, None, None))
            continue
        stopped = before is not None and before.get("beat") == after.get("beat")
        arrived = after.get("entered", {}).get(operation.channel, 0) >= operation.seq
        waiting_on = (after.get("operation") or {}).get("describe")
        age = max(0.0, now - float(after.get("time", now)))
        states.append(PeerState(rank, after.get("host"), True, arrived, stopped, after.get("step"), waiting_on, age))
    return states


def suspects(states: list[PeerState]) -> list[PeerState]:
    """Who most likely caused the hang: stopped peers, else those that had not arrived."""
    return [s for s in states if s.stopped] or [s for s in states if not s.arrived]


def hang_message(operation: Operation, waited_s: float, timeout_s: float, step: int, rank: int, world_size: int,
                 host: str, states: list[PeerState] | None) -> str:
    """The one line printed when the watchdog ends the job."""
    when = f"at step {step}" if step else "during start-up"
    head = (f"[rank {rank}/{world_size}] HANG {when}: {operation.describe()} did not complete within "
            f"{timeout_s:g} s (fault.timeout_s; waited {waited_s:.1f} s on {host})")
    if states is None:
        tail = (f"ranks that had not arrived: unknown without heartbeats (fault.heartbeat = false); "
                f"peers: world ranks {format_ranks(operation.peers)}")
    elif not operation.peers:
        tail = "no other rank takes part"
    else:
        missing = [s for s in states if not s.arrived]
        stopped_inside = [s for s in states if s.arrived and s.stopped]
        parts = []
        if missing:
            parts.append("not arrived: " + _listed(missing))
        if stopped_inside:
            parts.append("stopped inside the operation: " + _listed(stopped_inside))
        tail = "; ".join(parts) or "every peer has arrived and is alive (MPI or the network is stuck)"
    return f"{head}; {tail}; aborting the job"


def _listed(states: list[PeerState]) -> str:
    text = ", ".join(s.describe() for s in states[:LISTED_PEERS])
    more = len(states) - LISTED_PEERS
    return text + (f" and {more} more" if more > 0 else "")


def fault_records(operation: Operation, step: int, rank: int, message: str,
                  states: list[PeerState] | None) -> list[dict]:
    """The faults.jsonl objects for one hang: one per suspected rank whose host is known."""
    return [{"kind": "hang", "host": s.host, "rank": s.rank, "operation": operation.name, "group": operation.group,
             "step": step, "reported_by": rank, "detail": message} for s in suspects(states or []) if s.host]


def reporting_peer(operation: Operation, states: list[PeerState] | None, second: dict, rank: int) -> int | None:
    """A live peer of lower rank blocked on the same operation: it reports, so that the job prints one line."""
    for state in states or ():
        record = (second.get(state.rank) or {}).get("operation") or {}
        same = record.get("channel") == operation.channel and record.get("seq") == operation.seq
        if state.rank < rank and not state.stopped and same:
            return state.rank
    return None


class Watchdog:
    """Publishes this rank's heartbeat and ends the job when an operation hangs.

    heartbeats: an object with write(record) and read(world_rank) -> record | None (resilience/heartbeat.py), or
    None (fault.heartbeat = false: no files, and a hang report cannot say who had not arrived).
    timeout_s: 0 disables hang detection (heartbeats only). abort(code): ends the job (MPI Abort on the world).
    record_fault(**record): stores a suspect (resilience/faulty_hosts.py's record_fault on RUN_DIR), or None.
    host: this machine's name as the scheduler knows it (default: the hostname).
    poll_in_main_thread: MPI without MPI_THREAD_MULTIPLE; the blocked thread checks the deadline itself.
    """

    def __init__(self, progress: ProgressRecord, timeout_s: float, abort, world_size: int, heartbeats=None,
                 record_fault=None, host: str | None = None, poll_in_main_thread: bool = False,
                 interval_s: float | None = None):
        self.progress = progress
        self.timeout_s = float(timeout_s)
        self.abort = abort
        self.world_size = world_size
        self.heartbeats = heartbeats
        self.record_fault = record_fault
        self.rank = progress.world_rank
        self.host = host or socket.gethostname()
        self.interval_s = interval_s or (min(1.0, max(self.timeout_s / 5, 0.05)) if self.timeout_s else 1.0)
        self._beat = 0
        self._publishing = threading.Lock()  # the thread beats; a main thread polling a deadline may beat too
        self._stop = threading.Event()
        self._thread = None
        self._warned = False
        if poll_in_main_thread and self.timeout_s:
            progress.poll_timeout_s, progress.on_timeout = self.timeout_s, self.fire

    @property
    def needed(self) -> bool:
        return bool(self.timeout_s or self.heartbeats)

    def start(self) -> Watchdog:
        if self.needed and self._thread is None:
            self.publish("running")  # before the first collective, so peers find this rank from the start
            self._thread = threading.Thread(target=self._run, name=f"mpitrain-watchdog-{self.rank}", daemon=True)
            self._thread.start()
        return self

    def stop(self, state: str = "finished") -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.publish(state)
        self.progress.poll_timeout_s, self.progress.on_timeout = 0.0, None

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, *exc):
        self.stop("finished" if exc_type is None else "failed")

    # ---- the thread ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 -- a full disk must not end the watchdog, nor the run
                self._warn_once(f"watchdog: {type(exc).__name__}: {exc}")

    def tick(self) -> None:
        """One beat: publish the heartbeat; fire when the operation waited on is older than the timeout."""
        self.publish("running")
        waiting = self.progress.waiting
        if waiting is None or not self.timeout_s or self.progress.poll_timeout_s:
            return
        operation, since = waiting
        waited = time.monotonic() - since
        if waited >= self.timeout_s:
            self.fire(operation, waited)

    def publish(self, state: str) -> None:
        if self.heartbeats is None:
            return
        with self._publishing:
            self._beat += 1
            record = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "time": time.time(),
                      "beat": self._beat, "state": state}
            record.update(self.progress.snapshot())
            self.heartbeats.write(record)

    # ---- a hang --------------------------------------------------------------------------------------------------
    def fire(self, operation: Operation, waited_s: float) -> None:
        """Diagnose, report (unless a lower live rank waiting on the same operation will) and abort the job.
        Returns only when the operation completed meanwhile (slow, not hung)."""
        if self.progress.flight is not None:  # first: every rank that fires leaves its record before the abort
            self.progress.flight.write("hang", self.progress)
        states, second = self.inspect_peers(operation)
        if not self._still_waiting(operation):
            return
        leader = reporting_peer(operation, states, second, self.rank)
        if leader is not None:
            # Leave the word to it (it fires once it has waited timeout_s too); if this rank is still alive well
            # after its report and abort should have come, report itself.
            lag = max(0.0, self.timeout_s - float(second[leader]["operation"].get("waiting_s", 0.0)))
            self._sleep_beating(lag + (DIAGNOSE_BEATS + 2) * self.interval_s + ABORT_GRACE_SECONDS + DEFER_MARGIN_S)
            if not self._still_waiting(operation):
                return
        waited_s = time.monotonic() - self.progress.waiting[1]
        message = hang_message(operation, waited_s, self.timeout_s, self.progress.step, self.rank, self.world_size,
                               self.host, states)
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        self._record_faults(fault_records(operation, self.progress.step, self.rank, message, states))
        self.publish("hang")
        time.sleep(ABORT_GRACE_SECONDS)  # let mpiexec forward the line before every rank is killed
        self.abort(HANG_EXIT_CODE)

    def inspect_peers(self, operation: Operation) -> tuple[list[PeerState] | None, dict]:
        """Read the peers' heartbeats twice, DIAGNOSE_BEATS beats apart (beating meanwhile, so that peers
        diagnosing at the same time do not take this rank for stopped). None without heartbeats."""
        if self.heartbeats is None or not operation.peers:
            return (None if self.heartbeats is None else []), {}
        first = {rank: self.heartbeats.read(rank) for rank in operation.peers}
        self._sleep_beating(DIAGNOSE_BEATS * self.interval_s)
        second = {rank: self.heartbeats.read(rank) for rank in operation.peers}
        return peer_states(operation, first, second), second

    def _still_waiting(self, operation: Operation) -> bool:
        waiting = self.progress.waiting
        return waiting is not None and waiting[0] is operation

    def _sleep_beating(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, self.interval_s))
            self.publish("running")

    def _record_faults(self, records: list[dict]) -> None:
        for record in records if self.record_fault is not None else ():
            try:
                self.record_fault(**record)
            except OSError as exc:
                self._warn_once(f"watchdog: cannot record the fault: {exc}")

    def _warn_once(self, text: str) -> None:
        if not self._warned:
            self._warned = True
            sys.stderr.write(f"[rank {self.rank}/{self.world_size}] warning: {text}\n")
            sys.stderr.flush()


def start_watchdog(world_comm, progress: ProgressRecord, timeout_s: float, heartbeats=None, record_fault=None,
                   host: str | None = None) -> Watchdog:
    """The watchdog of this rank, started; it ends the job through failure.abort_job on `world_comm` (NCCL
    communicators aborted, then MPI Abort)."""
    from mpi4py import MPI

    def abort(code: int) -> None:
        abort_job(world_comm, code)

    watchdog = Watchdog(progress, timeout_s, abort, world_comm.Get_size(), heartbeats, record_fault, host,
                        poll_in_main_thread=MPI.Query_thread() < MPI.THREAD_MULTIPLE)
    return watchdog.start()
