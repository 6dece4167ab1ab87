"""Resume never loses or mixes up work: branching and fallback save the retrained steps, broken or foreign checkpoints
are refused or set aside (never picked, never the reason retention deletes a good one), `generate` verifies what it
loads, metrics rows are counted from 1 once each, and an unwritable checkpoint.dir is found before step 1."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mpitrain.checkpoint.resume import (
    choose_checkpoint,
    model_mismatch,
    set_aside_newer,
    trim_metrics,
    verified_checkpoint,
)
from mpitrain.checkpoint.store import Checkpoint, CheckpointError, clean, commit, committed_checkpoints
from mpitrain.config import Config, ModelConfig, to_toml
from tests.mpi_helpers import REPO_ROOT, describe
from tests.test_checkpoint import PREEMPTED, train
from tests.test_train_parity import dataset  # noqa: F401 (fixture)


def names(paths):
    return [p.name for p in paths]


def corrupt(shard):
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x40
    shard.write_bytes(bytes(data))


def verify_all(checkpoint_dir):
    """Every committed checkpoint of the directory is whole (what `ckpt verify` checks)."""
    for path in committed_checkpoints(checkpoint_dir):
        opened = Checkpoint.open(path)
        opened.verify_files()
        opened.verify_coverage()


def params(path):
    checkpoint = Checkpoint.open(path)
    return {name: checkpoint.read_box("param", name, (0,) * len(info["global_shape"]), info["global_shape"],
                                      np.float64) for name, info in checkpoint.tensors().items()}


def metric_steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset):
    """A 2-rank run of 10 steps saved at steps 5 and 10; tests copy it before changing anything."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train(2, run_dir, dataset, "checkpoint.every=5")
    assert names(committed_checkpoints(run_dir / "checkpoints")) == ["step_00000005", "step_00000010"]
    return run_dir


@pytest.fixture
def run_copy(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def generate(*args):
    return subprocess.run([sys.executable, "-m", "mpitrain", "generate", *map(str, args), "--tokens", "3"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)


# ----------------------------------------------------------------------------- defect 1: the retrained steps are saved
def test_a_branch_from_an_older_checkpoint_saves_its_own_steps_and_sets_the_old_future_aside(run_copy, dataset):
    checkpoints = run_copy / "checkpoints"
    old_final = params(checkpoints / "step_00000010")
    out = train(2, run_copy, dataset, "checkpoint.every=5", "optim.lr=1e-2", resume=str(checkpoints / "step_00000005"),
                extra=["--allow-changes", "optim.lr"])
    assert "already saved" not in out.stdout, describe(out)
    assert names(committed_checkpoints(checkpoints)) == ["step_00000005", "step_00000010"]
    verify_all(checkpoints)
    new_final = Checkpoint.open(checkpoints / "step_00000010")
    assert "lr = 0.01" in new_final.index["config"]  # the branch's state, not the old run's
    assert any(not np.array_equal(old_final[name], value) for name, value in params(new_final.path).items())
    # the abandoned future is kept whole, out of reach of resume, generate and retention, and said so in one line
    aside = checkpoints / "set_aside" / "beyond_step_00000005" / "step_00000010"
    assert "lr = 0.003" in Checkpoint.open(aside).index["config"]
    Checkpoint.open(aside).verify_files()
    assert sum("moved step_00000010 (beyond step 5" in line for line in out.stdout.splitlines()) == 1, describe(out)
    assert (checkpoints / "latest").read_text().strip() == "step_00000010"
    assert metric_steps(run_copy) == list(range(1, 11))


def test_saving_every_step_keeps_the_previous_checkpoints_in_place(tmp_path, dataset):
    # before the fix each save set the previous step's checkpoint aside first: a job killed between that move and
    # the commit of the new one left no checkpoint to resume from
    run_dir = tmp_path / "run"
    out = train(2, run_dir, dataset, "checkpoint.every=1", "checkpoint.keep=3", "train.steps=4")
    checkpoints = run_dir / "checkpoints"
    assert names(committed_checkpoints(checkpoints)) == ["step_00000002", "step_00000003", "step_00000004"]
    assert not (checkpoints / "set_aside").exists() and "checkpoint: moved" not in out.stdout, describe(out)


def test_set_aside_at_a_save_takes_a_foreign_checkpoint_of_that_step_and_leaves_the_older_ones(tmp_path):
    fake_checkpoints(tmp_path, [1, 2, 3, 5])
    folder = set_aside_newer(tmp_path, 3, None, lambda text: None)  # what a save of step 3 does before its commit
    assert names(committed_checkpoints(tmp_path)) == ["step_00000001", "step_00000002"]
    assert names(committed_checkpoints(folder)) == ["step_00000003", "step_00000005"]


def test_fallback_past_a_corrupt_newest_checkpoint_replaces_it_and_retention_keeps_the_good_ones(tmp_path, dataset):
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    settings = ["checkpoint.every=2", "checkpoint.keep=2"]
    train(2, run_dir, dataset, *settings, "train.stop_at=6", expect=PREEMPTED)
    assert names(committed_checkpoints(checkpoints)) == ["step_00000004", "step_00000006"]
    corrupt(checkpoints / "step_00000006" / "rank_00001.h5")
    out = train(2, run_dir, dataset, *settings, "train.stop_at=8", resume="auto", expect=PREEMPTED)
    assert "resumed from" in out.stdout and "step_00000004" in out.stdout, describe(out)
    # before the fix: step 6 stayed the corrupt one and the save of step 8 deleted the good step 4
    assert names(committed_checkpoints(checkpoints)) == ["step_00000006", "step_00000008"]
    verify_all(checkpoints)
    aside = committed_checkpoints(checkpoints / "set_aside" / "beyond_step_00000004")
    assert names(aside) == ["step_00000006"]
    with pytest.raises(CheckpointError, match="rank_00001.h5"):
        Checkpoint.open(aside[0]).verify_files()


def test_a_fresh_start_in_a_used_directory_does_not_leave_the_old_run_as_its_future(run_copy, dataset):
    out = train(2, run_copy, dataset, "train.steps=3", "optim.lr=1e-2")
    checkpoints = run_copy / "checkpoints"
    assert names(committed_checkpoints(checkpoints)) == ["step_00000003"]  # `--resume auto` now takes this run
    assert names(committed_checkpoints(checkpoints / "set_aside" / "beyond_step_00000000")) == \
        ["step_00000005", "step_00000010"]
    assert "moved step_00000005, step_00000010" in out.stdout, describe(out)


# ----------------------------------------------------------------------------- defect 3: generate verifies
def test_generate_falls_back_past_a_corrupt_newest_checkpoint_of_a_run(run_copy):
    corrupt(run_copy / "checkpoints" / "step_00000010" / "rank_00000.h5")
    result = generate(run_copy)
    assert result.returncode == 0 and result.stdout.startswith("def "), result.stderr
    assert "step_00000010/rank_00000.h5" in result.stderr and "falling back" in result.stderr
    assert verified_checkpoint(run_copy, echo=lambda text: None).step == 5


@pytest.mark.parametrize("damage", ["flip", "remove"])
def test_generate_from_a_damaged_checkpoint_fails_in_one_line_naming_the_file(run_copy, damage):
    shard = run_copy / "checkpoints" / "step_00000010" / "rank_00001.h5"
    if damage == "flip":
        corrupt(shard)
    else:
        shard.unlink()
    result = generate(shard.parent)
    assert result.returncode == 1, result.stdout
    assert result.stderr.strip().count("\n") == 0 and str(shard) in result.stderr, result.stderr
    assert ("corrupt" if damage == "flip" else "missing") in result.stderr


def test_generate_refuses_a_run_whose_every_checkpoint_is_broken(run_copy):
    for step in ("step_00000005", "step_00000010"):
        corrupt(run_copy / "checkpoints" / step / "rank_00000.h5")
    result = generate(run_copy)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "every committed checkpoint" in result.stderr.splitlines()[-1]


# ----------------------------------------------------------------------------- defect 4: another model is refused
def test_resume_with_another_model_is_refused_naming_the_keys_and_keeps_every_checkpoint(run_copy, dataset):
    out = train(2, run_copy, dataset, "checkpoint.every=5", "model.n_layer=1", "model.d_ff=64", resume="auto",
                expect=1)
    why = "model.n_layer = 2 there, 1 here; model.d_ff = 128 there, 64 here"
    assert out.stderr.count(why) == 1, describe(out)  # the same verdict on both ranks, said once
    assert "Traceback" not in out.stderr and "step " not in out.stdout
    assert names(committed_checkpoints(run_copy / "checkpoints")) == ["step_00000005", "step_00000010"]
    assert not (run_copy / "checkpoints" / "set_aside").exists()


def test_resume_refuses_a_checkpoint_with_tensors_the_model_does_not_use_or_lacks(run_copy, dataset):
    newest = run_copy / "checkpoints" / "step_00000010"
    index = json.loads((newest / "index.json").read_text())
    dropped = sorted(index["tensors"])[0]
    index["tensors"]["extra.w"] = index["tensors"].pop(dropped)
    (newest / "index.json").write_text(json.dumps(index))
    out = train(2, run_copy, dataset, resume=str(newest), expect=1)
    assert f"missing there: {dropped}" in out.stderr and "unused here: extra.w" in out.stderr, describe(out)


def test_model_keys_compare_effective_values_and_only_what_shapes_the_model():
    class Stored:
        path = REPO_ROOT / "step_00000001"

        def __init__(self, **model):
            cfg = Config()
            for key, value in model.items():
                setattr(cfg.model, key, value)
            self.index = {"config": to_toml(cfg)}

    assert model_mismatch(Stored(d_ff=0, n_kv_head=0), ModelConfig(d_ff=256, n_kv_head=4, init_std=0.5)) is None
    assert model_mismatch(Stored(arch="llama", seq_len=32), ModelConfig(arch="llama", seq_len=64)) is None
    assert "model.seq_len = 32 there, 64 here" in model_mismatch(Stored(seq_len=32), ModelConfig(seq_len=64))
    assert "model.arch = gpt2 there, llama here" in model_mismatch(Stored(), ModelConfig(arch="llama"))


def test_resume_auto_refuses_when_every_checkpoint_is_broken_instead_of_starting_over(run_copy, dataset):
    checkpoints = run_copy / "checkpoints"
    corrupt(checkpoints / "step_00000005" / "rank_00001.h5")
    (checkpoints / "step_00000010" / "rank_00000.h5").unlink()
    out = train(2, run_copy, dataset, "checkpoint.every=5", resume="auto", expect=1)
    error = [line for line in out.stderr.splitlines() if "every committed checkpoint" in line]
    assert len(error) == 1 and "step_00000005" in error[0] and "step_00000010" in error[0], describe(out)
    assert "step " not in out.stdout  # nothing trained, nothing saved, nothing deleted
    assert names(committed_checkpoints(checkpoints)) == ["step_00000005", "step_00000010"]


# ----------------------------------------------------------------------------- defect 7: metrics.jsonl
def test_metrics_count_steps_from_1_and_a_resumed_run_logs_each_step_once(tmp_path, dataset):
    run_dir = tmp_path / "run"
    first = train(2, run_dir, dataset, "train.stop_at=4", expect=PREEMPTED)
    assert metric_steps(run_dir) == [1, 2, 3, 4]
    assert "step     1/10" in first.stdout  # the console agrees with the rows
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.0}\n{"step": 6, "lo')  # rows of a run killed after the checkpoint at 4
    train(2, run_dir, dataset, resume="auto")
    assert metric_steps(run_dir) == list(range(1, 11))


def test_trim_metrics_keeps_the_steps_up_to_the_resume_point(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 8)) + '{"step": 8')
    trim_metrics(path, 4)
    assert [json.loads(line) for line in path.read_text().splitlines()] == \
        [{"step": s, "loss": s / 10} for s in range(1, 5)]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left


# ----------------------------------------------------------------------------- defect 5 (part): checkpoint.dir
def test_an_unwritable_checkpoint_dir_is_refused_before_step_1_on_every_rank(tmp_path, dataset):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = train(2, tmp_path / "run", dataset, f"checkpoint.dir={blocker / 'checkpoints'}", expect=1)
    lines = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(lines) == 1, describe(out)  # both ranks' verdict, said once
    for line in lines:
        assert "checkpoint.dir" in line and str(blocker / "checkpoints") in line and "Traceback" not in out.stderr
        assert "rank 0 on" in line and "rank 1 on" in line  # each rank tried on its own
    assert "step " not in out.stdout


# ----------------------------------------------------------------------------- the store-level pieces, no MPI
def fake_checkpoints(directory, steps):
    for step in steps:
        partial = directory / f"step_{step:08d}.partial"
        partial.mkdir(parents=True)
        commit(partial, directory / f"step_{step:08d}", {"step": step, "files": [], "tensors": {}})


def test_set_aside_moves_what_lies_beyond_and_retention_then_keeps_the_good_ones(tmp_path):
    fake_checkpoints(tmp_path, [2, 4, 6, 8])
    quiet = []
    folder = set_aside_newer(tmp_path, 4, tmp_path / "step_00000004", quiet.append)
    assert names(committed_checkpoints(tmp_path)) == ["step_00000002", "step_00000004"]
    assert names(committed_checkpoints(folder)) == ["step_00000006", "step_00000008"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000004" and len(quiet) == 1
    fake_checkpoints(tmp_path, [6])
    clean(tmp_path, keep=2)
    assert names(committed_checkpoints(tmp_path)) == ["step_00000004", "step_00000006"]
    assert names(committed_checkpoints(folder)) == ["step_00000006", "step_00000008"]  # untouched by retention
    # the same step from somewhere else is not this run's past either; a second set-aside gets its own folder
    again = set_aside_newer(tmp_path, 6, tmp_path / "elsewhere" / "step_00000006", quiet.append)
    assert again.name == "beyond_step_00000006" and names(committed_checkpoints(again)) == ["step_00000006"]
    assert set_aside_newer(tmp_path, 6, None, quiet.append) is None and len(quiet) == 2


def test_choose_checkpoint_names_every_broken_one_when_none_is_left(tmp_path):
    fake_checkpoints(tmp_path, [1, 2])
    for step in (1, 2):
        index = tmp_path / f"step_{step:08d}" / "index.json"
        index.write_text(json.dumps({"step": step, "tensors": {}, "files": [{"file": "rank_00000.h5", "bytes": 1,
                                                                            "sha256": "0", "pieces": []}]}))
    with pytest.raises(CheckpointError, match="every committed checkpoint .* step_00000002 .* step_00000001"):
        choose_checkpoint(tmp_path, "auto", echo=lambda text: None)
    assert choose_checkpoint(tmp_path / "empty", "auto") is None
