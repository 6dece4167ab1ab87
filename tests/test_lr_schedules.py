"""Learning-rate schedules (optim.schedule): cosine exactly as before, linear, constant and warmup-stable-decay with
its three decay shapes, each at its boundary steps and monotone where it should be; the config's checks; and a run
that logs the schedule's values."""
from __future__ import annotations

import json
import math
from itertools import pairwise

import pytest

from mpitrain.config import load_config
from mpitrain.config_rules import DECAY_SHAPES, LR_SCHEDULES
from mpitrain.errors import ConfigError
from mpitrain.optim.schedule import lr_at, wsd_decay_steps
from tests.mpi_helpers import describe, run_mpi

LR, MIN_LR, WARMUP, TOTAL = 1e-3, 1e-4, 5, 25


def cosine_before(step, lr, min_lr, warmup_steps, total_steps):
    """The schedule as this code computed it before optim.schedule existed, kept here verbatim."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def lrs(schedule, shape="linear", fraction=0.2, warmup=WARMUP, total=TOTAL):
    return [lr_at(s, LR, MIN_LR, warmup, total, schedule, fraction, shape) for s in range(total)]


def test_cosine_is_bitwise_the_schedule_before():
    for lr, min_lr, warmup, total in [(1e-3, 1e-4, 5, 20), (3e-3, 3e-4, 2, 10), (6e-4, 0.0, 0, 7), (1.0, 1.0, 3, 3),
                                      (2.5e-4, 1e-5, 100, 1000)]:
        for step in range(total + 2):
            before = cosine_before(step, lr, min_lr, warmup, total)
            assert lr_at(step, lr, min_lr, warmup, total) == before  # the default: no argument changes it
            assert lr_at(step, lr, min_lr, warmup, total, "cosine", 0.5, "sqrt") == before  # wsd keys ignored


def test_warm_up_is_shared_by_every_schedule():
    for schedule in LR_SCHEDULES:
        values = lrs(schedule)
        assert values[0] == pytest.approx(LR / WARMUP, rel=1e-15)  # step 1
        assert values[WARMUP - 1] == LR  # the end of the warm-up is the peak
        assert all(a < b for a, b in pairwise(values[:WARMUP]))


def test_linear_boundaries_and_midpoint():
    values = lrs("linear")
    assert values[WARMUP] == LR  # the decay's first step starts at the peak, as cosine's does
    decay = TOTAL - WARMUP
    assert values[WARMUP + decay // 2] == pytest.approx(MIN_LR + (LR - MIN_LR) * 0.5, rel=1e-14)
    assert values[-1] == pytest.approx(MIN_LR + (LR - MIN_LR) / decay, rel=1e-14)  # one step short of min_lr
    assert lr_at(TOTAL, LR, MIN_LR, WARMUP, TOTAL, "linear") == pytest.approx(MIN_LR, rel=1e-14)
    assert all(a > b for a, b in pairwise(values[WARMUP:]))


def test_constant_holds_the_peak_after_the_warm_up():
    assert lrs("constant")[WARMUP:] == [LR] * (TOTAL - WARMUP)
    assert lrs("constant", warmup=0) == [LR] * TOTAL


@pytest.mark.parametrize("shape", DECAY_SHAPES)
def test_wsd_is_stable_then_decays_over_the_last_fraction(shape):
    values = lrs("wsd", shape, fraction=0.2)
    decay = wsd_decay_steps(TOTAL, 0.2)
    first_decay = TOTAL - decay
    assert decay == 5 and first_decay == 20
    assert values[WARMUP:first_decay] == [LR] * (first_decay - WARMUP)  # stable, up to the step before the decay
    assert MIN_LR < values[first_decay] < LR  # the decay's first step is already below the peak
    assert values[-1] == MIN_LR  # the last step is annealed to min_lr exactly
    assert all(a > b for a, b in pairwise(values[first_decay - 1:]))


def test_wsd_shapes_at_the_middle_of_the_decay():
    middle = {"linear": 0.5, "cosine": 0.5, "sqrt": 1 - math.sqrt(0.5)}  # the share of (lr - min_lr) left at p = 1/2
    quarter = {"linear": 0.75, "cosine": 0.5 * (1 + math.cos(math.pi / 4)), "sqrt": 0.5}
    for shape in DECAY_SHAPES:
        values = lrs("wsd", shape, fraction=0.4, warmup=2, total=20)  # decay over steps 12..19: p = 1/8 .. 1
        assert values[13] == pytest.approx(MIN_LR + (LR - MIN_LR) * quarter[shape], rel=1e-14), shape
        assert values[15] == pytest.approx(MIN_LR + (LR - MIN_LR) * middle[shape], rel=1e-14), shape
    assert lrs("wsd", "sqrt", 0.4, 2, 20)[12] < lrs("wsd", "linear", 0.4, 2, 20)[12]  # 1-sqrt drops fastest at first


def test_wsd_decay_steps_round_and_never_vanish():
    assert wsd_decay_steps(100, 0.2) == 20 and wsd_decay_steps(10, 0.25) == 2 and wsd_decay_steps(3, 0.1) == 1
    values = [lr_at(s, LR, MIN_LR, 0, 3, "wsd", 0.1) for s in range(3)]
    assert values == [LR, LR, MIN_LR]


@pytest.mark.parametrize("override, message", [
    ("optim.schedule='cosin'", "config key optim.schedule = 'cosin' is not allowed"),
    ("optim.decay_shape='exp'", "config key optim.decay_shape = 'exp' is not allowed"),
    ("optim.decay_fraction=0", "config key optim.decay_fraction = 0.0 must be in (0, 1]"),
    ("optim.decay_fraction=1.5", "config key optim.decay_fraction = 1.5 must be in (0, 1]"),
])
def test_bad_schedule_keys_are_named(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config("configs/tiny.toml", [override])


def test_wsd_decay_must_fit_after_the_warm_up():
    load_config("configs/tiny.toml", ["optim.schedule='wsd'", "optim.decay_fraction=0.8"])  # 2 + 8 of 10 steps
    with pytest.raises(ConfigError, match="optim.decay_fraction = 0.9: the wsd decay's 9 steps and "
                                          "optim.warmup_steps = 2 do not fit in train.steps = 10"):
        load_config("configs/tiny.toml", ["optim.schedule='wsd'", "optim.decay_fraction=0.9"])


def test_a_run_logs_the_wsd_schedule(tmp_path):
    settings = ["data.synthetic=true", "logging.peak_flops=1e9", "train.log_every=1", "optim.schedule=wsd",
                "optim.decay_fraction=0.3", "optim.decay_shape=sqrt"]
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path / "run")]
    for setting in settings:
        args += ["--set", setting]
    result = run_mpi(1, args, timeout=180)
    assert result.returncode == 0, describe(result)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 11))
    expected = [lr_at(s, 3e-3, 3e-4, 2, 10, "wsd", 0.3, "sqrt") for s in range(10)]  # configs/tiny.toml's optim
    assert [row["lr"] for row in rows] == expected
    assert expected[2:7] == [3e-3] * 5 and expected[-1] == 3e-4
    assert 'schedule = "wsd"' in (tmp_path / "run" / "config.toml").read_text()
