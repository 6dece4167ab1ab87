"""One writer per run directory (mpitrain/run/lock.py): who may take over a lock, the lock file taken, refused, taken
over and released without MPI; then real jobs: a second job on a live run's directory (fresh, and with --resume auto)
is refused in one line with exit status 73 and changes nothing of the first; once the first is killed, the next
`--resume auto` takes its lock over and finishes.

Jobs are waited for with generous subprocess deadlines only: no test reads a clock to judge speed."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpitrain.checkpoint.manager import STORAGE_FAILED_EXIT_CODE
from mpitrain.resilience.faulty_hosts import this_host
from mpitrain.resilience.heartbeat import read_heartbeats
from mpitrain.resilience.restart import Supervisor
from mpitrain.run import lock as lock_module
from mpitrain.run.lock import (
    LOCK_NAME,
    RUN_DIR_IN_USE_EXIT_CODE,
    RunDirLock,
    boot_id,
    pid_alive,
    process_start,
    read_lock,
    takeover_reason,
    this_attempt,
    this_job,
)
from tests.mpi_helpers import describe, run_mpi
from tests.test_watchdog import finish_job, start_job, tiny_settings

JOB_DEADLINE_S = 240


# ---- who may take a lock over, no files ------------------------------------------------------------------------------
ME = {"job": "local", "host": "node1", "pid": 100, "boot_id": "boot-a"}


def holder(**fields) -> dict:
    return {"job": "local", "host": "node1", "pid": 200, "pid_start": 7, "boot_id": "boot-a", "started": 1000.0,
            "heartbeat": 1000.0, "token": "t", **fields}


def test_a_holder_on_this_machine_is_alive_while_its_process_is():
    assert takeover_reason(holder(), ME, 5000.0, 600.0, alive=lambda pid, start: True) is None
    assert takeover_reason(holder(), ME, 5000.0, 600.0, alive=lambda pid, start: False) == "its process 200 is gone"
    assert takeover_reason(holder(pid=100), ME, 1001.0, 600.0) == "it was left by this process"
    # same host name, another machine (boot id): its pid means nothing here, its heartbeat decides
    assert takeover_reason(holder(boot_id="boot-b", heartbeat=4999.0), ME, 5000.0, 600.0,
                           alive=lambda pid, start: False) is None


def test_a_holder_on_another_host_is_alive_until_its_heartbeat_is_stale_unless_it_is_this_jobs_earlier_attempt():
    other = holder(host="node2")
    assert takeover_reason(other | {"heartbeat": 4500.0}, ME, 5000.0, 600.0) is None
    assert takeover_reason(other | {"heartbeat": 4300.0}, ME, 5000.0, 600.0) == \
        "no heartbeat for 700 s (more than 600 s)"
    slurm = dict(ME, job="4242")
    assert takeover_reason(other | {"job": "4242", "heartbeat": 4999.0}, slurm, 5000.0, 600.0) == \
        "an earlier attempt of job 4242"
    assert takeover_reason(other | {"job": "4243", "heartbeat": 4999.0}, slurm, 5000.0, 600.0) is None
    # two unrelated local jobs are never "the same job"
    assert takeover_reason(other | {"heartbeat": 4999.0}, ME, 5000.0, 600.0) is None


def test_an_earlier_attempt_of_this_job_is_taken_over_even_while_its_last_process_is_on_its_way_out():
    me = dict(ME, job="launch-9@h", attempt=1)
    def alive(pid, start):  # the old rank 0 still exiting after its abort
        return True
    assert takeover_reason(holder(job="launch-9@h", attempt=0), me, 1001.0, 600.0, alive=alive) == \
        "attempt 0 of job launch-9@h, which ended before this attempt 1 started"
    assert takeover_reason(holder(job="launch-9@h", attempt=1), me, 1001.0, 600.0, alive=alive) is None
    assert takeover_reason(holder(job="launch-8@h", attempt=0), me, 1001.0, 600.0, alive=alive) is None
    assert takeover_reason(holder(attempt=0), dict(ME, attempt=1), 1001.0, 600.0, alive=alive) is None  # local
    assert this_attempt({}) == 0 and this_attempt({"MPITRAIN_ATTEMPT": "2"}) == 2
    assert this_attempt({"SLURM_RESTART_COUNT": "3"}) == 3


def test_a_process_that_exited_but_was_not_reaped_is_not_alive():
    child = subprocess.Popen(["true"])
    for _ in range(200):  # it exits at once; until waited for, it stays a zombie
        if lock_module._process_state(child.pid) == "Z":
            break
        time.sleep(0.05)
    assert lock_module._process_state(child.pid) == "Z"
    assert not pid_alive(child.pid, process_start(child.pid))
    child.wait()
    assert pid_alive(os.getpid(), process_start(os.getpid()))


def test_the_job_id_comes_from_slurm_then_the_launcher():
    assert this_job({}) == "local"
    assert this_job({"MPITRAIN_JOB_ID": "launch-9@h"}) == "launch-9@h"
    assert this_job({"SLURM_JOB_ID": "77", "MPITRAIN_JOB_ID": "launch-9@h"}) == "77"


# ---- the lock file --------------------------------------------------------------------------------------------------
def write_lock(run_dir: Path, **fields) -> dict:
    record = {"job": "local", "host": this_host(), "pid": 1, "pid_start": None, "boot_id": boot_id(),
              "started": time.time() - 60, "heartbeat": time.time() - 1, "token": "theirs", **fields}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps(record))
    return record


def test_lock_taken_refreshed_and_released_leaving_nothing_behind(tmp_path):
    run_dir = tmp_path / "runs" / "x"
    lock = RunDirLock(run_dir, refresh_s=3600)
    assert lock.acquire() == (True, None)
    record = read_lock(run_dir / LOCK_NAME)
    assert {key: record[key] for key in ("job", "host", "pid")} == {"job": "local", "host": this_host(),
                                                                    "pid": os.getpid()}
    assert record["pid_start"] == process_start(os.getpid()) and record["started"] == record["heartbeat"]
    (run_dir / LOCK_NAME).write_text(json.dumps(record | {"heartbeat": 1.0}))  # aged, so a refresh must show
    lock.refresh()
    assert read_lock(run_dir / LOCK_NAME)["heartbeat"] > 1.0
    theirs = record | {"token": "theirs", "heartbeat": 1.0}
    (run_dir / LOCK_NAME).write_text(json.dumps(theirs))
    lock.refresh()  # another job's lock is never rewritten
    assert read_lock(run_dir / LOCK_NAME) == theirs
    (run_dir / LOCK_NAME).write_text(json.dumps(record))  # ours again
    second = RunDirLock(run_dir)  # a second taker in this very process counts as the same process: not refused...
    assert second.acquire()[0]  # ...it took over the first's lock, which the first must then leave alone
    lock.release()
    assert read_lock(run_dir / LOCK_NAME)["token"] == second.record["token"]
    second.release()
    assert sorted(p.name for p in run_dir.iterdir()) == []  # no lock, no temporary file left


def test_a_live_holder_refuses_in_one_line_and_a_dead_one_is_taken_over(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        write_lock(tmp_path, pid=sleeper.pid, pid_start=process_start(sleeper.pid))
        lock = RunDirLock(tmp_path)
        taken, line = lock.acquire()
        assert not taken
        assert line.startswith(f"{tmp_path} is in use by job local, pid {sleeper.pid} on host {this_host()} since ")
        assert "heartbeat 1 s ago" in line and "\n" not in line
        assert read_lock(tmp_path / LOCK_NAME)["token"] == "theirs"  # untouched
        # the same pid with another start time is another process: the holder is gone
        write_lock(tmp_path, pid=sleeper.pid, pid_start=process_start(sleeper.pid) - 1)
        taken, line = RunDirLock(tmp_path).acquire()
        assert taken and f"(its process {sleeper.pid} is gone)" in line
    finally:
        sleeper.kill()
        sleeper.wait()
    write_lock(tmp_path, pid=sleeper.pid, pid_start=None)
    lock = RunDirLock(tmp_path, refresh_s=3600)
    taken, line = lock.acquire()
    assert taken and line.startswith(f"run dir: took over {tmp_path / LOCK_NAME} from job local, pid {sleeper.pid}")
    lock.release()


def test_another_hosts_lock_is_kept_while_it_beats_and_taken_after_silence(tmp_path):
    write_lock(tmp_path, host="elsewhere", pid=4242, heartbeat=time.time() - 30)
    taken, line = RunDirLock(tmp_path, stale_after_s=600).acquire()
    assert not taken and "pid 4242 on host elsewhere" in line and "heartbeat 30 s ago" in line
    lock = RunDirLock(tmp_path, stale_after_s=10, refresh_s=3600)
    taken, line = lock.acquire()
    assert taken and "(no heartbeat for 30 s (more than 10 s))" in line
    lock.release()
    write_lock(tmp_path, host="elsewhere", job="4242", heartbeat=time.time())
    requeued = RunDirLock(tmp_path, refresh_s=3600, environ={"SLURM_JOB_ID": "4242"})
    taken, line = requeued.acquire()
    assert taken and "(an earlier attempt of job 4242)" in line
    requeued.release()


def test_an_unreadable_lock_is_looked_at_again_then_taken_over_and_a_create_is_exclusive(tmp_path):
    (tmp_path / LOCK_NAME).write_text('{"job": "lo')  # not a record (a crash of a writer without hard links)
    lock = RunDirLock(tmp_path, refresh_s=3600)
    taken, line = lock.acquire()
    assert taken and line == f"run dir: took over {tmp_path / LOCK_NAME} from an unknown holder (it is unreadable)"
    assert not RunDirLock(tmp_path)._create_exclusive()  # the fallback where hard links are missing: exclusive too
    lock.release()
    other = RunDirLock(tmp_path)
    assert other._create_exclusive() and read_lock(tmp_path / LOCK_NAME)["token"] == other.record["token"]


def test_a_lock_replaced_between_the_look_and_the_move_is_put_back(tmp_path):
    write_lock(tmp_path, token="newer")
    lock = RunDirLock(tmp_path)
    assert not lock._move_aside({"token": "judged-stale"})
    assert read_lock(tmp_path / LOCK_NAME)["token"] == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]


@pytest.mark.parametrize("status", [RUN_DIR_IN_USE_EXIT_CODE, STORAGE_FAILED_EXIT_CODE])
def test_launch_runs_its_attempts_as_one_job_and_restarts_neither_a_refused_run_nor_a_refused_save(tmp_path, status):
    seen = tmp_path / "job_ids"
    program = (f"import os, sys; open({str(seen)!r}, 'a').write(os.environ['MPITRAIN_JOB_ID'] + '\\n'); "
               f"sys.exit({status})")
    env = {key: value for key, value in os.environ.items() if key != "MPITRAIN_JOB_ID"}
    lines = []
    supervisor = Supervisor([sys.executable, "-c", program], [], env, 2, tmp_path / "metrics.jsonl",
                            tmp_path / "checkpoints", lines.append)
    assert supervisor.run() == status and lines == []  # one attempt, nothing restarted
    assert seen.read_text().splitlines() == [f"launch-{os.getpid()}@{socket.gethostname()}"]


# ---- real jobs -------------------------------------------------------------------------------------------------------
def train_args(run_dir: Path, *settings: str) -> list[str]:
    return ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir),
            *tiny_settings("precision.compute=float64", *settings)]


def wait_for_rows(process, run_dir: Path, rows: int) -> None:
    metrics = run_dir / "metrics.jsonl"
    while process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows and (run_dir / LOCK_NAME).exists():
            return
        time.sleep(0.05)
    pytest.fail(f"the first job ended early:\n{describe(finish_job(process))}")


def test_a_second_job_is_refused_and_the_first_keeps_its_directory_until_it_dies(tmp_path):
    run_dir = tmp_path / "run"
    # the first job: one rank, slowed (sleeps only) so that it is still running while the others try
    first = start_job([sys.executable, *train_args(run_dir, "train.steps=100000", "checkpoint.every=3")],
                      env={"MPITRAIN_FAULT": "slow:factor=20"})
    try:
        wait_for_rows(first, run_dir, rows=4)
        holder = read_lock(run_dir / LOCK_NAME)
        assert holder["pid"] == first.pid and holder["job"] == "local"
        config_before = (run_dir / "config.toml").read_text()
        for extra in ([], ["--resume", "auto"]):
            rows_before = (run_dir / "metrics.jsonl").read_text().splitlines()
            second = run_mpi(2, [*train_args(run_dir, "train.seed=7", "train.steps=50"), *extra],
                             timeout=JOB_DEADLINE_S)
            assert second.returncode == RUN_DIR_IN_USE_EXIT_CODE, describe(second)
            said = [line for line in (second.stdout + second.stderr).splitlines() if "is in use by" in line]
            assert said == [f"ERROR: {run_dir} is in use by job local, pid {first.pid} on host {this_host()} since "
                            + said[0].split(" since ", 1)[1]], describe(second)
            assert "Traceback" not in second.stderr and "step " not in second.stdout, describe(second)
            # nothing of the first changed: its config, its rows so far, the lock, its heartbeats (no rank 1's)
            assert (run_dir / "config.toml").read_text() == config_before
            assert (run_dir / "metrics.jsonl").read_text().splitlines()[:len(rows_before)] == rows_before
            assert read_lock(run_dir / LOCK_NAME)["token"] == holder["token"]
            beats = read_heartbeats(run_dir / "heartbeat")
            assert sorted(beats) == [0] and beats[0]["pid"] == first.pid, beats
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # dies without releasing its lock, as a crashed job would
        first.communicate()
    assert read_lock(run_dir / LOCK_NAME)["pid"] == first.pid
    resumed = run_mpi(2, [*train_args(run_dir, "train.steps=100000", "checkpoint.every=3", "train.stop_at=12"),
                          "--resume", "auto"], timeout=JOB_DEADLINE_S)
    assert resumed.returncode == 75, describe(resumed)  # train.stop_at: saved, "resume me"
    assert f"run dir: took over {run_dir / LOCK_NAME} from job local, pid {first.pid} on host {this_host()} since " \
        in resumed.stdout and f"(its process {first.pid} is gone)" in resumed.stdout, describe(resumed)
    assert "checkpoint: resumed from" in resumed.stdout, describe(resumed)
    assert not (run_dir / LOCK_NAME).exists()  # released at the end
