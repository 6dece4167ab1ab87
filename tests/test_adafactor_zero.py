"""Adafactor under ZeRO: a shard over several ranks cuts tensors, and Adafactor's factored row/column statistics and
per-tensor update clipping need whole ones (the run drifted 2.5e-5 off the one-process loss after one step in
float64), so the combination is refused with one line; at ZeRO-0 (every tensor whole) it is the one-process run."""
from __future__ import annotations

import pytest

from mpitrain.config import load_config, resolve_layout
from mpitrain.errors import ConfigError
from tests.mpi_helpers import describe, run_mpi
from tests.test_train_parity import assert_same_run, run_training

ADAFACTOR = ["data.synthetic=true", "precision.compute=float64", "train.steps=3", "optim.name=adafactor",
             "optim.adafactor_momentum=full"]


@pytest.mark.parametrize("optimizer, keys, why", [
    ("adafactor", ["parallel.zero=1", "parallel.dp=2"], r"parallel.zero >= 1 over 2 ranks.*set parallel.zero = 0"),
    ("adafactor", ["parallel.tp=2"], r"parallel.tp = 2.*set parallel.tp = 1"),
    ("adafactor", ["parallel.ep=2", "model.moe={experts = 4, top_k = 2}"], r"parallel.ep = 2.*set parallel.ep = 1"),
    ("adam8bit", ["parallel.tp=2"], r"parallel.tp = 2.*set parallel.tp = 1"),
])
def test_layouts_that_would_not_match_one_process_are_refused_naming_the_keys(optimizer, keys, why):
    cfg = load_config("configs/tiny.toml", [f"optim.name={optimizer}", *keys])
    with pytest.raises(ConfigError, match=f"optim.name = '{optimizer}' with {why} or optim.name = adamw"):
        resolve_layout(cfg, 2)
    resolve_layout(load_config("configs/tiny.toml", [f"optim.name={optimizer}", "parallel.zero=0"]), 2)  # dp 2


def test_the_planner_does_not_propose_what_the_trainer_refuses():
    from mpitrain.plan.clusters import load_cluster
    from mpitrain.plan.search import search
    cfg = load_config("configs/tiny.toml", ["optim.name=adafactor"])
    found = search(cfg, load_cluster("h100"), 4)
    layouts = [r["layout"] for r in found["fits"]]
    assert layouts and all(lay["zero"] == 0 or lay["dp"] * lay["cp"] == 1 for lay in layouts)
    assert all(lay["tp"] == 1 for lay in layouts)
    assert any("adafactor" in why for why in found["refused"])


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
