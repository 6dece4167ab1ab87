"""No silent hangs: the progress record, "who had not arrived" from fake heartbeat files, the watchdog's report and
abort, heartbeat files; then real 2-rank jobs: an external `kill -STOP`, MPITRAIN_FAULT=hang and kill, a normal run
with a short timeout that must not fire, the main-thread deadline used without MPI_THREAD_MULTIPLE, and a stopped
rank under `mpitrain launch --max-restarts 1` that resumes to the same losses as an uninterrupted run.

Jobs are waited for with generous subprocess deadlines only: no test reads a clock to judge speed."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpitrain.comm.operations import Handle, Operation, ProgressRecord
from mpitrain.comm.watchdog import (
    HANG_EXIT_CODE,
    PeerState,
    Watchdog,
    fault_records,
    hang_message,
    peer_states,
    reporting_peer,
    suspects,
)
from mpitrain.errors import ConfigError
from mpitrain.resilience.heartbeat import HeartbeatFiles, read_heartbeats
from tests.mpi_helpers import OVERSUBSCRIBED_ENV, REPO_ROOT, describe, find_mpiexec, run_mpi

JOB_DEADLINE_S = 240  # a generous bound for a job the watchdog must end: only "it ended", never how fast
TIMEOUT_S = 5  # fault.timeout_s of the hang tests: short, yet long enough that a busy machine does not trip it


# ---- the progress record, no MPI -------------------------------------------------------------------------------------
def test_progress_record_numbers_operations_per_channel():
    record = ProgressRecord(world_rank=2)
    first = record.enter("all_reduce", "dp", (0, 2), "dp@0", (0,), 64)
    second = record.enter("iall_gather", "dp", (0, 2), "dp@0", (0,), 32)
    send = record.enter("send", "pp", (2, 6), "pp@2:2>6", (6,), 16)
    assert (first.seq, second.seq, send.seq) == (1, 2, 1)
    assert record.entered == {"dp@0": 2, "pp@2:2>6": 1}
    assert record.snapshot()["operation"] is None
    record.begin_wait(second)
    snapshot = record.snapshot()
    assert snapshot["operation"]["channel"] == "dp@0" and snapshot["operation"]["seq"] == 2
    assert snapshot["operation"]["describe"] == "iall_gather of 32 B on group dp (world ranks 0,2)"
    record.end_wait()
    assert record.waiting is None
    assert send.describe() == "send of 16 B to rank 6 on group pp (world ranks 2,6)"
    assert Operation("all_reduce", "world", tuple(range(64)), "world@0", 1, 4_200_000, ()).describe() == \
        "all_reduce of 4.2 MB on group world (world ranks 0..63 (64 ranks))"


class FakeRequest:
    """An MPI request that completes after `tests` calls of Test (never, with None); Wait checks what is recorded."""

    def __init__(self, tests=None, on_wait=None):
        self.tests, self.on_wait, self.calls = tests, on_wait, 0

    def Test(self):  # mpi4py's names
        self.calls += 1
        return self.tests is not None and self.calls >= self.tests

    def Wait(self):
        self.on_wait()


def test_handle_wait_records_the_operation_it_waits_on():
    record = ProgressRecord(world_rank=0)
    operation = record.enter("iall_reduce", "dp", (0, 1), "dp@0", (1,), 8)
    seen = []
    handle = Handle(FakeRequest(on_wait=lambda: seen.append(record.waiting[0])), (), operation, record)
    handle.wait()
    assert seen == [operation] and record.waiting is None and handle.done


def test_polling_wait_calls_the_timeout_once_the_deadline_passes():
    """Without MPI_THREAD_MULTIPLE the blocked thread polls Test against the deadline and reports itself."""
    record = ProgressRecord(world_rank=0)
    record.poll_timeout_s = 0.01
    fired = []

    def on_timeout(operation, waited_s):
        fired.append((operation, waited_s))
        raise SystemExit(HANG_EXIT_CODE)  # a real on_timeout aborts the job and never returns

    record.on_timeout = on_timeout
    operation = record.enter("irecv", "pp", (0, 1), "pp@0:1>0", (1,), 8)
    with pytest.raises(SystemExit):
        Handle(FakeRequest(tests=None), (), operation, record).wait()
    assert fired and fired[0][0] is operation and fired[0][1] >= 0.01
    assert record.waiting is None
    request = FakeRequest(tests=3)  # completes before the deadline: no report
    record.poll_timeout_s = 1e6
    Handle(request, (), record.enter("irecv", "pp", (0, 1), "pp@0:1>0", (1,), 8), record).wait()
    assert request.calls == 3 and len(fired) == 1


# ---- who had not arrived, from fake heartbeat files ------------------------------------------------------------------
def beat(rank, beat_count, entered, step=5, operation=None, host=None, age_s=0.0):
    return {"rank": rank, "host": host or f"node{rank}", "pid": 100 + rank, "time": time.time() - age_s,
            "beat": beat_count, "state": "running", "step": step, "entered": entered, "operation": operation}


WAITING = Operation("all_reduce", "dp", (0, 1, 2, 3), "dp@0", 12, 4096, (1, 2, 3))


def write_beats(directory: Path, records: dict) -> HeartbeatFiles:
    for rank, record in records.items():
        HeartbeatFiles(directory, rank).write(record)
    return HeartbeatFiles(directory, 0)


def test_stopped_and_late_peers_are_named_and_arrived_ones_are_not(tmp_path):
    files = write_beats(tmp_path, {1: beat(1, 7, {"dp@0": 11}, step=5, age_s=30),  # stopped before arriving
                                   2: beat(2, 3, {"dp@0": 12}),  # arrived, alive
                                   3: beat(3, 9, {"dp@0": 11, "pp@0:3>1": 2}, step=5)})  # late, alive
    first = {rank: files.read(rank) for rank in WAITING.peers}
    write_beats(tmp_path, {2: beat(2, 4, {"dp@0": 12}), 3: beat(3, 10, {"dp@0": 11}, operation={
        "describe": "recv of 8 B from rank 1 on group pp (world ranks 1,3)", "channel": "pp@1:1>3", "seq": 2})})
    second = {rank: files.read(rank) for rank in WAITING.peers}
    states = peer_states(WAITING, first, second)
    by_rank = {s.rank: s for s in states}
    assert (by_rank[1].arrived, by_rank[1].stopped) == (False, True)
    assert (by_rank[2].arrived, by_rank[2].stopped) == (True, False)
    assert (by_rank[3].arrived, by_rank[3].stopped) == (False, False)
    assert [s.rank for s in suspects(states)] == [1]  # the stopped one, not the one waiting on it

    message = hang_message(WAITING, 6.2, 5, 7, 0, 4, "node0", states)
    assert message.startswith("[rank 0/4] HANG at step 7: all_reduce of 4.1 kB on group dp (world ranks 0,1,2,3)")
    expected = ("not arrived: rank 1 on node1 (stopped: last heartbeat 30 s ago, at step 5, computing), rank 3 on "
                "node3 (alive, at step 5, in recv of 8 B from rank 1")
    assert expected in message, message
    assert "rank 2" not in message and "\n" not in message
    records = fault_records(WAITING, 7, 0, message, states)
    assert [(r["rank"], r["host"], r["kind"], r["operation"], r["group"], r["step"]) for r in records] == \
        [(1, "node1", "hang", "all_reduce", "dp", 7)]


def test_a_peer_without_heartbeat_or_stopped_inside_the_operation(tmp_path):
    files = write_beats(tmp_path, {2: beat(2, 5, {"dp@0": 12}), 3: beat(3, 5, {"dp@0": 12})})
    reads = {rank: files.read(rank) for rank in WAITING.peers}
    states = peer_states(WAITING, reads, {rank: files.read(rank) for rank in WAITING.peers})
    message = hang_message(WAITING, 6, 5, 7, 0, 4, "node0", states)
    assert "not arrived: rank 1 (no heartbeat file)" in message
    assert "stopped inside the operation: rank 2 on node2" in message and "rank 3 on node3" in message
    assert [s.rank for s in suspects(states)] == [1, 2, 3]
    assert [r["rank"] for r in fault_records(WAITING, 7, 0, message, states)] == [2, 3]  # rank 1's host unknown
    assert "unknown without heartbeats (fault.heartbeat = false)" in hang_message(WAITING, 6, 5, 0, 0, 4, "n", None)
    assert "during start-up" in hang_message(WAITING, 6, 5, 0, 0, 4, "n", None)


def test_point_to_point_arrival_is_the_peer_count_on_the_same_direction():
    receive = Operation("recv", "pp", (0, 1), "pp@0:1>0", 4, 8, (1,))
    sent_three = {1: beat(1, 2, {"pp@0:1>0": 3, "pp@0:0>1": 9})}
    sent_four = {1: beat(1, 2, {"pp@0:1>0": 4})}
    assert not peer_states(receive, sent_three, sent_three)[0].arrived
    assert peer_states(receive, sent_four, sent_four)[0].arrived


def test_only_the_lowest_live_rank_waiting_on_the_same_operation_reports():
    same = {"channel": "dp@0", "seq": 12}
    second = {1: beat(1, 4, {"dp@0": 12}, operation=same), 2: beat(2, 4, {"dp@0": 12}, operation=same)}
    states = [PeerState(1, "n1", True, True, False, 5, "x"), PeerState(2, "n2", True, True, False, 5, "x")]
    assert reporting_peer(WAITING, states, second, rank=3) == 1
    assert reporting_peer(WAITING, states, second, rank=0) is None
    stopped = [states[0]._replace(stopped=True), states[1]]
    assert reporting_peer(WAITING, stopped, second, rank=3) == 2


# ---- the watchdog's report and abort (no MPI: a fake abort) ----------------------------------------------------------
class Aborted(Exception):
    pass


def make_watchdog(tmp_path, record, faults, heartbeats=True):
    def abort(code):
        raise Aborted(code)

    files = HeartbeatFiles(tmp_path / "heartbeat", record.world_rank) if heartbeats else None
    return Watchdog(record, 0.05, abort, 2, files, record_fault=lambda **r: faults.append(r), host="node0",
                    interval_s=0.01)


def test_watchdog_reports_a_stopped_peer_and_aborts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("mpitrain.comm.watchdog.ABORT_GRACE_SECONDS", 0.0)
    record, faults = ProgressRecord(world_rank=0), []
    write_beats(tmp_path / "heartbeat", {1: beat(1, 3, {"world@0": 1}, step=4, host="node9")})
    watchdog = make_watchdog(tmp_path, record, faults)
    record.step = 4
    record.enter("all_reduce", "world", (0, 1), "world@0", (1,), 8)
    operation = record.enter("all_reduce", "world", (0, 1), "world@0", (1,), 8)
    record.begin_wait(operation)
    record.waiting = (operation, record.waiting[1] - 1.0)  # waiting for a second: overdue
    with pytest.raises(Aborted) as aborted:
        watchdog.tick()
    assert aborted.value.args == (HANG_EXIT_CODE,)
    line = capsys.readouterr().err.strip()
    assert line.startswith("[rank 0/2] HANG at step 4: all_reduce of 8 B on group world (world ranks 0,1)"), line
    assert "not arrived: rank 1 on node9 (stopped" in line and "\n" not in line
    assert [(f["rank"], f["host"], f["step"], f["detail"]) for f in faults] == [(1, "node9", 4, line)]
    mine = json.loads((tmp_path / "heartbeat" / "rank_00000.json").read_text())
    assert mine["state"] == "hang" and mine["operation"]["seq"] == 2 and mine["step"] == 4


def test_watchdog_stands_down_when_the_operation_completes_while_it_looks(tmp_path, capsys):
    record, faults = ProgressRecord(world_rank=0), []
    operation = record.enter("barrier", "world", (0, 1), "world@0", (1,), 0)
    record.begin_wait(operation)
    record.waiting = (operation, record.waiting[1] - 1.0)
    watchdog = make_watchdog(tmp_path, record, faults)

    class FinishingHeartbeats(HeartbeatFiles):
        def read(self, world_rank):
            record.end_wait()  # the barrier completes while the peers are being read: slow, not hung
            return super().read(world_rank)

    watchdog.heartbeats = FinishingHeartbeats(tmp_path / "heartbeat", 0)
    watchdog.tick()
    assert capsys.readouterr().err == "" and faults == []


def test_watchdog_without_heartbeats_still_aborts_naming_the_operation(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("mpitrain.comm.watchdog.ABORT_GRACE_SECONDS", 0.0)
    record, faults = ProgressRecord(world_rank=1), []
    watchdog = make_watchdog(tmp_path, record, faults, heartbeats=False)
    operation = record.enter("recv", "pp", (0, 1), "pp@0:0>1", (0,), 1024)
    record.begin_wait(operation)
    record.waiting = (operation, record.waiting[1] - 1.0)
    with pytest.raises(Aborted):
        watchdog.tick()
    line = capsys.readouterr().err
    assert "HANG during start-up: recv of 1.0 kB from rank 0 on group pp" in line and "fault.heartbeat = false" in line
    assert faults == [] and not (tmp_path / "heartbeat").exists()


def test_a_rank_leaves_the_report_to_a_lower_live_rank_then_reports_if_the_job_lives_on(tmp_path, capsys,
                                                                                          monkeypatch):
    monkeypatch.setattr("mpitrain.comm.watchdog.ABORT_GRACE_SECONDS", 0.0)
    monkeypatch.setattr("mpitrain.comm.watchdog.DEFER_MARGIN_S", 0.0)
    record, faults = ProgressRecord(world_rank=1), []
    operation = record.enter("all_reduce", "world", (0, 1, 2), "world@0", (0, 2), 8)
    record.begin_wait(operation)
    record.waiting = (operation, record.waiting[1] - 1.0)
    watchdog = make_watchdog(tmp_path, record, faults)
    reads = []

    class Peers(HeartbeatFiles):  # rank 0 alive (its beat moves) and waiting on the same operation; rank 2 stopped
        def read(self, world_rank):
            reads.append(world_rank)
            if world_rank == 2:
                return beat(2, 1, {"world@0": 0})
            waiting = {"channel": "world@0", "seq": 1, "waiting_s": 1.0}
            return beat(0, len(reads), {"world@0": 1}, operation=waiting)

    watchdog.heartbeats = Peers(tmp_path / "heartbeat", 1)
    sleeps = []
    monkeypatch.setattr(watchdog, "_sleep_beating", sleeps.append)
    with pytest.raises(Aborted):
        watchdog.tick()  # rank 0 should have reported; it did not (it is not really there), so rank 1 does
    assert len(sleeps) == 2  # between the two reads, then waiting for rank 0's report
    line = capsys.readouterr().err
    assert line.startswith("[rank 1/2] HANG during start-up: all_reduce of 8 B") and "not arrived: rank 2" in line
    assert [f["rank"] for f in faults] == [2]


def test_heartbeat_files_are_replaced_whole_and_read_back(tmp_path):
    files = HeartbeatFiles(tmp_path / "hb", 3)
    assert files.read(3) is None
    files.write({"rank": 3, "beat": 1})
    files.write({"rank": 3, "beat": 2})
    assert files.read(3) == {"rank": 3, "beat": 2}
    assert sorted(p.name for p in (tmp_path / "hb").iterdir()) == ["rank_00003.json"]  # no temporary left
    (tmp_path / "hb" / "rank_00004.json").write_text('{"rank": 4, "be')  # torn by a crash: unreadable, skipped
    assert files.read(4) is None and list(read_heartbeats(tmp_path / "hb")) == [3]
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="fault.heartbeat"):
        HeartbeatFiles(blocker / "heartbeat", 0)


# ---- real jobs on 2 ranks -------------------------------------------------------------------------------------------
def tiny_settings(*extra: str) -> list[str]:
    settings = ["data.synthetic=true", "logging.peak_flops=1e9", "train.log_every=1", *extra]
    return [arg for setting in settings for arg in ("--set", setting)]


def start_job(args: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start `args` (a command after the python interpreter, or under launch) in its own session."""
    full_env = {**os.environ, **OVERSUBSCRIBED_ENV, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    return subprocess.Popen(args, cwd=REPO_ROOT, env=full_env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def finish_job(process: subprocess.Popen, timeout: float = JOB_DEADLINE_S) -> subprocess.CompletedProcess:
    """Wait for the job; past the deadline (the watchdog failed) kill the whole session and fail."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"job still running after {timeout} s (not ended by the watchdog)\n--- stdout ---\n{stdout}\n"
                    f"--- stderr ---\n{stderr}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing of the job may outlive the test, stopped ranks least
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def train_command(run_dir: Path, *settings: str) -> list[str]:
    return [find_mpiexec(), "-n", "2", sys.executable, "-m", "mpitrain", "train", "configs/tiny.toml", "--out",
            str(run_dir), *tiny_settings(*settings)]


def stop_rank_when_at_step(process, run_dir: Path, rank: int, step: int) -> int:
    """SIGSTOP `rank` (its pid from its heartbeat) once its heartbeat shows `step` while it still runs; returns the
    pid. A rank whose heartbeat already says "finished" is never stopped: it would be stopped inside MPI's
    finalize, where no watchdog looks, and the job would hang instead of showing the recovery."""
    while process.poll() is None:
        record = read_heartbeats(run_dir / "heartbeat").get(rank)  # the node's file (resilience/heartbeat.py)
        if record and record.get("state") != "running":
            finish_job(process)
            pytest.fail(f"rank {rank} {record.get('state')} before a heartbeat showed it at step {step}")
        if record and record.get("step", 0) >= step:
            os.kill(record["pid"], signal.SIGSTOP)
            return record["pid"]
        time.sleep(0.05)
    pytest.fail(f"the job ended before rank {rank} reached step {step}:\n{describe(finish_job(process))}")


def names_the_stopped_rank(text: str, rank: int, stopped_anywhere: bool) -> bool:
    """Whether a hang report names `rank` as the one that had not arrived. stopped_anywhere: the rank was stopped
    from outside at no chosen point, so it may have been inside the collective already (an all-reduce overlapped
    with backward spans much of a step, and a loaded machine stops it late); the report then names it as stopped
    inside the operation instead."""
    wordings = ["not arrived"] + (["stopped inside the operation"] if stopped_anywhere else [])
    return any(f"{wording}: rank {rank} on " in text for wording in wordings)


def assert_hang_reported(result, run_dir: Path, stopped_rank: int = 1, stopped_anywhere: bool = False):
    assert result.returncode != 0, describe(result)
    hang_lines = [line for line in result.stderr.splitlines() if " HANG " in line]
    assert len(hang_lines) == 1, describe(result)
    line = hang_lines[0]
    assert f"did not complete within {TIMEOUT_S} s" in line and " of " in line and "on group " in line, line
    assert names_the_stopped_rank(line, stopped_rank, stopped_anywhere), line
    assert "(stopped: last heartbeat" in line, line
    faults = [json.loads(text) for text in (run_dir / "faults.jsonl").read_text().splitlines()]
    assert [(f["kind"], f["rank"]) for f in faults] == [("hang", stopped_rank)], faults
    assert faults[0]["host"] and faults[0]["operation"] in line and faults[0]["group"] in line
    return line


def test_external_kill_stop_of_one_rank_ends_the_job_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    process = start_job(train_command(run_dir, "train.steps=100000", f"fault.timeout_s={TIMEOUT_S}"))
    stop_rank_when_at_step(process, run_dir, rank=1, step=3)
    result = finish_job(process)
    line = assert_hang_reported(result, run_dir, stopped_anywhere=True)
    assert line.startswith("[rank 0/2] HANG at step "), line
    assert "Abort(124)" in result.stderr or result.returncode == HANG_EXIT_CODE, describe(result)


def test_injected_hang_ends_the_job_naming_the_rank(tmp_path):
    run_dir = tmp_path / "run"
    process = start_job(train_command(run_dir, "train.steps=1000", f"fault.timeout_s={TIMEOUT_S}"),
                        env={"MPITRAIN_FAULT": "hang:rank=1:step=4"})
    result = finish_job(process)
    assert "fault injection: rank 1 stops itself (SIGSTOP" in result.stderr, describe(result)
    assert "at the start of step 4" in result.stderr, describe(result)
    line = assert_hang_reported(result, run_dir)
    assert line.startswith("[rank 0/2] HANG at step 4: "), line  # its heartbeat may lag a few steps behind


def test_injected_kill_ends_the_job_naming_the_rank(tmp_path):
    run_dir = tmp_path / "run"
    process = start_job(train_command(run_dir, "train.steps=1000", f"fault.timeout_s={TIMEOUT_S}"),
                        env={"MPITRAIN_FAULT": "kill:rank=1:step=4"})
    result = finish_job(process)
    assert result.returncode != 0, describe(result)
    assert "fault injection: rank 1 kills itself (SIGKILL) at the start of step 4" in result.stderr, describe(result)
    assert not (run_dir / "checkpoints" / "step_00001000").exists()


def test_watchdog_stays_quiet_in_a_normal_run_with_a_short_timeout(tmp_path):
    run_dir = tmp_path / "run"
    result = run_mpi(2, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir),
                         *tiny_settings("train.steps=30", "checkpoint.every=10", "fault.timeout_s=5")],
                     timeout=JOB_DEADLINE_S)
    assert result.returncode == 0, describe(result)
    assert "HANG" not in result.stderr and not (run_dir / "faults.jsonl").exists(), describe(result)
    beats = read_heartbeats(run_dir / "heartbeat")
    assert sorted(beats) == [0, 1]
    for record in beats.values():
        assert (record["state"], record["step"], record["operation"]) == ("finished", 30, None), record
        assert record["entered"]["world@0"] > 30 and record["pid"] > 0 and record["host"], record


def test_heartbeat_false_writes_no_files(tmp_path):
    run_dir = tmp_path / "run"
    result = run_mpi(2, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir),
                         *tiny_settings("train.steps=3", "fault.heartbeat=false")], timeout=JOB_DEADLINE_S)
    assert result.returncode == 0, describe(result)
    assert not (run_dir / "heartbeat").exists()


POLLING = """
import os, signal, sys
import numpy as np
from mpi4py import MPI
from mpitrain.comm import Group, ProgressRecord
from mpitrain.comm.watchdog import Watchdog
from mpitrain.resilience.heartbeat import HeartbeatFiles

world = MPI.COMM_WORLD
record = ProgressRecord(world.Get_rank())
group = Group(world, "world", record)
files = HeartbeatFiles(sys.argv[1], world.Get_rank())
watchdog = Watchdog(record, TIMEOUT, world.Abort, world.Get_size(), files, poll_in_main_thread=True).start()
record.step = 2
group.barrier()
if world.Get_rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
group.all_reduce(np.zeros(1000))
print("all_reduce completed: the watchdog did not fire", flush=True)
"""


def test_main_thread_deadline_without_thread_support(tmp_path):
    """The fallback for MPI without MPI_THREAD_MULTIPLE: the blocked thread polls and aborts the job itself."""
    script = tmp_path / "job.py"
    script.write_text(POLLING.replace("TIMEOUT", str(TIMEOUT_S)))
    result = finish_job(start_job([find_mpiexec(), "-n", "2", sys.executable, str(script), str(tmp_path / "hb")]))
    assert result.returncode != 0 and "completed" not in result.stdout, describe(result)
    line = [line for line in result.stderr.splitlines() if " HANG " in line]
    assert len(line) == 1, describe(result)
    assert line[0].startswith("[rank 0/2] HANG at step 2: all_reduce of 8.0 kB on group world (world ranks 0,1)")
    assert "not arrived: rank 1 on " in line[0] and "(stopped: last heartbeat" in line[0], line[0]


# ---- a stopped rank under `mpitrain launch --max-restarts 1` ---------------------------------------------------------
RESTART_SETTINGS = ("precision.compute=float64", "train.steps=120", "checkpoint.every=10",
                    f"fault.timeout_s={2 * TIMEOUT_S}")  # two attempts to get through without a false alarm


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Each logged step's loss; a step logged again after a restart keeps its last row."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows}


def test_stopped_rank_under_launch_restarts_and_ends_with_the_losses_of_an_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"
    result = run_mpi(2, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(reference),
                         *tiny_settings(*RESTART_SETTINGS)], timeout=JOB_DEADLINE_S)
    assert result.returncode == 0, describe(result)
    expected = losses_by_step(reference)
    assert sorted(expected) == list(range(1, 121))

    run_dir = tmp_path / "run"
    # heartbeats come about once a second and the tiny job's 120 steps take about one: every step slowed 10x
    # (sleeps only, the numbers are untouched) so that a heartbeat shows rank 1 at step 25 while it runs
    process = start_job([sys.executable, "-m", "mpitrain", "launch", "-n", "2", "--max-restarts", "1",
                         "configs/tiny.toml", "--out", str(run_dir), *tiny_settings(*RESTART_SETTINGS)],
                        env={"MPITRAIN_FAULT": "slow:factor=10"})
    stop_rank_when_at_step(process, run_dir, rank=1, step=25)
    result = finish_job(process, timeout=2 * JOB_DEADLINE_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, describe(result)
    assert output.count(" HANG at step ") == 1 and names_the_stopped_rank(output, 1, stopped_anywhere=True), output
    assert "launch: restart 1" in output and "checkpoint: resumed from" in output, output
    losses = losses_by_step(run_dir)
    assert sorted(losses) == sorted(expected), output
    for step, loss in expected.items():  # bitwise, the redone steps after the checkpoint included
        assert losses[step] == loss, f"step {step}: {losses[step]!r} != uninterrupted {loss!r}\n{output}"
