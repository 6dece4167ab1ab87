"""`mpitrain doctor`: `hang` reads the ranks' flight records and names who stopped a job and the collective the others
wait in; `parity` runs one step of a layout beside a one-process float64 reference and names the first tensor that
differs (and nothing when every tensor matches)."""
from __future__ import annotations

import json
import re
import sys

import pytest
from click.testing import CliRunner

from mpitrain.cli import main
from mpitrain.doctor.hang import NO_RECORD, diagnose
from mpitrain.errors import MpitrainError
from tests.mpi_helpers import OVERSUBSCRIBED_ENV, REPO_ROOT, describe, run_mpi

TIMEOUT_S = 5  # fault.timeout_s of the hang job: short, yet long enough that a busy machine does not trip it


# ---- hang: from records written by hand ------------------------------------------------------------------------------
def flight_record(rank, entered, ops, waiting=None, phase="forward"):
    channels = {"dp@0": {"group": "dp", "members": [0, 1, 2]}}
    return {"rank": rank, "reason": "hang", "step": 5, "phase": phase, "time": 100.0, "waiting": waiting,
            "entered": entered, "channels": channels, "ops": ops}


def op(seq, state, channel="dp@0"):
    return {"name": "all_reduce", "group": "dp", "channel": channel, "seq": seq, "nbytes": 4096, "step": 5,
            "start": 99.0, "end": None if state == "started" else 99.5, "state": state}


def write_records(run_dir, *records):
    (run_dir / "flight").mkdir(parents=True)
    for record in records:
        (run_dir / "flight" / f"rank_{record['rank']:05d}.json").write_text(json.dumps(record))


def test_hang_names_the_rank_that_never_entered_and_what_it_did_instead(tmp_path):
    waiting = {"name": "all_reduce", "group": "dp", "channel": "dp@0", "seq": 8}
    write_records(tmp_path,
                  flight_record(0, {"dp@0": 8}, [op(7, "completed"), op(8, "started")], waiting),
                  flight_record(1, {"dp@0": 7}, [op(7, "completed")], phase="optimizer"))  # rank 2: no file
    report = diagnose(tmp_path)
    assert "group dp (dp@0, world ranks 0,1,2): highest sequence 8" in report
    assert "stuck in it (started, never completed): rank 0" in report
    assert "never entered it (last sequence 7): rank 1 (hang): step 5, phase optimizer" in report
    assert f"never entered it: rank 2: {NO_RECORD} (no heartbeat either)" in report
    assert report.splitlines()[-1] == (f"verdict: rank 1 never entered all_reduce #8 of group dp (dp@0), where rank 0 "
                                       f"waits; rank 2 ({NO_RECORD}) never entered all_reduce #8 of group dp (dp@0), "
                                       "where rank 0 waits")


def test_hang_with_every_operation_complete_says_so(tmp_path):
    write_records(tmp_path, *(flight_record(rank, {"dp@0": 3}, [op(3, "completed")]) for rank in range(3)))
    assert diagnose(tmp_path).splitlines()[-1] == "verdict: no rank is stuck in an operation"


def test_hang_without_records_is_one_clear_line(tmp_path):
    with pytest.raises(MpitrainError, match=f"no flight records in {tmp_path / 'flight'}: the directory does not"):
        diagnose(tmp_path)
    (tmp_path / "flight").mkdir()
    with pytest.raises(MpitrainError, match="no rank_.*json file"):
        diagnose(tmp_path)
    result = CliRunner().invoke(main, ["doctor", "hang", str(tmp_path / "missing")])
    assert result.exit_code == 1 and "Error: no flight records in" in result.output
    assert "Traceback" not in result.output


# ---- hang: a real 4-rank job with one rank stopped -----------------------------------------------------------------
def test_hang_of_a_real_job_names_the_stopped_rank_and_the_collective(tmp_path):
    """tp 2 x dp 2; rank 2 stops itself (SIGSTOP) at the start of step 3. Its tp peer (3) waits in a forward
    all-reduce, its dp peer (0) in the gradient all-reduce; their watchdogs fire and write flight records; rank 2
    writes none. The doctor names rank 2 and the collective, by group and sequence number, that each peer waits in."""
    run_dir = tmp_path / "run"
    settings = ["data.synthetic=true", "logging.peak_flops=1e9", "train.steps=1000", "parallel.tp=2",
                f"fault.timeout_s={TIMEOUT_S}"]
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir)]
    result = run_mpi(4, args + [arg for s in settings for arg in ("--set", s)], timeout=120,
                     env={"MPITRAIN_FAULT": "hang:rank=2:step=3"})
    assert result.returncode != 0 and " HANG " in result.stderr, describe(result)
    records = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (run_dir / "flight").glob("rank_*")}
    assert 2 not in records and records, describe(result)
    report = CliRunner().invoke(main, ["doctor", "hang", str(run_dir)])
    assert report.exit_code == 0, report.output
    verdict = report.output.strip().splitlines()[-1]
    assert verdict.startswith(f"verdict: rank 2 ({NO_RECORD}) never entered "), report.output
    waiting_on_2 = [r["waiting"] for r in records.values()
                    if r["waiting"] and 2 in r["channels"][r["waiting"]["channel"]]["members"]]
    assert waiting_on_2, report.output
    for waiting in waiting_on_2:
        assert f"#{waiting['seq']} of group {waiting['group']} ({waiting['channel']})" in verdict, report.output
    assert "rank 0" not in verdict.split(" where ")[0]  # the blamed rank is 2 alone


# ---- parity ---------------------------------------------------------------------------------------------------------
def doctor_parity(n_ranks, *settings, plant=None):
    """`mpitrain doctor parity configs/tiny.toml -n N --set ...` as a person runs it (it starts mpiexec itself)."""
    import os
    import subprocess
    env = {key: value for key, value in os.environ.items() if key != "MPITRAIN_DOCTOR_PLANT"}
    env.update(OVERSUBSCRIBED_ENV, PYTHONPATH=str(REPO_ROOT), **({"MPITRAIN_DOCTOR_PLANT": plant} if plant else {}))
    args = [sys.executable, "-m", "mpitrain", "doctor", "parity", "configs/tiny.toml", "-n", str(n_ranks),
            "--set", "data.synthetic=true", *[arg for s in settings for arg in ("--set", s)]]
    return subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("n_ranks, settings", [
    (2, ["parallel.tp=2"]),
    (4, ["parallel.pp=2", "parallel.zero=1"]),  # pp 2 x dp 2, the optimizer state sharded over dp
], ids=["tp2", "pp2-dp2-zero1"])
def test_parity_of_a_correct_layout_passes(n_ranks, settings):
    result = doctor_parity(n_ranks, *settings)
    assert result.returncode == 0, describe(result)
    counts = re.search(r"\((\d+) forward outputs, (\d+) gradient pieces, (\d+) updated-state pieces\)", result.stdout)
    assert counts and all(int(n) > 0 for n in counts.groups()), describe(result)
    assert "all match: largest relative difference" in result.stdout, describe(result)


def test_parity_names_a_planted_missing_reduction_at_its_layer():
    """tp 2 x pp 2: block 1 (on pipeline stage 1, ranks 2 and 3) skips its attention output's all-reduce. The
    embedding and block 0 (stage 0) still match; the first tensor that differs is block 1's forward output."""
    result = doctor_parity(4, "parallel.tp=2", "parallel.pp=2", plant="skip_tp_reduce:layer=1")
    assert result.returncode == 1, describe(result)
    first = result.stdout.strip().splitlines()[-1]
    assert "the first in execution order: forward output of blocks.1 (layer 1), micro-batch 0, on rank 2 " in first
    assert "pp stage 1" in first and "> --tol 1e-09" in first, describe(result)


def test_parity_with_a_layout_the_ranks_cannot_hold_is_one_line():
    result = doctor_parity(3, "parallel.tp=2")
    assert result.returncode == 1, describe(result)
    assert result.stderr.strip() == "Error: world size 3 is not divisible by parallel.tp*pp*cp = 2", describe(result)
    assert "Traceback" not in result.stderr, describe(result)


def test_hang_tells_a_rank_ended_by_the_abort_from_a_stopped_one(tmp_path):
    """Rank 2 wrote no record, but its heartbeat was alive when the others wrote theirs: the job was ended before
    its own watchdog fired. The root is rank 1, which never entered the collective and is stuck in nothing."""
    waiting = {"name": "all_reduce", "group": "dp", "channel": "dp@0", "seq": 8}
    write_records(tmp_path,
                  flight_record(0, {"dp@0": 8}, [op(8, "started")], waiting),
                  flight_record(1, {"dp@0": 7}, [op(7, "completed")], phase="data"))
    (tmp_path / "heartbeat").mkdir()
    beat = {"rank": 2, "time": 99.5, "state": "running", "step": 5, "entered": {"dp@0": 7}, "operation": None}
    (tmp_path / "heartbeat" / "rank_00002.json").write_text(json.dumps(beat))
    report = diagnose(tmp_path)
    assert "rank 2: no record, but its heartbeat was alive when the others wrote theirs" in report
    assert NO_RECORD not in report
    verdict = report.splitlines()[-1]
    assert verdict == "verdict: rank 1 never entered all_reduce #8 of group dp (dp@0), where rank 0 waits"
