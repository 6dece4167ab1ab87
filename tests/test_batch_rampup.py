"""train.batch_rampup: the global batch grown as Megatron's --rampup-batch-size grows it. The sizes against Megatron's
formula stepped sample by sample; the config's checks; the sampler's rows as a pure function of the step; and real
runs: dp 2, ZeRO-2 and a 2-stage pipeline give the one-process ramped run in float64, a run stopped mid-ramp and
resumed is bitwise the uninterrupted one, and metrics.jsonl records each step's global batch."""
from __future__ import annotations

import json
from fractions import Fraction
from itertools import pairwise

import numpy as np
import pytest

from mpitrain.config import load_config, resolve_layout
from mpitrain.data.dataset import BatchSampler
from mpitrain.errors import ConfigError
from mpitrain.optim.schedule import BatchRamp, make_batch_ramp
from tests.test_checkpoint import small_epochs  # noqa: F401 (fixture)
from tests.test_data import SEQ_LEN, counting  # noqa: F401 (fixture)
from tests.test_train_parity import RTOL, run_training


def megatron_sizes(start, increment, ramp_samples, global_batch, steps, exact=True):
    """Each step's batch as Megatron's RampupBatchsizeNumMicroBatchesCalculator.update gives it, called with the
    samples consumed so far before every step: in floating point as it computes it, or with exact fractions. (With
    start = global_batch Megatron divides by zero increments; the batch is simply constant.)"""
    increments = (global_batch - start) // increment
    if increments == 0:
        return [global_batch] * steps
    per_increment = Fraction(ramp_samples, increments) if exact else ramp_samples / increments
    consumed, sizes = 0, []
    for _ in range(steps):
        if consumed > ramp_samples:
            size = global_batch
        else:
            size = start + int(consumed / per_increment) * increment
        sizes.append(size)
        consumed += size
    return sizes


RAMPS = [(4, 4, 40, 16), (32, 32, 3_000, 512), (16, 8, 1_000, 96), (2, 2, 7, 12), (8, 8, 1, 64), (16, 16, 999, 16)]


@pytest.mark.parametrize("start, increment, ramp_samples, global_batch", RAMPS)
def test_sizes_follow_megatrons_formula(start, increment, ramp_samples, global_batch):
    ramp = BatchRamp(start, increment, ramp_samples, global_batch)
    steps = 400
    sizes = [ramp.batch_size(s) for s in range(steps)]
    assert sizes == megatron_sizes(start, increment, ramp_samples, global_batch, steps)
    assert sizes == megatron_sizes(start, increment, ramp_samples, global_batch, steps, exact=False)
    assert [ramp.samples_before(s) for s in range(steps)] == np.cumsum([0] + sizes[:-1]).tolist()
    assert sizes[0] == start and sizes[-1] == global_batch
    assert all(a <= b for a, b in pairwise(sizes))
    assert ramp.sizes() == sorted(set(sizes))


def test_the_example_ramp_step_by_step():
    """[4, 4, 40] to 16: an increment every 40/3 samples; the batch is 4 until 16 samples are consumed, etc."""
    ramp = make_batch_ramp([4, 4, 40], 16)
    assert [ramp.batch_size(s) for s in range(10)] == [4, 4, 4, 4, 8, 8, 12, 16, 16, 16]
    assert [ramp.samples_before(s) for s in range(10)] == [0, 4, 8, 12, 16, 24, 32, 44, 60, 76]
    assert ramp.samples_before(10**9) == 60 + (10**9 - 8) * 16  # far steps cost a lookup, not a walk
    assert make_batch_ramp([], 16) is None
    assert "global batch 4 -> 8 -> 12 -> 16 sequences, the full 16 from step 8" in ramp.describe()


def resolved(*overrides, world=2):
    cfg = load_config("configs/tiny.toml", list(overrides))
    resolve_layout(cfg, world)
    return cfg


@pytest.mark.parametrize("overrides, message", [
    (["train.batch_rampup=[4, 4]"], r"train\.batch_rampup = \[4, 4\] must be \[start, increment, ramp_samples\]"),
    (["train.batch_rampup=[0, 4, 40]"], "start, increment and ramp_samples must be > 0"),
    (["train.batch_rampup=[4, 4, 0]"], "start, increment and ramp_samples must be > 0"),
    (["train.batch_rampup=[12, 4, 40]"], r"train\.global_batch = 8 must be start = 12 plus a whole number"),
    (["train.global_batch=16", "train.batch_rampup=[4, 8, 40]"], "plus a whole number of increments of 8"),
    (["train.batch_rampup=[4, 4.5, 40]"], "must be a list of integers"),
])
def test_bad_ramps_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.toml", overrides)


def test_every_size_must_split_over_the_data_parallel_micro_batches():
    resolved("train.global_batch=16", "train.micro_batch=2", "train.batch_rampup=[4, 4, 40]")  # dp 2: 4s
    with pytest.raises(ConfigError, match=r"train\.batch_rampup = \[8, 2, 40\]: its global batch of 10 is not a "
                                          r"multiple of parallel\.dp \* train\.micro_batch = 2 \* 2 = 4"):
        resolved("train.global_batch=16", "train.micro_batch=2", "train.batch_rampup=[8, 2, 40]")
    with pytest.raises(ConfigError, match=r"parallel\.microbatches = 4 must be 0 with train\.batch_rampup"):
        resolved("train.global_batch=16", "train.micro_batch=2", "train.batch_rampup=[4, 4, 40]",
                 "parallel.microbatches=4")
    with pytest.raises(ConfigError, match="its global batch of 4 is 1 micro-batches, which the interleaved schedule "
                                          r"needs to be a multiple of parallel\.pp = 2"):
        resolved("train.global_batch=16", "train.micro_batch=4", "train.batch_rampup=[4, 4, 40]", "parallel.pp=2",
                 "parallel.schedule=interleaved", "parallel.virtual_stages=2", "model.n_layer=4", world=2)


def test_ramped_sampler_reads_the_samples_in_order(counting):
    """Sample g of the ramped run is sample g of the unramped order (a batch of 1 per step): the ramp only cuts the
    same stream into batches of growing size, and any rank reads its rows of step s alone."""
    ramp = BatchRamp(2, 2, 30, 8)
    ramped = BatchSampler(counting, "train", SEQ_LEN, 8, seed=5, ramp=ramp)
    one_by_one = BatchSampler(counting, "train", SEQ_LEN, 1, seed=5)
    for step in range(40):  # 100 windows: several epochs
        size, first = ramp.batch_size(step), ramp.samples_before(step)
        inputs, targets = ramped.global_batch_rows(step, slice(None))
        assert inputs.shape == (size, SEQ_LEN)
        expected = [one_by_one.global_batch_rows(first + row, [0]) for row in range(size)]
        assert np.array_equal(inputs, np.concatenate([e[0] for e in expected]))
        assert np.array_equal(targets, np.concatenate([e[1] for e in expected]))
        assert ramped.epoch_of(step) == first // 100
    with pytest.raises(IndexError, match="outside the global batch of 2"):
        ramped.global_batch_rows(0, [2])


# -- real runs, float64: the ramp 4 -> 8 -> 12 -> 16 of the example above over 8 steps
RAMP_SETTINGS = ["precision.compute=float64", "train.steps=8", "train.global_batch=16", "train.micro_batch=2",
                 "train.batch_rampup=[4, 4, 40]", "logging.peak_flops=1e9", "train.log_every=1",
                 "checkpoint.every=0"]
EXPECTED_BATCHES = [4, 4, 4, 4, 8, 8, 12, 16]


def ramped_run(n, run_dir, data, *overrides, resume=None, expect=0):
    return run_training(n, run_dir, [f"data.path={data}", *RAMP_SETTINGS, *overrides], resume=resume, expect=expect)


def assert_close_runs(reference, other):
    ref_metrics, ref_params = reference
    metrics, params = other
    assert [m["step"] for m in metrics] == [m["step"] for m in ref_metrics] == list(range(1, 9))
    for ref, got in zip(ref_metrics, metrics):
        assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL, abs=0), f"step {got['step']}"
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-9)
        assert got["global_batch"] == ref["global_batch"]
    for name, value in ref_params.items():
        err = np.linalg.norm(params[name] - value) / np.linalg.norm(value)
        assert err < RTOL, f"{name}: relative difference {err:.2e}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, small_epochs):
    return ramped_run(1, tmp_path_factory.mktemp("ramp") / "single", small_epochs)


def test_metrics_record_each_steps_global_batch(one_process):
    metrics, _ = one_process
    assert [m["global_batch"] for m in metrics] == EXPECTED_BATCHES == megatron_sizes(4, 4, 40, 16, 8)
    assert [m["batch_tokens"] for m in metrics] == [32 * b for b in EXPECTED_BATCHES]  # configs/tiny.toml: T = 32
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def test_the_first_steps_are_the_run_with_the_starting_batch(tmp_path, small_epochs, one_process):
    """Steps 1-4 read samples 0-15 four at a time either way, so a run with global_batch = 4 and no ramp is bitwise
    the ramped run there: the loss and its gradient are normalized by the step's batch, not train.global_batch's."""
    metrics, _ = ramped_run(1, tmp_path / "four", small_epochs, "train.batch_rampup=[]", "train.global_batch=4")
    def first_four(rows):
        return [(m["loss"], m["grad_norm"]) for m in rows[:4]]
    assert first_four(metrics) == first_four(one_process[0])
    assert metrics[4]["loss"] != one_process[0][4]["loss"]  # then the ramp's batch of 8 differs


@pytest.mark.parametrize("n, layout", [(2, []), (2, ["parallel.zero=2"]), (2, ["parallel.pp=2"]),
                                       (4, ["parallel.pp=2", "parallel.schedule=zb1p"])],
                         ids=["dp2", "zero2-dp2", "pp2", "zb1p-pp2-dp2"])
def test_ramped_layouts_match_the_one_process_run(tmp_path, small_epochs, one_process, n, layout):
    assert_close_runs(one_process, ramped_run(n, tmp_path / "run", small_epochs, *layout))


def test_stopped_mid_ramp_and_resumed_is_bitwise_the_whole_run(tmp_path, small_epochs):
    whole = ramped_run(2, tmp_path / "whole", small_epochs)
    ramped_run(2, tmp_path / "resumed", small_epochs, "train.stop_at=5", expect=75)  # step 5: the first batch of 8
    resumed = ramped_run(2, tmp_path / "resumed", small_epochs, resume="auto")
    assert [(m["step"], m["loss"], m["global_batch"]) for m in resumed[0]] == \
        [(m["step"], m["loss"], m["global_batch"]) for m in whole[0]]
    for name, value in whole[1].items():
        assert np.array_equal(resumed[1][name], value), name
    assert [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
            ] == list(range(1, 9))
