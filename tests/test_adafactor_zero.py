"""Adafactor under ZeRO: a shard over several ranks cuts tensors, and Adafactor's factored row/column statistics and
per-tensor update clipping need whole ones (the run drifted 2.5e-5 off the one-process loss after one step in
float64), so the combination is refused with one line; at ZeRO-0 (every tensor whole) it is the one-process run."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.optim.factory import make_optimizer
from tests.mpi_helpers import describe, run_mpi
from tests.test_train_parity import assert_same_run, run_training

ADAFACTOR = ["data.synthetic=true", "precision.compute=float64", "train.steps=3", "optim.name=adafactor",
             "optim.adafactor_momentum=full"]


def test_a_zero_shard_over_several_ranks_is_refused_naming_the_keys():
    optim = load_config("configs/tiny.toml", ["optim.name=adafactor"]).optim
    sharded = SimpleNamespace(sharded=True, group=SimpleNamespace(size=2), optimizer_segments=list)
    with pytest.raises(ConfigError, match=r"optim.name = 'adafactor' with parallel.zero >= 1 over 2 ranks.*"
                                          r"set parallel.zero = 0 or optim.name = adamw"):
        make_optimizer(optim, sharded)


def test_the_refusal_is_one_line_from_the_command(tmp_path):
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path / "run")]
    for setting in [*ADAFACTOR, "parallel.zero=1"]:
        args += ["--set", setting]
    result = run_mpi(2, args, timeout=120)
    assert result.returncode != 0, describe(result)
    assert "optim.name = 'adafactor' with parallel.zero >= 1" in result.stderr and "Traceback" not in result.stderr


def test_zero_0_over_two_ranks_is_the_one_process_run(tmp_path):
    """float64, 3 steps: every step's loss and the final parameters agree with one process (factored matrices whole
    in the one segment every rank updates)."""
    assert_same_run(run_training(1, tmp_path / "one", ADAFACTOR),
                    run_training(2, tmp_path / "two", [*ADAFACTOR, "parallel.zero=0"]))
