"""Bad steps: a non-finite gradient or a loss spike skips the update on every rank; K in a row roll back to the last
checkpoint and skip the data batches since it (float64, 2 ranks, configs/tiny.toml on synthetic data)."""
from __future__ import annotations

import json
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.checkpoint.store import Checkpoint, committed_checkpoints
from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.resilience.faults import FaultPlan, parse_faults
from mpitrain.resilience.guard import (
    GOOD,
    NONFINITE_GRAD,
    NONFINITE_LOSS,
    ROLLBACKS_TO_ONE_CHECKPOINT,
    SPIKE,
    TOLD_TO_SKIP,
    BadStepGuard,
    TrainingDiverged,
    is_spike,
)
from tests.mpi_helpers import describe, run_mpi

BASE = ["data.synthetic=true", "precision.compute=float64", "logging.peak_flops=1e9", "train.log_every=1"]


def train(run_dir, *overrides, fault="", expect=0, resume=None, n=2):
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir)]
    for setting in [*BASE, *overrides]:
        args += ["--set", setting]
    if resume:
        args += ["--resume", str(resume)]
    result = run_mpi(n, args, timeout=180, env={"MPITRAIN_FAULT": fault})
    assert result.returncode == expect, describe(result)
    return result


def rows(run_dir) -> list[dict]:
    """metrics.jsonl, with "step" counted from 1 (as the console and the checkpoints count) whatever the file says."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = records[0]["step"] if records else 1
    return [{**r, "step": r["step"] - first + 1} for r in records]


def final_state(run_dir) -> dict:
    checkpoint = Checkpoint.open(committed_checkpoints(run_dir / "checkpoints")[-1])
    return {(kind, name): checkpoint.read_box(kind, name, (0,) * len(info["global_shape"]), info["global_shape"],
                                              np.float64)
            for name, info in checkpoint.tensors().items() for kind in ("param", "exp_avg", "exp_avg_sq")}


# ----------------------------------------------------------------------------- units
def test_a_spike_is_a_loss_far_above_a_full_window_of_good_losses():
    window = deque([3.0, 3.1, 2.9, 3.0], maxlen=4)  # mean 3.0, population std ~0.0707
    assert is_spike(3.5, window, zscore=4.0)
    assert not is_spike(3.2, window, zscore=4.0)  # z ~ 2.8
    assert not is_spike(2.0, window, zscore=4.0)  # far below is progress, not a spike
    assert not is_spike(3.5, window, zscore=0.0)  # 0 = off
    assert not is_spike(9.0, deque([3.0, 3.1], maxlen=4), zscore=4.0)  # window not full yet
    assert not is_spike(9.0, deque([3.0] * 4, maxlen=4), zscore=4.0)  # no spread: no z-score


class OneRank:
    """A world of one rank: its all-reduce returns the local value."""
    def all_reduce_scalar(self, x, op="sum"):
        return x

    def all_reduce_bits(self, bits):
        return bits


def make_guard(fault="", **fault_cfg):
    cfg = SimpleNamespace(**{"skip_steps": [], "spike_zscore": 0.0, "spike_window": 3, "max_bad_steps": 2,
                             **fault_cfg})
    return BadStepGuard(cfg, OneRank(), FaultPlan(parse_faults(fault), rank=0))


def test_verdicts_counters_and_rollback_due_over_a_loss_sequence():
    guard = make_guard(skip_steps=[2], spike_zscore=3.0)
    seen = []
    for done, (loss, norm) in enumerate([(3.0, 1.0), (3.0, 1.0), (3.1, 1.0), (2.9, 1.0), (3.0, 1.0), (6.0, 1.0),
                                         (3.0, float("nan")), (float("inf"), 1.0), (3.0, 1.0)], start=1):
        verdict = guard.verdict(done, loss, norm)
        guard.record(verdict, loss)
        seen.append((verdict, guard.bad_in_a_row, guard.rollback_due))
    assert [v for v, _, _ in seen] == [GOOD, TOLD_TO_SKIP, GOOD, GOOD, GOOD, SPIKE, NONFINITE_GRAD, NONFINITE_LOSS,
                                       GOOD]
    assert [n for _, n, _ in seen] == [0, 0, 0, 0, 0, 1, 2, 3, 0]  # a skip asked for is not a bad step
    assert [r for _, _, r in seen] == [False] * 6 + [True, True, False]  # max_bad_steps = 2 in a row
    assert guard.skipped_steps == 4 and guard.bad_in_a_row == 0
    assert list(guard.good_losses) == [2.9, 3.0, 3.0]  # bad steps' losses stay out of the spike window


def test_injected_nan_strikes_once_per_step_number():
    guard = make_guard("nan:rank=0:step=3")
    grads = [SimpleNamespace(grads=np.ones(4))]
    guard.inject(2, grads)
    assert np.isfinite(grads[0].grads).all()
    guard.inject(3, grads)
    assert np.isnan(grads[0].grads).all()
    grads[0].grads[...] = 1.0
    guard.inject(3, grads)  # step 3 again after a rollback: the fault has struck already
    assert np.isfinite(grads[0].grads).all()


class FakeCheckpoints:
    """find_resume_point/restore as CheckpointManager answers them, for a directory holding one checkpoint."""
    def __init__(self, guard, saved_step):
        self.guard, self.saved_step, self.directory = guard, saved_step, "ckpts"

    def wait(self):
        pass

    def find_resume_point(self, spec):
        return None if self.saved_step is None else f"ckpts/step_{self.saved_step}"

    def restore(self, path):
        self.guard.load_state({"data_offset": 0, "skipped_steps": 0, "rollbacks": 0})  # what that checkpoint says
        return self.saved_step


def test_rollbacks_accumulate_the_offset_and_give_up_on_a_checkpoint_that_keeps_failing():
    guard = make_guard(max_bad_steps=2)
    checkpoints, lines = FakeCheckpoints(guard, 4), []
    for rollback in range(1, ROLLBACKS_TO_ONE_CHECKPOINT + 1):
        for done in (5, 6):
            guard.record(guard.verdict(done, float("nan"), 1.0), float("nan"))
        assert guard.rollback_due
        assert guard.roll_back(checkpoints, 6, lines.append) == 4
        assert (guard.data_offset, guard.rollbacks, guard.skipped_steps) == (2 * rollback, rollback, 2 * rollback)
        assert not guard.rollback_due
    assert lines[0].startswith("rollback: steps 5-6 were bad; restored ckpts/step_4 (step 4) and skipped the data of "
                            "steps 5-6")
    for done in (5, 6):
        guard.record(guard.verdict(done, float("nan"), 1.0), float("nan"))
    with pytest.raises(TrainingDiverged, match="after 3 rollbacks to ckpts/step_4"):
        guard.roll_back(checkpoints, 6, lines.append)
    with pytest.raises(TrainingDiverged, match="no committed checkpoint to roll back to"):
        guard.roll_back(FakeCheckpoints(guard, None), 6, lines.append)


def test_skip_steps_is_a_list_of_steps_from_one():
    assert load_config("configs/tiny.toml", ["fault.skip_steps=[3, 5]"]).fault.skip_steps == [3, 5]
    with pytest.raises(ConfigError, match="fault.skip_steps"):
        load_config("configs/tiny.toml", ["fault.skip_steps=[0]"])
    with pytest.raises(ConfigError, match="fault.skip_steps"):
        load_config("configs/tiny.toml", ["fault.skip_steps=3"])


# ----------------------------------------------------------------------------- MPI runs
LAYOUTS = {"dp2": [], "dp2-zero3": ["parallel.zero=3"], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_injected_nan_skips_that_update_exactly_like_a_run_told_to_skip_it(tmp_path, layout):
    """NaN gradients on rank 1 only (after the all-reduce: rank 0's norm is finite) must still skip on both."""
    settings = LAYOUTS[layout]
    plain = train(tmp_path / "plain", *settings)
    injected = train(tmp_path / "nan", *settings, fault="nan:rank=1:step=4")
    told = train(tmp_path / "told", *settings, "fault.skip_steps=[4]")
    assert "step 4: update skipped (non-finite gradient norm on some rank" in injected.stdout
    assert "step 4: update skipped (fault.skip_steps names it" in told.stdout
    assert "update skipped" not in plain.stdout
    a, b, c = rows(tmp_path / "nan"), rows(tmp_path / "told"), rows(tmp_path / "plain")
    assert [r["step"] for r in a] == list(range(1, 11))
    assert [r["skipped"] for r in a] == [r["step"] == 4 for r in a]
    assert [r["skipped_steps"] for r in a] == [int(r["step"] >= 4) for r in a]
    # float64 and the same reduction order: bitwise equal, step by step and in the final state
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["loss"] for r in a][:4] == [r["loss"] for r in c][:4]
    assert [r["loss"] for r in a][4:] != [r["loss"] for r in c][4:]  # the skip did change the run
    sa, sb = final_state(tmp_path / "nan"), final_state(tmp_path / "told")
    for key in sa:
        np.testing.assert_array_equal(sa[key], sb[key], err_msg=str(key))


def test_k_bad_steps_in_a_row_roll_back_and_skip_the_batches(tmp_path):
    """NaN at steps 5, 6, 7 with max_bad_steps = 3: restore step 4 and continue on the batches after step 7."""
    settings = ["checkpoint.every=4", "fault.max_bad_steps=3"]
    run = train(tmp_path / "rollback", *settings, fault="nan:rank=1:step=5;nan:rank=1:step=6;nan:rank=1:step=7")
    assert "rollback: steps 5-7 were bad; restored" in run.stdout and "step_00000004 (step 4)" in run.stdout
    assert "skipped the data of steps 5-7 (batch offset now 3)" in run.stdout
    logged = rows(tmp_path / "rollback")
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 10]
    after = logged[7:]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) and not r["skipped"] for r in after)
    assert after[-1]["rollbacks"] == 1 and after[-1]["skipped_steps"] == 3
    # The state restored is step 4's; the batch it meets next is step 8's: a run that skipped 5-7 (same state at
    # step 8, which sees batch 8) has exactly this loss at step 8.
    train(tmp_path / "skip", "fault.skip_steps=[5,6,7]")
    skipped = rows(tmp_path / "skip")
    assert after[0]["loss"] == skipped[7]["loss"]
    index = json.loads((tmp_path / "rollback" / "checkpoints" / "step_00000010" / "index.json").read_text())
    assert index["extra_state"] == {"data_offset": 3, "skipped_steps": 3, "rollbacks": 1}
    # A resume from the checkpoint written after the rollback sees the same data (the offset is restored).
    train(tmp_path / "resumed", *settings, resume=tmp_path / "rollback" / "checkpoints" / "step_00000008")
    assert [r["loss"] for r in rows(tmp_path / "resumed")] == [r["loss"] for r in logged[-2:]]


def test_bad_steps_with_no_checkpoint_to_roll_back_to_stop_with_one_line(tmp_path):
    run = train(tmp_path / "run", "fault.max_bad_steps=2", fault="nan:rank=0:step=2;nan:rank=0:step=3", expect=1)
    errors = [line for line in run.stderr.splitlines() if "ERROR" in line]
    assert errors and all("steps 2-3 were bad" in line and "no committed checkpoint to roll back to" in line
                          for line in errors), describe(run)
    assert "Traceback" not in run.stderr
    assert not committed_checkpoints(tmp_path / "run" / "checkpoints")


def test_loss_spikes_skip_exactly_the_steps_the_rule_names(tmp_path):
    """A low threshold on a short window: replaying the rule on metrics.jsonl's losses gives the skipped steps."""
    train(tmp_path / "run", "parallel.zero=1", "train.steps=14", "fault.spike_zscore=0.5", "fault.spike_window=3",
          "fault.max_bad_steps=100")
    logged = rows(tmp_path / "run")
    window, expected = deque(maxlen=3), []
    for record in logged:
        spike = is_spike(record["loss"], window, 0.5)
        expected.append(spike)
        if not spike:
            window.append(record["loss"])
    assert [r["skipped"] for r in logged] == expected
    assert any(expected) and not all(expected[3:])  # the threshold is low enough to bite, not to stop training


def test_a_checkpoint_saved_during_the_streak_is_a_rollback_target_without_the_streaks_updates():
    """Bad steps change nothing, so step 6's checkpoint (saved in the streak 5-7) is step 4's state: the data of
    steps 5-7 is out of the model either way; only step 7's batch has to be skipped by the offset."""
    guard, lines = make_guard(max_bad_steps=3), []
    for done in (5, 6, 7):
        guard.record(guard.verdict(done, 3.0, float("inf")), 3.0)
    assert guard.roll_back(FakeCheckpoints(guard, 6), 7, lines.append) == 6
    assert guard.data_offset == 1 and "skipped the data of steps 5-7 (batch offset now 1)" in lines[0]
