"""A new user's mistakes under MPI: one line from rank 0, no MPI abort report, a nonzero exit status, and no run
directory left behind; the line names the resolved path of a relative file and the key a typo meant."""
from __future__ import annotations

import subprocess
import sys

import pytest

from mpitrain.comm.failure import one_line
from mpitrain.errors import shown_path
from mpitrain.train import forget_refused_start
from tests.mpi_helpers import REPO_ROOT, describe, run_mpi, run_python_mpi

TINY = ["--set", "data.synthetic=true", "--set", "precision.compute=float64", "--set", "train.steps=2",
        "--set", "logging.peak_flops=1e9"]


def train(n, run_dir, *args):
    return run_mpi(n, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir), *TINY, *args],
                   timeout=120)


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if "ERROR" in line]


def assert_refused_once(result, *phrases):
    """Exactly one error line (rank 0's, on stderr), no MPI abort report, no traceback, exit status 1."""
    lines = error_lines(result)
    assert result.returncode == 1 and len(lines) == 1, describe(result)
    assert lines[0].startswith("ERROR: ") and "[rank" not in lines[0], describe(result)
    for phrase in phrases:
        assert phrase in lines[0], describe(result)
    output = result.stdout + result.stderr
    assert "Abort(" not in output and "MPI_Abort" not in output and "Traceback" not in output, describe(result)
    return lines[0]


def test_a_wrong_rank_count_is_one_line_before_any_batch_error_and_leaves_no_run_directory(tmp_path):
    run_dir = tmp_path / "runs" / "first"  # runs/ does not exist either: neither is left behind
    # dp = 3 on 2 ranks: global_batch 8 does not divide by dp * micro_batch = 12 either; the rank count comes first
    result = train(2, run_dir, "--set", "parallel.dp=3")
    assert_refused_once(result, "world size 2 does not match parallel dp*tp*pp*cp = 3*1*1*1 = 3", "-n 3")
    assert "global_batch" not in result.stderr
    assert not (tmp_path / "runs").exists(), list(tmp_path.rglob("*"))


def test_a_refused_start_in_an_existing_run_directory_keeps_it(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    assert_refused_once(train(2, run_dir, "--set", "parallel.dp=3"), "world size 2")
    assert (run_dir / "notes.txt").read_text() == "mine"
    assert not (run_dir / "flight").exists()  # an error said in one line leaves no flight record (comm/flight.py)


def test_a_refused_start_never_removes_a_directory_another_job_started_in_meanwhile(tmp_path):
    run_dir = tmp_path / "runs" / "shared"
    forget = forget_refused_start(run_dir)  # asked before this start wrote anything: the directory is not there
    run_dir.mkdir(parents=True)
    (run_dir / ".lock").write_text("{}")  # another job took it (this start's own lock is released before forget)
    forget()
    assert (run_dir / ".lock").exists()
    (run_dir / ".lock").unlink()
    forget()
    assert not (tmp_path / "runs").exists()  # nothing of anyone's there: removed as far as this start created it


def test_a_mistyped_key_names_the_key_it_was_meant_to_be(tmp_path):
    result = train(2, tmp_path / "run", "--set", "train.stesp=3")
    assert_refused_once(result, "unknown config key train.stesp", "did you mean train.steps?")
    config = tmp_path / "typo.toml"
    config.write_text("[optim]\nwarmup_step = 2\n")
    result = run_mpi(2, ["-m", "mpitrain", "train", str(config), "--out", str(tmp_path / "run"), *TINY])
    assert_refused_once(result, f"unknown config key optim.warmup_step in {config}", "did you mean optim.warmup_steps?")
    assert not (tmp_path / "run").exists()


def test_a_missing_relative_data_file_is_named_as_resolved(tmp_path):
    result = run_mpi(2, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path / "run"),
                         "--set", "data.path=data/nowhere.h5"])
    assert_refused_once(result, f"data file data/nowhere.h5 (resolved from {REPO_ROOT}) not found", "data.path")
    assert not (tmp_path / "run").exists()
    result = run_mpi(1, ["-m", "mpitrain", "train", "configs/no-such.toml", "--out", str(tmp_path / "run")])
    assert_refused_once(result, f"config file not found: configs/no-such.toml (resolved from {REPO_ROOT})")
    generate = subprocess.run([sys.executable, "-m", "mpitrain", "generate", "runs/no-such-run"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=60)
    assert generate.returncode == 1 and f"runs/no-such-run (resolved from {REPO_ROOT})" in generate.stderr, \
        generate.stderr


AGREEMENT = """
    import sys
    from mpi4py import MPI
    from mpitrain.comm.failure import agree_on_user_errors, end_job_on_error
    from mpitrain.errors import DataError

    comm = MPI.COMM_WORLD

    def check():
        if comm.rank in {failing}:
            raise DataError(f"data file /node-local/x.h5 not found")
        return "ok"

    with end_job_on_error(comm, grace_s=1.0):
        {body}
    print(f"rank {{comm.rank}} went on", flush=True)
"""


def test_a_check_only_some_ranks_fail_ends_every_rank_with_that_ranks_line():
    result = run_python_mpi(3, AGREEMENT.format(failing="{1}", body="agree_on_user_errors(comm, check)\n"
                                                                      "        comm.Barrier()"))
    assert_refused_once(result, "ERROR: rank 1: data file /node-local/x.h5 not found")
    assert "went on" not in result.stdout


def test_a_user_error_on_one_rank_while_the_others_wait_in_a_collective_still_ends_the_job():
    """No agreement is possible (rank 0 waits in a barrier that rank 1 never reaches): after the grace the failing
    rank ends the job as any failure does, naming itself."""
    result = run_python_mpi(2, AGREEMENT.format(failing="{1}", body="check()\n        comm.Barrier()"))
    assert result.returncode != 0 and "[rank 1/2] ERROR: data file /node-local/x.h5 not found" in result.stderr, \
        describe(result)


def test_one_line_says_the_message_once_or_names_the_ranks():
    assert one_line(["bad key", "bad key"]) == "bad key"
    assert one_line([None, "no file", "no file"]) == "ranks 1, 2: no file"
    assert one_line(["a", "b"]) == "rank 0: a; rank 1: b"


@pytest.mark.parametrize("path, shown", [("data/x.h5", "data/x.h5 (resolved from {cwd})"), ("/abs/x.h5", "/abs/x.h5")])
def test_shown_path_adds_where_a_relative_path_was_resolved(path, shown, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shown_path(path) == shown.format(cwd=tmp_path)
