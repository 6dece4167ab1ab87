"""FP8 on the wire for the MoE dispatch (model.moe.dispatch_dtype = "fp8"): e4m3 codes with an fp32 scale per 1x128
tile of a row. Its bytes are half of bf16's plus the scales (Group's counters, 2 ranks), its error against the exact
dispatch is measured and bounded, an outlier gives no NaN, and ep 2 trains as one process does (float64, 1e-10)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mpi_helpers import run_python_mpi_results

from mpitrain.config_moe import MoeSettings
from mpitrain.errors import ConfigError
from mpitrain.layers.expert_parallel import ExpertParallel, dispatch_bytes

E4M3_ROUNDOFF = 2.0**-4


def test_the_key_takes_same_or_fp8():
    assert MoeSettings.of(type("M", (), {"moe": {"experts": 4, "dispatch_dtype": "fp8"}})).dispatch_dtype == "fp8"
    with pytest.raises(ConfigError, match="model.moe.dispatch_dtype must be one of same, fp8, got 'int8'"):
        MoeSettings.of(type("M", (), {"moe": {"experts": 4, "dispatch_dtype": "int8"}}))


def test_bytes_formula():
    assert dispatch_bytes(10, 256, 2) == 10 * 256 * 2
    assert dispatch_bytes(10, 256, 2, "fp8") == 10 * 256 + 10 * 2 * 4  # half of bf16's, one fp32 scale per tile
    assert dispatch_bytes(10, 160, 2, "fp8") == 10 * 160 + 10 * 2 * 4  # a partial tile has its own scale


def test_one_process_dispatch_error_is_bounded_and_an_outlier_gives_no_nan():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(40, 160)) * np.exp(rng.normal(size=(40, 1)))  # rows of very different scales
    rows[3, 5] = 1e6  # far past e4m3's 448: the tile's scale takes it in, the rest of its tile gets coarse
    rows[7] = 0.0
    ep = ExpertParallel(None, 4)
    routing = ep.route(np.array([10, 10, 15, 5]))
    for dtype in (np.float64, np.float32, ml_dtypes.bfloat16):
        exact = ep.dispatch(rows.astype(dtype), routing).astype(np.float64)
        fp8 = ep.dispatch(rows.astype(dtype), routing, "fp8")
        assert fp8.dtype == dtype and np.isfinite(fp8.astype(np.float64)).all()
        error = np.abs(fp8.astype(np.float64) - exact)
        tiles = [slice(0, 128), slice(128, 160)]
        for tile in tiles:  # each value within e4m3's roundoff of its tile's amax (half a step at the top binade)
            amax = np.abs(exact[:, tile]).max(axis=1, keepdims=True)
            assert (error[:, tile] <= amax * E4M3_ROUNDOFF + 1e-300).all()
        ordinary = np.ones(len(rows), bool)
        ordinary[[3, 7]] = False  # the outlier's row alone would set the norm
        relative = np.linalg.norm(error[ordinary]) / np.linalg.norm(exact[ordinary])
        assert 0.005 < relative < E4M3_ROUNDOFF, relative
        assert not fp8[7].astype(np.float64).any()  # a zero row (scale 1) stays zero


TWO_RANKS = """
import json
import ml_dtypes
import numpy as np
from mpi4py import MPI
from mpitrain.comm.group import Group
from mpitrain.config import load_config
from mpitrain.layers.expert_parallel import ExpertParallel, dispatch_bytes
from mpitrain.train import Trainer

world = MPI.COMM_WORLD
rank = world.Get_rank()
out = {}

# the dispatch alone: bf16 rows of two 1x128 tiles (the second partial), counted by the group
group = Group(world, "ep")
ep = ExpertParallel(group, 4)
rng = np.random.default_rng(rank)
counts = rng.integers(3, 12, size=4)
rows = rng.normal(size=(int(counts.sum()), 160)).astype(ml_dtypes.bfloat16)
routing = ep.route(counts)
received = {}
for wire in ("same", "fp8"):
    group.reset_counters()
    received[wire] = ep.dispatch(rows, routing, wire).astype(np.float64)
    out[wire] = group.counters()["all_to_all"]
remote = int(routing.sent.sum() - routing.sent[rank].sum())  # rows this rank sends to the other
out["remote"] = remote
out["formula"] = [dispatch_bytes(remote, 160, 2), dispatch_bytes(remote, 160, 2, "fp8")]
out["error"] = float(np.linalg.norm(received["fp8"] - received["same"]) / np.linalg.norm(received["same"]))

# training: ep 2 against one process, float64, the fp8 dispatch on both
base = ["data.synthetic=true", "model.arch=llama", "precision.compute=float64", "train.thread_replicas=1"]
def losses(comm, settings, steps=2):
    trainer = Trainer(load_config("configs/tiny.toml", base + settings), comm)
    return [trainer.train_step(step).loss for step in range(steps)]
moe = 'model.moe={experts=4,top_k=2,dispatch_dtype="%s"}'
out["ep2"] = losses(world, [moe % "fp8", "parallel.ep=2"])
if rank == 0:
    out["one"] = losses(MPI.COMM_SELF, [moe % "fp8"])
    out["one_exact"] = losses(MPI.COMM_SELF, [moe % "same"])
everyone = world.gather(out)
if rank == 0:
    print("RESULTS " + json.dumps(everyone))
"""


def test_two_ranks_bytes_error_and_parity():
    ranks = run_python_mpi_results(2, TWO_RANKS, timeout=240)
    for r in ranks:
        assert r["remote"] > 0
        assert r["same"] == r["formula"][0] and r["fp8"] == r["formula"][1]
        assert r["fp8"] == r["same"] // 2 + r["remote"] * 2 * 4  # exactly half of bf16's plus two fp32 scales a row
        assert 0.005 < r["error"] < E4M3_ROUNDOFF
    one, ep2, exact = ranks[0]["one"], ranks[0]["ep2"], ranks[0]["one_exact"]
    assert ep2 == pytest.approx(one, rel=1e-10)  # every row is quantized wherever its expert lives
    difference = [abs(a - b) / b for a, b in zip(one, exact)]
    assert 0 < max(difference) < 1e-3, difference  # the fp8 dispatch moves the loss, a little
