"""Automatic restart (`mpitrain launch --max-restarts K`): a killed rank ends the attempt, the next one resumes from
the last committed checkpoint and ends exactly where an uninterrupted run ends (float64, bitwise); without restarts
the job fails naming the kill. Plus the pieces: what is read from disk to say how much time a restart lost."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpitrain.resilience.restart import (
    describe_status,
    first_step_started,
    last_committed,
    steps_logged_between,
    with_resume_auto,
)
from tests.mpi_helpers import OVERSUBSCRIBED_ENV, REPO_ROOT, describe, run_mpi

STEPS = 12
SETTINGS = ["data.synthetic=true", "precision.compute=float64", f"train.steps={STEPS}", "checkpoint.every=4",
            "logging.peak_flops=1e9", "train.log_every=1"]
KILL = "kill:rank=1:step=7"  # after the checkpoint of step 4: steps 5 and 6 are redone


def settings() -> list[str]:
    return [arg for setting in SETTINGS for arg in ("--set", setting)]


def run_launch(args: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m mpitrain launch ARGS` from the repository root, killed with all its ranks after `timeout`."""
    full_env = {**os.environ, **OVERSUBSCRIBED_ENV, **env}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "mpitrain", "launch", *args]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=full_env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"launch timed out after {timeout} s:\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Each logged step's loss; a step logged again after a restart keeps its last row."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows}


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = run_mpi(2, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir), *settings()],
                     timeout=240)
    assert result.returncode == 0, describe(result)
    losses = losses_by_step(run_dir)
    assert len(losses) == STEPS, sorted(losses)
    return losses


@pytest.mark.parametrize("fault, named", [
    (KILL, "fault injection: rank 1 kills itself (SIGKILL) at the start of step 7"),
    # `kill -STOP`: the watchdog ends the job (exit status 124) within fault.timeout_s, then the restart
    ("hang:rank=1:step=7", "HANG at step 7"),
])
def test_failed_rank_restarts_and_ends_as_an_uninterrupted_run(tmp_path, reference_losses, fault, named):
    run_dir = tmp_path / "run"
    result = run_launch(["-n", "2", "--max-restarts", "1", "configs/tiny.toml", "--out", str(run_dir), *settings(),
                         "--set", "fault.timeout_s=10"], {"MPITRAIN_FAULT": fault})
    output = result.stdout + result.stderr
    assert result.returncode == 0, describe(result)
    assert named in output, output
    assert re.search(r"launch: attempt 0 failed with exit status \S+.*restart 1 of 1 from the checkpoint of step 4",
                     output), output
    assert "checkpoint: resumed from" in output and "step_00000004 at step 4" in output, output
    # Rank 0 writes a step's row after the step's last collective, which rank 1 has passed when it fails at the start
    # of step 7: the failed attempt logged step 5 and, unless rank 0 was killed first, step 6 (the resumed run then
    # rewrites metrics.jsonl from step 4, so only the launcher saw which).
    lost = re.search(r"launch: restart 1 \(attempt 1\) after exit status \S+.*: time lost ([0-9.]+) s, from the save "
                     r"of step 4 .* ([12]) logged steps? redone\)", output)
    assert lost, output
    assert float(lost.group(1)) > 0
    assert output.count("fault injection") == 1, output  # the restart finds it in injected_faults.jsonl
    losses = losses_by_step(run_dir)
    assert sorted(losses) == sorted(reference_losses), output
    for step, loss in reference_losses.items():  # bitwise, the redone steps 5..12 included
        assert losses[step] == loss, f"step {step}: {losses[step]!r} != uninterrupted {loss!r}\n{output}"


def test_without_restarts_the_job_fails_naming_the_kill(tmp_path):
    result = run_launch(["-n", "2", "configs/tiny.toml", "--out", str(tmp_path / "run"), *settings()],
                        {"MPITRAIN_FAULT": KILL})
    output = result.stdout + result.stderr
    assert result.returncode != 0, describe(result)
    assert "fault injection: rank 1 kills itself (SIGKILL) at the start of step 7" in output, output
    assert "launch: attempt" not in output and "launch: restart" not in output, output
    assert not (tmp_path / "run" / "checkpoints" / "step_00000012").exists()


def test_max_restarts_exhausted_reports_the_status(tmp_path):
    """A failure that every attempt meets (a missing data file, found by the trainer) is restarted K times only."""
    result = run_launch(["-n", "1", "--max-restarts", "1", "configs/tiny.toml", "--out", str(tmp_path / "run"),
                         *settings(), "--set", "data.synthetic=false", "--set", f"data.path={tmp_path / 'no.h5'}"],
                        {})
    output = result.stdout + result.stderr
    assert result.returncode != 0, describe(result)
    assert "restart 1 of 1" in output and "no restart left (--max-restarts 1)" in output, output


def test_a_stop_request_is_passed_on_and_not_restarted(tmp_path):
    """SIGUSR1 to `launch` reaches the ranks (through mpiexec): they save and exit 75, which is not restarted."""
    run_dir = tmp_path / "run"
    full_env = {**os.environ, **OVERSUBSCRIBED_ENV}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "mpitrain", "launch", "-n", "2", "--max-restarts", "2", "configs/tiny.toml",
               "--out", str(run_dir), *settings(), "--set", "train.steps=100000", "--set", "checkpoint.every=0"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=full_env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().count("\n") >= 2):
            assert process.poll() is None and time.monotonic() < deadline, "the run did not get going"
            time.sleep(0.2)
        process.send_signal(signal.SIGUSR1)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 75, output
    assert "stop requested (SIGUSR1)" in output and "launch: attempt" not in output, output


def test_a_config_error_is_reported_before_any_attempt(tmp_path):
    result = run_launch(["-n", "1", "--max-restarts", "3", "configs/tiny.toml", "--out", str(tmp_path / "run"),
                         "--set", "train.no_such_key=1"], {})
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "unknown config key train.no_such_key" in output, output
    assert "launch: attempt" not in output, output


# ----------------------------------------------------------------------------- pieces
def test_resume_auto_replaces_any_resume_option():
    assert with_resume_auto(["--out", "r"]) == ["--out", "r", "--resume", "auto"]
    assert with_resume_auto(["--resume", "x/step_1", "--out", "r"]) == ["--out", "r", "--resume", "auto"]
    assert with_resume_auto(["--resume=x", "--set", "a.b=1"]) == ["--set", "a.b=1", "--resume", "auto"]


def test_status_in_words():
    assert describe_status(137) == "137 (SIGKILL)"
    assert describe_status(1) == "1"


def test_time_lost_is_read_from_metrics_and_the_checkpoint_index(tmp_path):
    rows = [{"step": 4, "time": 100.0, "step_time_s": 1.0}, {"step": 5, "time": 101.0, "step_time_s": 1.0},
            {"step": 6, "time": 102.0, "step_time_s": 1.0},  # failed attempt (started at 95)
            {"step": 5, "time": 110.5, "step_time_s": 0.5}]  # restarted at 108, resumed from step 4
    assert steps_logged_between(rows, 100.2, 108.0) == 2  # after the save of step 4, before the failure
    assert first_step_started(rows, since=108.0) == 110.0
    assert first_step_started(rows, since=111.0) is None
    checkpoint = tmp_path / "step_00000004"
    checkpoint.mkdir()
    (checkpoint / "index.json").write_text(json.dumps({"step": 4, "created": 100.2}))
    (checkpoint / "COMMITTED").write_text("")
    saved = last_committed(tmp_path)
    assert (saved.step, saved.saved_at) == (4, 100.2)
    assert last_committed(tmp_path / "none") is None


def test_sbatch_helper_reads_the_checkpoint_the_time_needed_and_the_time_lost(tmp_path, capsys):
    """What slurm/train.sbatch asks after a failure (`restart failed`) and after the restarted attempt (`lost`)."""
    from mpitrain.resilience.restart import _main
    (tmp_path / "config.toml").write_text("[checkpoint]\nevery = 5\n\n[train]\nsteps = 40\n")
    checkpoint = tmp_path / "checkpoints" / "step_00000010"
    checkpoint.mkdir(parents=True)
    (checkpoint / "index.json").write_text(json.dumps({"step": 10, "created": 100.0, "save_seconds": 2.0}))
    (checkpoint / "COMMITTED").write_text("")
    rows = [{"step": step, "time": 90.0 + step, "step_time_s": 1.0} for step in range(1, 13)]  # attempt from 90
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert _main(["failed", str(tmp_path), "90", "103"]) == 0
    machine, words = capsys.readouterr().out.splitlines()
    assert machine == "10 100.0 7"  # start-up 0 s + 5 steps of 1 s + a 2 s save
    assert "checkpoint of step 10" in words and "2 logged steps done since are redone" in words
    with open(tmp_path / "metrics.jsonl", "a") as metrics:  # the restart, begun at 105, ends its first step at 110
        metrics.write(json.dumps({"step": 11, "time": 110.0, "step_time_s": 1.0}) + "\n")
    assert _main(["lost", str(tmp_path), "1", "137", "10", "100.0", "103", "105"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("restart 1 (attempt 1) after exit status 137 (SIGKILL): time lost 9.0 s"), line
    assert "failure to restart 2.0 s" in line
