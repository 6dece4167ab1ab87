"""Fault attribution by replay (fault.attribute): a bad step computed again from its starting state is transient
(the replay is applied: the run is bitwise the uninterrupted one), genuine (bad alike everywhere: the step stays
skipped) or persistent (bad again on one replica only: its host is recorded to be excluded). Float64, 2 ranks,
configs/tiny.toml on synthetic data."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.resilience.attribution import (
    GENUINE,
    PERSISTENT,
    TRANSIENT,
    classify,
    flip_gradient_exponent,
    peer_suspects,
    same_loss,
)
from mpitrain.resilience.faults import FaultPlan, parse_faults
from mpitrain.resilience.faulty_hosts import faulty_hosts, read_faults
from mpitrain.state.strategy import squared_sum
from tests.mpi_helpers import describe, run_mpi

BASE = ["data.synthetic=true", "precision.compute=float64", "logging.peak_flops=1e9", "train.log_every=1",
        "fault.attribute=true"]


def train(run_dir, *overrides, fault="", n=2):
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir)]
    for setting in [*BASE, *overrides]:
        args += ["--set", setting]
    result = run_mpi(n, args, timeout=180, env={"MPITRAIN_FAULT": fault})
    assert result.returncode == 0, describe(result)
    return result


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def verdicts(run_dir) -> list[tuple]:
    return [(r["step"], r["rank"], r["kind"], r["verdict"]) for r in read_faults(run_dir)]


# ----------------------------------------------------------------------------- units
def replay(bad: bool, loss: float = 2.5, grad_norm: float = 0.75) -> dict:
    return {"bad": bad, "loss": loss, "grad_norm": grad_norm}


def test_classify_names_transient_genuine_and_persistent_faults():
    assert classify([replay(False), replay(False)])[:2] == (TRANSIENT, [])
    nan = float("nan")
    assert classify([replay(True, nan, nan), replay(True, nan, nan)])[:2] == (GENUINE, [])
    verdict, suspects, evidence = classify([replay(False), replay(True, 2.5, nan)])
    assert (verdict, suspects) == (PERSISTENT, [1])
    assert "rank 1: loss 2.5, grad norm nan" in evidence and "grad norm 0.75" in evidence
    # every rank bad but not alike: the odd one out of three is the suspect
    inf = float("inf")
    assert classify([replay(True, 2.5, inf), replay(True, 2.5, nan), replay(True, 2.5, inf)])[:2] == (PERSISTENT, [1])


def test_a_peer_check_names_the_replica_whose_own_loss_its_peer_does_not_reproduce():
    nan = float("nan")
    assert same_loss(nan, float("inf")) and same_loss(710.25, 710.25 * (1 + 1e-12))
    assert not same_loss(710.25, nan) and not same_loss(710.25, 710.5)
    # dp 3 x pp 2 (place = (pp rank, tp rank)): dp rank 0 of stage 1 found dp rank 1's sum differ
    checks = [{"rank": r, "dp": r % 3, "place": (r // 3, 0), "peer": (r % 3 + 1) % 3, "differs": r == 3}
              for r in range(6)]
    assert [suspect for suspect, _ in peer_suspects(checks)] == [4]


def test_sticky_faults_strike_every_computation_of_their_step_and_are_recorded_once(tmp_path):
    plan = FaultPlan(parse_faults("gradflip:rank=0:step=3:sticky=1;nan:rank=0:step=3"), rank=0,
                     record=tmp_path / "injected.jsonl")
    assert plan.due("gradflip", 3) and plan.due("gradflip", 3)  # the step and its replay
    assert plan.due("nan", 3) and not plan.due("nan", 3)  # not sticky: the replay is spared
    recorded = [json.loads(line) for line in (tmp_path / "injected.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in recorded] == [("gradflip", 3), ("nan", 3)]
    # a restarted attempt finds both struck
    assert not FaultPlan(parse_faults("gradflip:rank=0:step=3:sticky=1"), 0, tmp_path / "injected.jsonl")


def test_sticky_is_refused_for_faults_a_replay_does_not_compute_again():
    with pytest.raises(ConfigError, match="sticky in .kill:step=2:sticky=1. is for nan, gradflip, lossnan only"):
        parse_faults("kill:step=2:sticky=1")
    with pytest.raises(ConfigError, match="is not rank=N, step=N, factor=X, until=N or sticky=1"):
        parse_faults("nan:step=2:stuck=1")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_gradient_exponent_flip_overflows_the_squared_norm(dtype):
    grads = np.random.default_rng(0).normal(0, 1e-3, 1000).astype(dtype)
    segment = type("Segment", (), {"grads": grads})()
    flip_gradient_exponent([segment])
    with np.errstate(over="ignore"):
        assert np.isfinite(grads).all() and not np.isfinite(squared_sum(grads, [(0, grads.size)]))


def test_only_persistent_verdicts_name_a_host_to_exclude():
    records = [{"host": "a", "kind": "nonfinite_grad", "verdict": TRANSIENT},
               {"host": "b", "kind": "nonfinite_loss", "verdict": GENUINE},
               {"host": "c", "kind": "nonfinite_grad", "verdict": PERSISTENT}, {"host": "d", "kind": "hang"}]
    assert faulty_hosts(records) == ["c", "d"]


def test_attribution_needs_unsharded_gradients(tmp_path):
    with pytest.raises(ConfigError, match="fault.attribute needs parallel.zero = 0, got 1"):
        load_config("configs/tiny.toml", ["fault.attribute=true", "parallel.zero=1"])


# ----------------------------------------------------------------------------- MPI runs
LAYOUTS = {"dp2": [], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}
BAD_RANKS = {"dp2": [1], "tp2": [1], "pp2": [0, 1]}  # the norm is summed over pp: both stages see the flip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_transient_flip_is_replayed_and_the_run_is_bitwise_the_uninterrupted_one(tmp_path, layout):
    plain = train(tmp_path / "plain", *LAYOUTS[layout])
    flipped = train(tmp_path / "flip", *LAYOUTS[layout], fault="gradflip:rank=1:step=4")
    assert "replayed" not in plain.stdout
    assert "step 4: replayed: transient fault (rank " in flipped.stdout, describe(flipped)
    assert "update skipped" not in flipped.stdout
    assert losses(tmp_path / "flip") == losses(tmp_path / "plain")
    assert verdicts(tmp_path / "flip") == [(4, rank, "nonfinite_grad", TRANSIENT) for rank in BAD_RANKS[layout]]
    assert faulty_hosts(read_faults(tmp_path / "flip")) == []


def test_a_sticky_flip_is_persistent_its_host_recorded_and_the_step_skipped(tmp_path):
    sticky = train(tmp_path / "sticky", fault="gradflip:rank=1:step=4:sticky=1")
    train(tmp_path / "told", "fault.skip_steps=[4]")
    assert "step 4: replayed: persistent fault (rank 1 on" in sticky.stdout, describe(sticky)
    assert "step 4: update skipped (non-finite gradient norm on some rank" in sticky.stdout
    assert losses(tmp_path / "sticky") == losses(tmp_path / "told")
    records = read_faults(tmp_path / "sticky")
    assert verdicts(tmp_path / "sticky") == [(4, 1, "nonfinite_grad", PERSISTENT)]
    assert "grad norm inf" in records[0]["evidence"] and faulty_hosts(records) == [records[0]["host"]]


def test_a_sticky_nan_in_one_ranks_forward_is_found_persistent_by_the_peer_check(tmp_path):
    """Rank 1's own loss sum is NaN at each computation of step 4: the summed loss is NaN on both ranks alike, but
    rank 0, computing rank 1's micro-batches from the same state, gets a finite sum."""
    run = train(tmp_path / "forward", fault="lossnan:rank=1:step=4:sticky=1")
    assert "step 4: replayed: persistent fault (rank 1 on" in run.stdout, describe(run)
    assert "rank 0 computed rank 1's micro-batches to a loss sum of" in run.stdout and "rank 1 had nan" in run.stdout
    assert verdicts(tmp_path / "forward") == [(4, 1, "nonfinite_loss", PERSISTENT)]


def test_a_nan_from_the_model_itself_is_genuine(tmp_path):
    """A learning rate of 1e300 makes step 1's update overflow: from step 2 every rank computes NaN from the state."""
    run = train(tmp_path / "huge_lr", "optim.lr=1e300", "optim.min_lr=0", "optim.warmup_steps=0", "train.steps=3",
                "fault.max_bad_steps=10")
    assert "step 2: replayed: genuine fault" in run.stdout, describe(run)
    found = verdicts(tmp_path / "huge_lr")
    assert {(step, verdict) for step, _, _, verdict in found} == {(2, GENUINE), (3, GENUINE)}
    assert faulty_hosts(read_faults(tmp_path / "huge_lr")) == []
