"""The V schedules' measures: DualPipeV (parallel.schedule = "dualpipev") and ZB-V beside ZB-H1, and the closed
formulas the planner reads (parallel/schedule_costs.py).

Without MPI: every DualPipeV (p, m >= 2p) validates and its simulated bubble is exactly its formula (fractions); the
overlapped pairs keep their messages under the other half; the cost formulas of every kind equal what the schedules
themselves give. Under mpiexec (float64): one 4-rank job records the executor's real event order for zb1p, zbv and
dualpipev at m = 8 and 16 (the bubbles, replayed with unit costs, are exactly the formulas; zbv's below zb1p's), and
one pp 4 DualPipeV training run matches one process and records its overlapped pairs.
"""
from __future__ import annotations

import json
from fractions import Fraction

import pytest
from click.testing import CliRunner

from mpitrain.cli import main
from mpitrain.config import load_config, resolve_layout
from mpitrain.errors import ConfigError
from mpitrain.parallel import schedule_costs
from mpitrain.parallel.schedule import (
    SCHEDULE_KINDS,
    Instruction,
    ScheduleArgumentError,
    bubble_formula,
    dualpipev_pairs,
    make_schedule,
    placement_of,
)
from mpitrain.parallel.schedule_analysis import exact_bubble, overlap_violations, peak_activations, simulate, validate
from mpitrain.parallel.timeline import recorded_program, replay
from tests.mpi_helpers import run_python_mpi_results
from tests.test_pipeline import BASE, FAST, FLAVOURS
from tests.test_tensor_parallel import assert_exact
from tests.test_train_parity import dataset, train_run  # noqa: F401  (dataset: the module-scoped token file)

DUALPIPEV = ["parallel.schedule=dualpipev", "parallel.virtual_stages=2"]
UNIT_COSTS = {"t_forward": 1.0, "t_backward": 2.0, "t_backward_input": 1.0, "t_backward_weight": 1.0}


def simulated_bubble(kind, p, m, v=1) -> Fraction:
    return exact_bubble(simulate(make_schedule(kind, p, m, v), placement=placement_of(kind), **UNIT_COSTS))


def test_dualpipev_validates_and_its_bubble_is_its_formula():
    for p in (1, 2, 3, 4, 5, 8):
        for m in (2 * p, 2 * p + 1, 2 * p + 3):
            validate(make_schedule("dualpipev", p, m, 2), p, m, 2, placement="v")
            assert simulated_bubble("dualpipev", p, m, 2) == bubble_formula("dualpipev", p, m, 2) \
                == Fraction(p - 1, 3 * m + p - 1), (p, m)


def test_the_overlapped_pairs_post_each_halfs_messages_before_the_other_computes():
    p, m = 4, 8
    schedule, pairs = make_schedule("dualpipev", p, m, 2), dualpipev_pairs(p, m)
    for rank in range(p):
        assert overlap_violations(schedule[rank], pairs[rank]) == [], rank
    # steady state of rank 1: (F0, B1) and (F1, B0) pairs; the last rank's first F0 and B1 run apart
    assert [len(ranks) for ranks in pairs] == [2 * (m - 2 * p + r + 1) + p - r - 1 - (r == p - 1) for r in range(p)]
    (forward, backward) = pairs[1][1]
    program = schedule[1]
    f_at, b_at = program.index(Instruction(*forward)), program.index(Instruction(*backward))
    assert [ins.op for ins in program[f_at - 2:b_at + 2]] == [
        "recv_forward", "recv_backward", "forward", "send_forward", "backward", "send_backward"]
    # the same order run as plain 1F1B-style steps (receive right before its compute) is caught
    late = list(program)
    receive = late.pop(f_at - 1)
    late.insert(late.index(Instruction(*backward)), receive)
    assert "receive waits until after the forward" in overlap_violations(late, [pairs[1][1]])[0]


def test_cost_formulas_equal_what_the_schedules_give():
    for kind in SCHEDULE_KINDS:
        for p in (1, 2, 3, 5):  # p = 5: zbv's cap matters from p = 5 on
            for m in range(1, 2 * p + 3):
                for v in {"interleaved": (1, 2, 3), "zbv": (2,), "dualpipev": (2,)}.get(kind, (1,)):
                    if (kind == "dualpipev" and m < 2 * p) or (kind == "interleaved" and v > 1 and m % p):
                        continue
                    schedule, what = make_schedule(kind, p, m, v), (kind, p, m, v)
                    assert schedule_costs.peak_activation_chunks(kind, p, m, v) == peak_activations(schedule), what
                    sends = sum(ins.op.startswith("send") for program in schedule for ins in program)
                    assert sends == m * schedule_costs.messages_per_micro_batch(kind, p, v), what
                    assert schedule_costs.bubble(kind, p, m, v) == simulated_bubble(kind, p, m, v), what
    assert schedule_costs.messages_per_micro_batch("dualpipev", 4, 2) == 2 * schedule_costs.messages_per_micro_batch(
        "1f1b", 4)
    assert schedule_costs.peak_activation_chunks("dualpipev", 4, 8, 2) == [9] * 4  # DualPipe's PP + 1, PP = 8


def test_dualpipev_refuses_too_few_micro_batches_and_one_chunk():
    with pytest.raises(ScheduleArgumentError, match="at least 2 \\* parallel.pp = 8 micro-batches"):
        make_schedule("dualpipev", 4, 7, 2)
    with pytest.raises(ConfigError, match="parallel.virtual_stages = 2"):
        load_config("configs/tiny.toml", ["parallel.pp=2", "parallel.schedule=dualpipev"])
    cfg = load_config("configs/tiny.toml", ["parallel.pp=2", "model.n_layer=4", *DUALPIPEV, "train.micro_batch=4"])
    with pytest.raises(ConfigError, match="'dualpipev' needs at least 2 \\* parallel.pp = 4 micro-batches"):
        resolve_layout(cfg, 2)


def test_schedule_command_draws_dualpipev():
    result = CliRunner().invoke(main, ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "dualpipev"])
    assert result.exit_code == 0, result.output
    assert "bubble: theoretical (p-1)/(3m+p-1) = 0.1111, simulated 0.1111" in result.output
    assert "overlapped pairs per rank: 5, 6, 7, 7" in result.output
    assert "rank 0 9, rank 1 9, rank 2 9, rank 3 9" in result.output


# ---- under MPI ----------------------------------------------------------------------------------------------------
ORDER_JOB = """
import json
from mpi4py import MPI
from mpitrain.config import load_config
from mpitrain.train import Trainer

world, results = MPI.COMM_WORLD, []
for kind in ("zb1p", "zbv", "dualpipev"):
    for m in (8, 16):
        v = 1 if kind == "zb1p" else 2
        cfg = load_config("configs/tiny.toml", [
            "data.synthetic=true", "logging.peak_flops=1e9", "precision.compute=float64", "model.n_layer=8",
            "model.d_model=16", "model.n_head=2", "model.seq_len=8", "train.micro_batch=1",
            f"train.global_batch={m}", f"parallel.pp={world.size}", f"parallel.schedule={kind}",
            f"parallel.virtual_stages={v}"])
        trainer = Trainer(cfg, world)
        trainer.train_step(0)
        gathered = world.gather(trainer.pipeline.timeline.to_dicts(), root=0)
        if world.rank == 0:
            results.append({"kind": kind, "m": m, "v": v, "events": gathered})
if world.rank == 0:
    print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def recorded():
    runs = run_python_mpi_results(4, ORDER_JOB, timeout=600)
    return {(run["kind"], run["m"]): run for run in runs}


@pytest.mark.parametrize("m", [8, 16])
def test_recorded_order_at_pp4_gives_each_v_schedule_its_formula(recorded, m):
    p, bubbles = 4, {}
    for kind in ("zb1p", "zbv", "dualpipev"):
        run = recorded[kind, m]
        program = recorded_program(run["events"], p, placement_of(kind))
        assert program == make_schedule(kind, p, m, run["v"]), kind
        bubbles[kind] = exact_bubble(replay(run["events"], p, placement_of(kind), **UNIT_COSTS))
        assert bubbles[kind] == bubble_formula(kind, p, m, run["v"]), (kind, bubbles[kind])
    print(f"pp 4, m {m}: recorded-order bubbles {({k: str(b) for k, b in bubbles.items()})}")
    assert bubbles["zbv"] == Fraction(p - 1, 6 * m + p - 1) < bubbles["zb1p"] == Fraction(p - 1, 3 * m + p - 1)
    assert bubbles["dualpipev"] == Fraction(p - 1, 3 * m + p - 1)
    for rank, pairs in enumerate(dualpipev_pairs(p, m)):
        assert overlap_violations(recorded_program(recorded["dualpipev", m]["events"], p, "v")[rank], pairs) == []


def test_pp4_dualpipev_matches_single_process(tmp_path, dataset):
    """m = 8 (micro-batches of one row; the reference runs them as 4 of two: the same sums in float64)."""
    reference = train_run(1, tmp_path / "reference", dataset, *FAST, *BASE, *FLAVOURS["gpt2"])
    run_dir = tmp_path / "run"
    run = train_run(4, run_dir, dataset, *FAST, *BASE, *FLAVOURS["gpt2"], "parallel.pp=4", *DUALPIPEV,
                    "train.micro_batch=1")
    assert_exact(reference, run, "gpt2 pp4 dualpipev")
    events = json.loads((run_dir / "timeline.json").read_text())["events"]
    program = recorded_program([events], 4, "v")
    assert program == make_schedule("dualpipev", 4, 8, 2)
    assert all(overlap_violations(program[rank], pairs) == [] for rank, pairs in enumerate(dualpipev_pairs(4, 8)))
