"""Adafactor under ZeRO keeps its factoring: a shard is a flat slice that may start and end mid-row, and each rank
adds its slice's partial row and column sums into the matrix's whole row and column vectors (one small all-reduce
over the shard group: mpitrain/optim/exchange.py). Before, a matrix cut by a shard fell back to an element-wise
second moment (2.08 bytes of state per parameter at ZeRO-1 on 2 ranks against 0.61 in one process) and the run
drifted off the one-process run, so the layout was refused. Parity of every layout: tests/test_optim_layouts.py."""
from __future__ import annotations

import json

from mpitrain.config import load_config, resolve_layout
from mpitrain.optim.footprint import lean_state_bytes, segment_windows
from mpitrain.plan.memory import rank_model
from mpitrain.state.frozen import split_frozen
from tests.mpi_helpers import describe, run_mpi
from tests.test_train_parity import assert_same_run, run_training

ADAFACTOR = ["data.synthetic=true", "precision.compute=float64", "train.steps=3", "optim.name=adafactor",
             "optim.adafactor_momentum=full"]

FOOTPRINT_JOB = """
import json
from mpi4py import MPI
from mpitrain.config import load_config
from mpitrain.train import Trainer

measured = {}
for zero in (0, 1):
    cfg = load_config("configs/quickstart.toml", ["data.synthetic=true", "logging.peak_flops=1e9",
                                                  "optim.name=adafactor", f"parallel.zero={zero}"])
    trainer = Trainer(cfg, MPI.COMM_WORLD)
    measured[zero] = trainer.optimizer.state_nbytes()
if MPI.COMM_WORLD.rank == 0:
    print("FOOTPRINT " + json.dumps(measured))
"""


def test_zero_1_on_two_ranks_holds_at_most_0_7_bytes_per_parameter(tmp_path):
    """The quickstart model (int4 first moment, float32): the state rank 0's optimizer holds, per parameter it
    updates, at ZeRO-1 over 2 ranks is within 0.7 bytes (about the one-process 0.61), and equals what
    optim/footprint.py (mpitrain memory's optimizer row) counts."""
    script = tmp_path / "footprint.py"
    script.write_text(FOOTPRINT_JOB)
    result = run_mpi(2, [str(script)], timeout=180)
    assert result.returncode == 0, describe(result)
    measured = json.loads(result.stdout.split("FOOTPRINT ", 1)[1].splitlines()[0])
    per_parameter = {}
    for zero, held in measured.items():
        cfg = load_config("configs/quickstart.toml", ["optim.name=adafactor", f"parallel.zero={zero}"])
        resolve_layout(cfg, 2)
        layouts = split_frozen(rank_model(cfg).layouts)[0]
        assert lean_state_bytes("adafactor", layouts, int(zero), 2, 4) == held, zero
        _, windows = segment_windows(layouts, int(zero), 2)
        per_parameter[zero] = held / sum(end - start for start, end in windows)
    print(per_parameter)
    assert per_parameter["1"] <= 0.7 and per_parameter["0"] <= 0.7
    assert measured["1"] < 0.55 * measured["0"]  # the state is sharded: half of it per rank, and a little more


def test_the_planner_proposes_zero_and_tensor_parallel_layouts_for_adafactor():
    from mpitrain.plan.clusters import load_cluster
    from mpitrain.plan.search import search
    cfg = load_config("configs/tiny.toml", ["optim.name=adafactor"])
    found = search(cfg, load_cluster("h100"), 4)
    layouts = [r["layout"] for r in found["fits"]]
    assert any(lay["zero"] >= 1 and lay["dp"] * lay["cp"] > 1 for lay in layouts)
    assert any(lay["tp"] > 1 for lay in layouts)
    assert not any("adafactor" in why for why in found["refused"])


def test_zero_0_over_two_ranks_is_the_one_process_run(tmp_path):
    """float64, 3 steps: every step's loss and the final parameters agree with one process (factored matrices whole
    in the one segment every rank updates)."""
    assert_same_run(run_training(1, tmp_path / "one", ADAFACTOR),
                    run_training(2, tmp_path / "two", [*ADAFACTOR, "parallel.zero=0"]))
