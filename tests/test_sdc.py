"""Silent data corruption: a bit flipped in one replica's parameters is found by the replica hash check within
fault.sdc_every steps, the job stops naming the rank and its host, and no checkpoint is written after the flip."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.checkpoint.store import committed_checkpoints
from mpitrain.resilience.sdc import digest, flip_one_bit, odd_ones_out, replicated_arrays
from tests.test_bad_steps import rows, train


# ----------------------------------------------------------------------------- units
def test_the_odd_one_out_is_named_by_majority_and_a_tie_names_everyone():
    assert odd_ones_out([7, 7, 7]) == ([], False)
    assert odd_ones_out([7, 9, 7]) == ([1], False)
    assert odd_ones_out([7, 9, 7, 7]) == ([1], False)
    assert odd_ones_out([7, 9]) == ([0, 1], True)  # two replicas: no majority, either may be corrupted
    assert odd_ones_out([7, 9, 7, 9]) == ([0, 1, 2, 3], True)
    assert odd_ones_out([1, 2, 3]) == ([0, 1, 2], True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_flip_changes_one_value_visibly_but_finitely_and_changes_the_digest(dtype):
    params = np.linspace(-1.0, 1.0, 101, dtype=dtype) + dtype(0.3)
    before = params.copy()
    reference = digest([params, np.ones(3)])
    flip_one_bit([SimpleNamespace(params=params)])
    changed = np.flatnonzero(params != before)
    assert changed.tolist() == [50]
    assert np.isfinite(params).all() and 0.25 < abs(params[50] / before[50] - 1) <= 0.5  # top mantissa bit
    assert digest([params, np.ones(3)]) != reference
    flip_one_bit([SimpleNamespace(params=params)])  # flipping it back restores the bytes and the digest
    assert digest([params, np.ones(3)]) == reference


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_digest_sees_any_single_bit_and_only_changes(dtype):
    values = np.random.default_rng(0).standard_normal(1000).astype(dtype)
    reference = digest([values, np.zeros(5)])
    assert digest([values.copy(), np.zeros(5)]) == reference
    words = values.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[values.itemsize])
    for index in (0, 517, 999):
        for bit in range(8 * values.itemsize):
            corrupted = words.copy()
            corrupted[index] ^= corrupted.dtype.type(1) << corrupted.dtype.type(bit)
            assert digest([corrupted.view(dtype), np.zeros(5)]) != reference, (index, bit)
    assert digest([np.zeros(5), values]) != reference  # the order of the arrays counts


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_what_is_compared_for_each_zero_stage(zero):
    """The arrays come from the state's own declaration (what checkpoints write once as dp-replicated)."""
    from mpi4py import MPI

    from mpitrain.config import load_config
    from mpitrain.train import Trainer

    cfg = load_config("configs/tiny.toml", ["data.synthetic=true", f"parallel.zero={zero}", "logging.peak_flops=1e9"])
    trainer = Trainer(cfg, MPI.COMM_SELF)
    by_group = replicated_arrays(trainer.state, trainer.optimizer)
    assert list(by_group) == ["dp"]  # one group holds every tensor: its arrays whole
    arrays = by_group["dp"]
    moments = [trainer.optimizer.exp_avg, trainer.optimizer.exp_avg_sq]
    if zero == 3:
        assert arrays == []  # one copy of everything at rest: nothing to compare
        return
    assert sum(a.size for a in arrays[:1]) >= trainer.model.n_params  # the full parameters, padded for ZeRO
    if zero == 0:
        assert len(arrays) == 3 and arrays[1] is moments[0] and arrays[2] is moments[1]
    else:
        assert len(arrays) == 1  # moments are sharded: one copy each


def test_experts_and_dense_tensors_are_compared_over_their_own_reduction_groups():
    """Experts under ep > 1 reduce over expert_dp, the rest over dp: each group gets exactly its tensors' parameters
    and Adam moments (zero = 0), cut out of the flat buffers; factored or block state is left out."""
    from mpitrain.backend import make_backend
    from mpitrain.optim.adamw import AdamW, AdamWHyper
    from mpitrain.state.params import ParamSpec, UnitLayout
    from mpitrain.state.replicated import ReplicatedState
    from tests.test_data_parallel_unit import RecordingGroup

    def spec(name, n, group):
        return ParamSpec(name, (n,), "normal", std=1.0, reduce_over=group)
    layouts = [UnitLayout("embed", [spec("wte", 5, "dp")]),
               UnitLayout("block", [spec("norm", 3, "dp"), spec("expert_w", 7, "expert_dp"), spec("router", 2, "dp"),
                                    spec("expert_b", 4, "expert_dp")])]
    group = RecordingGroup([])
    state = ReplicatedState(layouts, make_backend("cpu", "float64"), 0, group, other_groups={"expert_dp": group})
    optimizer = AdamW(state.optimizer_segments(), AdamWHyper())
    optimizer.exp_avg[...] = np.arange(optimizer.exp_avg.size)
    by_group = replicated_arrays(state, optimizer)
    assert sorted(by_group) == ["dp", "expert_dp"]
    flat = state.master.data
    dense, experts = [0, 1, 2, 3, 4, 5, 6, 7, 15, 16], [8, 9, 10, 11, 12, 13, 14, 17, 18, 19, 20]
    for name, where in (("dp", dense), ("expert_dp", experts)):
        params, m, v = (np.concatenate([a for a in by_group[name] if a.base is base or a.base is base.base])
                        for base in (flat, optimizer.exp_avg, optimizer.exp_avg_sq))
        assert np.array_equal(params, flat[where]) and np.array_equal(m, where), name
        assert v.size == len(where) and sum(a.size for a in by_group[name]) == 3 * len(where)


# ----------------------------------------------------------------------------- MPI runs
def sdc_errors(result) -> list[str]:
    """The error lines (one, from rank 0, when every rank reaches the verdict), without their prefix."""
    return [line.split("ERROR:", 1)[1] for line in result.stderr.splitlines() if "silent data corruption" in line]


def test_a_flipped_bit_stops_the_job_before_any_checkpoint_is_written_from_it(tmp_path):
    """Flip after step 5's update on rank 1; checks every 3 steps and before each save (every 2): found at step 6,
    before step 6's save. With two replicas there is no majority: both ranks are named, as not certain."""
    run = train(tmp_path / "run", "checkpoint.every=2", "fault.sdc_every=3", fault="flip:rank=1:step=5", expect=1)
    errors = sdc_errors(run)
    assert len(errors) == 1 and all("at step 6:" in e and "rank 0 on" in e and "rank 1 on" in e for e in errors)
    assert "Traceback" not in run.stderr
    saved = [path.name for path in committed_checkpoints(tmp_path / "run" / "checkpoints")]
    assert saved == ["step_00000002", "step_00000004"]  # nothing after the flip at step 5
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    faults = [json.loads(line) for line in (tmp_path / "run" / "faults.jsonl").read_text().splitlines()]
    assert sorted(f["rank"] for f in faults) == [0, 1]
    assert all(f["kind"] == "sdc" and f["step"] == 6 and f["host"] and f["certain"] is False for f in faults)


def test_with_three_replicas_the_majority_names_the_corrupted_rank(tmp_path):
    run = train(tmp_path / "run", "train.global_batch=6", "train.micro_batch=2", "fault.sdc_every=2",
                fault="flip:rank=2:step=3", expect=1, n=3)
    errors = sdc_errors(run)
    assert errors and all("at step 4: differs from the majority" in e and "rank 2 on" in e and "rank 0" not in e
                          and "rank 1 on" not in e for e in errors), run.stderr
    faults = [json.loads(line) for line in (tmp_path / "run" / "faults.jsonl").read_text().splitlines()]
    assert [(f["kind"], f["rank"], f["step"], f["certain"]) for f in faults] == [("sdc", 2, 4, True)]
    assert not committed_checkpoints(tmp_path / "run" / "checkpoints")


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_healthy_replicas_pass_every_check(tmp_path, zero):
    run = train(tmp_path / "run", f"parallel.zero={zero}", "fault.sdc_every=1", "checkpoint.every=5")
    assert not sdc_errors(run) and not (tmp_path / "run" / "faults.jsonl").exists()
    assert len(rows(tmp_path / "run")) == 10


def test_under_zero_1_a_flip_is_found_by_a_check_before_the_next_all_gather(tmp_path):
    """ZeRO-1/2 compare the full parameters every replica rebuilds by the all-gather at the end of each step."""
    run = train(tmp_path / "run", "parallel.zero=1", "fault.sdc_every=4", fault="flip:rank=0:step=4", expect=1)
    assert sdc_errors(run) and all("at step 4:" in e for e in sdc_errors(run))


def test_zero_3_says_the_check_has_nothing_to_compare(tmp_path):
    run = train(tmp_path / "run", "parallel.zero=3", "fault.sdc_every=2", "train.steps=2")
    assert "parallel.zero = 3 keeps one copy of every parameter" in run.stdout


MOE_EP2 = ["model.moe={experts = 4, top_k = 2, every = 1}", "parallel.ep=2", "train.micro_batch=2"]


def test_at_ep_equal_to_dp_the_dense_tensors_are_still_compared(tmp_path):
    """dp 2 x ep 2 (every expert has one copy): the check stays on over dp for the dense tensors; step 1 passes (the
    experts, which differ between the ranks, are not compared over dp) and a flip in a dense parameter (ZeRO-1: the
    first segment is the embedding's shard) is found at step 2, before the step-2 save."""
    run = train(tmp_path / "run", *MOE_EP2[:2], "train.global_batch=4", "train.micro_batch=2", "parallel.zero=1",
                "fault.sdc_every=1", "checkpoint.every=2", "train.steps=3", fault="flip:rank=1:step=2", expect=1)
    errors = sdc_errors(run)
    assert "replica check is off" not in run.stdout
    assert errors and all("at step 2:" in e and "rank 0 on" in e and "rank 1 on" in e for e in errors), run.stderr
    assert not committed_checkpoints(tmp_path / "run" / "checkpoints")


def test_under_expert_parallelism_replicas_are_the_ranks_with_the_same_experts(tmp_path):
    """dp 4 x ep 2: ranks 0 and 1 hold different experts, ranks 0 and 2 the same ones. A healthy run passes every
    check (comparing over all of dp gave a false alarm), and a flip on rank 1 names rank 1 and its replica 3 only."""
    healthy = train(tmp_path / "healthy", *MOE_EP2, "fault.sdc_every=1", "train.steps=3", n=4)
    assert not sdc_errors(healthy), healthy.stderr
    run = train(tmp_path / "run", *MOE_EP2, "fault.sdc_every=1", "train.steps=4", fault="flip:rank=1:step=2",
                expect=1, n=4)
    errors = sdc_errors(run)
    assert errors and all("at step 2:" in e and "rank 1 on" in e and "rank 3 on" in e and "rank 0 on" not in e
                          and "rank 2 on" not in e for e in errors), run.stderr
