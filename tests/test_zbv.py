"""The ZB-V schedule (parallel.schedule = "zbv"): two chunks per rank in a V, the backward split into B and W.

Without MPI: every (p, m) validates (FIFO channels, the turn on the last rank in memory, no deadlock), its simulated
bubble with unit per-chunk costs is exactly bubble_formula's (fractions): the published (p-1)/(6m+p-1) for m >= 2p,
the list scheduling's own makespan below; it beats zb1p, no rank holds saved activations of more than 2p chunks
(1f1b's p micro-batches), nor more than 2p+2 from forward to weight gradient. Under mpiexec (float64): pp 2, pp 4
and pp 2 x tp 2 x dp 2 runs match one process, and a zbv run resumes under another schedule.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
from click.testing import CliRunner

from mpitrain.cli import main
from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.parallel.pipeline import rank_stages
from mpitrain.parallel.schedule import (
    Instruction,
    ScheduleArgumentError,
    ScheduleError,
    bubble_formula,
    make_schedule,
    zbv_makespan,
)
from mpitrain.parallel.schedule_analysis import bubble_fraction, exact_bubble, peak_activations, simulate, validate
from tests.test_checkpoint import PREEMPTED, losses, train
from tests.test_pipeline import BASE, FAST, FLAVOURS
from tests.test_tensor_parallel import assert_exact
from tests.test_train_parity import dataset, train_run  # noqa: F401  (dataset: the module-scoped token file)

ZBV = ["parallel.schedule=zbv", "parallel.virtual_stages=2"]


def zbv_bubble(p, m):
    schedule = make_schedule("zbv", p, m, 2)
    return bubble_fraction(simulate(schedule, placement="v"))


def held_until_weight_gradient(program) -> int:
    """The most (micro-batch, chunk) pairs a rank holds from their forward to their W: saved activations, then the
    deferred weight-gradient work (x and dy of every matmul) that replaces them."""
    held = peak = 0
    for ins in program:
        held += (ins.op == "forward") - (ins.op == "backward_weight")
        peak = max(peak, held)
    return peak


def test_zbv_validates_and_its_bubble_is_its_formula_over_a_grid():
    for p in range(1, 9):
        for m in range(1, 2 * p + 3):
            schedule = make_schedule("zbv", p, m, 2)
            validate(schedule, p, m, 2, placement="v")
            simulated = exact_bubble(simulate(schedule, placement="v"))
            assert simulated == bubble_formula("zbv", p, m, 2), (p, m)
            makespan = max(6 * m + p - 1, 4 * p + 2 * m - 1)  # the fill, or the last micro-batch's trip: a bound
            assert zbv_makespan(p, m) >= makespan, (p, m)
            if m >= 2 * p:
                assert simulated == Fraction(p - 1, 6 * m + p - 1), (p, m)
            if m >= p > 1:
                assert simulated < bubble_fraction(simulate(make_schedule("zb1p", p, m))), (p, m)
            assert max(peak_activations(schedule)) <= 2 * p, (p, m)
            assert max(held_until_weight_gradient(program) for program in schedule) <= 2 * p + 2, (p, m)


@pytest.mark.parametrize("m", [8, 16])
def test_pp4_zbv_halves_zb1p_bubble_at_1f1b_memory(m):
    p = 4
    zbv, zb1p = zbv_bubble(p, m), bubble_fraction(simulate(make_schedule("zb1p", p, m)))
    schedule = make_schedule("zbv", p, m, 2)
    peaks, held = peak_activations(schedule), [held_until_weight_gradient(program) for program in schedule]
    print(f"pp {p}, m {m}: zbv bubble {zbv:.4f}, zb1p {zb1p:.4f}; per rank, chunks with saved activations at most "
          f"{peaks}, held from F to W at most {held}")
    assert zbv == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
    assert zbv < zb1p
    # 2p chunks of half a stage each = p whole micro-batches, what 1f1b's rank 0 holds; two chunks more wait for W
    assert peaks == [2 * p] * p and held == [2 * p + 2] * p
    assert max(peak_activations(make_schedule("1f1b", p, m))) * 2 == max(peaks)


def test_the_turn_on_the_last_rank_sends_nothing():
    p, m = 4, 8
    schedule = make_schedule("zbv", p, m, 2)
    last = schedule[p - 1]
    assert all(ins.peer != p - 1 for ins in last)
    assert {ins.peer for ins in schedule[0] if ins.peer is not None} == {1}  # rank 0: both chunks talk to rank 1


def test_validate_catches_a_v_out_of_order_and_a_message_on_the_turn():
    p, m = 2, 4
    schedule = make_schedule("zbv", p, m, 2)
    last = list(schedule[p - 1])
    first_f0 = last.index(Instruction("forward", 0, 0))
    first_f1 = last.index(Instruction("forward", 0, 1))
    last[first_f0], last[first_f1] = last[first_f1], last[first_f0]
    with pytest.raises(ScheduleError, match="turns the V out of order"):
        validate([schedule[0], last], p, m, 2, placement="v")
    extra = [Instruction("send_forward", 0, 0, peer=p - 1)] + list(schedule[p - 1])
    with pytest.raises(ScheduleError, match="should name peer"):
        validate([schedule[0], extra], p, m, 2, placement="v")
    with pytest.raises(ScheduleError):  # read with the round-robin placement, the V is wrong
        validate(schedule, p, m, 2)


def test_v_placement_puts_the_embedding_and_the_head_on_rank_0():
    n_layer, p = 8, 4
    assert rank_stages(n_layer, p, 2, 0, placement="v") == [(0, 2), (8, 10)]
    assert rank_stages(n_layer, p, 2, p - 1, placement="v") == [(4, 5), (5, 6)]
    covered = sorted(r for rank in range(p) for r in rank_stages(n_layer, p, 2, rank, placement="v"))
    assert [first for first, _ in covered][1:] == [end for _, end in covered][:-1]  # every unit once


def test_zbv_needs_two_chunks():
    with pytest.raises(ConfigError, match="parallel.virtual_stages = 2"):
        load_config("configs/tiny.toml", ["parallel.pp=2", "parallel.schedule=zbv"])
    with pytest.raises(ScheduleArgumentError, match="parallel.virtual_stages = 2"):
        make_schedule("zbv", 2, 4, 3)


def test_schedule_command_shows_zbv():
    result = CliRunner().invoke(main, ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zbv"])
    assert result.exit_code == 0, result.output
    assert "(p-1)/(6m+p-1) = 0.0588, simulated 0.0588" in result.output
    assert "rank 0 8, rank 1 8, rank 2 8, rank 3 8" in result.output


# ---- under MPI ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def references(tmp_path_factory, dataset):
    root = tmp_path_factory.mktemp("zbv-reference")
    return {name: train_run(1, root / name, dataset, *FAST, *BASE, *extra) for name, extra in FLAVOURS.items()}


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_zbv_matches_single_process(tmp_path, dataset, references, flavour, p):
    run = train_run(p, tmp_path / "run", dataset, *FAST, *BASE, *FLAVOURS[flavour], f"parallel.pp={p}", *ZBV)
    assert_exact(references[flavour], run, f"{flavour} pp{p} zbv")


def test_pp2_tp2_dp2_zbv_matches_single_process(tmp_path, dataset, references):
    """Eight ranks: the V's pp group under tensor and data parallelism (m = 4 = 2p micro-batches per dp rank)."""
    run = train_run(8, tmp_path / "run", dataset, *FAST, *BASE, *FLAVOURS["llama"], "parallel.pp=2", "parallel.tp=2",
                    "train.micro_batch=1", *ZBV)
    assert_exact(references["llama"], run, "llama pp2 tp2 dp2 zbv")


def test_a_zbv_run_continues_under_another_schedule(tmp_path, dataset):
    settings = ["precision.compute=float64", "model.n_layer=4", "train.micro_batch=2"]
    train(1, tmp_path / "straight", dataset, *settings)
    train(2, tmp_path / "moved", dataset, *settings, "parallel.pp=2", *ZBV, "train.stop_at=4", expect=PREEMPTED)
    train(2, tmp_path / "moved", dataset, *settings, "parallel.pp=2", "parallel.schedule=1f1b", resume="auto")
    straight, moved = losses(tmp_path / "straight"), losses(tmp_path / "moved")
    assert straight.keys() == moved.keys()
    for step, loss in straight.items():
        assert abs(moved[step] - loss) <= 1e-10 * abs(loss), step
