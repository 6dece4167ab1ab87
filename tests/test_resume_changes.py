"""A resume says what changed since the checkpoint (a table: key, was, now, by group), refuses a change that alters
the run's meaning (learning-rate schedule, global batch) unless --allow-changes names it, says when it reshards, and
takes a run directory's newest checkpoint; `generate` names the checkpoint it loaded."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from mpitrain.checkpoint.resume import changes_table, check_allowed_changes, config_changes, resharded_line
from mpitrain.config import load_config, to_toml
from mpitrain.data.prepare import prepare_dataset
from mpitrain.errors import ConfigError
from tests.mpi_helpers import REPO_ROOT, describe, run_mpi
from tests.test_restart import run_launch

SETTINGS = ["precision.compute=float64", "train.steps=6", "logging.peak_flops=1e9", "train.sample_tokens=0"]
PREEMPTED = 75


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A 2-rank run (dp 2) of 6 steps stopped and saved at step 3, on a small real dataset (it has a tokenizer)."""
    root = tmp_path_factory.mktemp("resume-changes")
    data = root / "tiny.h5"
    prepare_dataset("python-stdlib", data, max_bytes=20_000, val_fraction=0.2)
    run_dir = root / "run"
    result = train(2, run_dir, data, "train.stop_at=3")
    assert result.returncode == PREEMPTED, describe(result)
    return run_dir, data


def train(n, run_dir, data, *overrides, args=()):
    command = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir)]
    for setting in [f"data.path={data}", *SETTINGS, *overrides]:
        command += ["--set", setting]
    return run_mpi(n, [*command, *args], timeout=120)


@pytest.fixture
def run_copy(stopped, tmp_path):
    run_dir, data = stopped
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run", data


def test_another_train_steps_is_refused_naming_the_key_and_accepted_when_allowed(run_copy):
    run_dir, data = run_copy
    refused = train(2, run_dir, data, "train.steps=8", args=["--resume", "auto"])
    errors = [line for line in refused.stderr.splitlines() if "ERROR" in line]
    assert refused.returncode == 1 and len(errors) == 1, describe(refused)
    assert "train.steps changed" in errors[0] and "--allow-changes train.steps" in errors[0], describe(refused)
    assert "Abort(" not in refused.stderr and "step    4/" not in refused.stdout
    table = refused.stdout.splitlines()
    assert any(line.split() == ["schedule", "train.steps", "6", "8"] for line in table), describe(refused)
    assert any(line.split() == ["other", "train.stop_at", "3", "0"] for line in table), describe(refused)
    assert (run_dir / "checkpoints" / "step_00000003" / "COMMITTED").is_file()  # a refusal touches nothing
    accepted = train(2, run_dir, data, "train.steps=8", args=["--resume", "auto", "--allow-changes", "train.steps"])
    assert accepted.returncode == 0 and "resumed from" in accepted.stdout, describe(accepted)
    assert (run_dir / "checkpoints" / "step_00000008" / "COMMITTED").is_file()


def test_launch_passes_allow_changes_through(run_copy):
    run_dir, data = run_copy
    settings = [arg for setting in [f"data.path={data}", *SETTINGS, "optim.lr=1e-2"] for arg in ("--set", setting)]
    refused = run_launch(["-n", "2", "configs/tiny.toml", "--out", str(run_dir), *settings, "--resume", "auto"], {})
    assert refused.returncode == 1 and "optim.lr changed" in refused.stderr, describe(refused)
    accepted = run_launch(["-n", "2", "configs/tiny.toml", "--out", str(run_dir), *settings, "--resume", "auto",
                           "--allow-changes", "optim.lr"], {})
    assert accepted.returncode == 0 and "resumed from" in accepted.stdout, describe(accepted)


def test_a_resume_under_another_layout_says_it_reshards_and_a_run_directory_resumes_its_newest(run_copy):
    run_dir, data = run_copy
    result = train(2, run_dir, data, "parallel.tp=2", args=["--resume", str(run_dir)])
    assert result.returncode == 0, describe(result)
    resharded = "resharded: checkpoint saved under dp=2 tp=1 pp=1 cp=1 ep=1 zero=0, now dp=1 tp=2 pp=1 cp=1 ep=1 zero=0"
    assert resharded in result.stdout, describe(result)
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000003'} at step 3" in result.stdout, describe(result)
    one_rank = train(1, run_dir, data, args=["--resume", str(run_dir / "checkpoints")])  # dp 2 -> dp 1
    assert "resharded: checkpoint saved under dp=1 tp=2" in one_rank.stdout and "now dp=1 tp=1" in one_rank.stdout
    assert one_rank.returncode == 0 and "step_00000006" in one_rank.stdout, describe(one_rank)


def test_resume_from_a_run_directory_without_checkpoints_is_one_line(tmp_path, stopped):
    _, data = stopped
    (tmp_path / "empty").mkdir()
    result = train(2, tmp_path / "run", data, args=["--resume", str(tmp_path / "empty")])
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert result.returncode == 1 and len(errors) == 1 and "no committed checkpoint at" in errors[0], describe(result)
    assert "interrupted save" not in result.stderr and not (tmp_path / "run").exists()


def test_generate_names_the_checkpoint_it_loaded(stopped):
    run_dir, _ = stopped
    result = subprocess.run([sys.executable, "-m", "mpitrain", "generate", str(run_dir), "--tokens", "3"],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"checkpoint: loaded {run_dir / 'checkpoints' / 'step_00000003'} (step 3)" in result.stderr


# ----------------------------------------------------------------------------- the pieces, without MPI
def test_changes_are_grouped_and_only_meaning_keys_are_refused():
    saved = load_config("configs/tiny.toml", ["parallel.dp=2"])
    now = load_config("configs/tiny.toml", ["parallel.dp=1", "parallel.tp=2", "optim.warmup_steps=5",
                                            "train.global_batch=16", "precision.compute=float64",
                                            "train.stop_at=4", "checkpoint.every=2", "fault.sdc_every=3"])
    changes = {change.key: change for change in config_changes(to_toml(saved), now)}
    assert {key: change.group for key, change in changes.items()} == {
        "parallel.dp": "layout", "parallel.tp": "layout", "optim.warmup_steps": "schedule",
        "train.global_batch": "batch", "precision.compute": "precision", "train.stop_at": "other",
        "checkpoint.every": "other", "fault.sdc_every": "other"}
    assert sorted(key for key, change in changes.items() if change.changes_meaning) == \
        ["optim.warmup_steps", "train.global_batch"]
    groups = [line.split()[0] for line in changes_table(list(changes.values()), "step_00000003")[2:]]
    assert groups == sorted(groups, key=["schedule", "batch", "layout", "precision", "other"].index)
    assert resharded_line({"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0}, now).startswith(
        "resharded: checkpoint saved under dp=2 tp=1")
    assert resharded_line({"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0}, saved) is None
    assert config_changes(to_toml(saved), saved) == []


def test_a_key_missing_from_an_older_checkpoint_counts_as_its_default():
    cfg = load_config("configs/tiny.toml")
    older = "\n".join(line for line in to_toml(cfg).splitlines() if not line.startswith("batch_rampup"))
    assert config_changes(older, cfg) == []


def test_allow_changes_takes_config_keys_only():
    assert check_allowed_changes(["train.steps", "optim.lr,optim.min_lr"]) == ["train.steps", "optim.lr",
                                                                              "optim.min_lr"]
    with pytest.raises(ConfigError, match="--allow-changes train.step: not a config key; did you mean train.steps"):
        check_allowed_changes(["train.step"])
