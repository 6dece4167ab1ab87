"""Memory at scale checked by the code itself (plan/dryrun.py): one rank's state and optimizer of a 70B or 405B
layout, built by state/ and optim/ with arrays that hold no memory, equals the planner's rows (padding aside)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from mpitrain.config import resolve_layout
from mpitrain.plan.dryrun import ShapeOnlyArrays, dry_run
from mpitrain.plan.presets import model_config
from tests.mpi_helpers import REPO_ROOT


def layout(model: str, gpus: int, compute: str = "bfloat16", global_batch: int | None = None, **settings):
    cfg, _ = model_config(model)
    for key, value in settings.items():
        section, _, name = key.rpartition("__")
        setattr(getattr(cfg, section or "parallel"), name, value)
    cfg.precision.compute = compute
    if global_batch:
        cfg.train.global_batch = global_batch
    cfg.parallel.dp = 0
    resolve_layout(cfg, gpus)
    return cfg


def assert_rows_equal(cfg, pp_rank: int = 0):
    run = dry_run(cfg, pp_rank)
    for kind in ("params", "grads", "optimizer"):
        assert run.rows[kind] > 0 and run.unpadded[kind] == pytest.approx(run.planned[kind], rel=1e-12, abs=1e-6), \
            (kind, run)
    return run


@pytest.mark.parametrize("settings", [
    {"tp": 8, "zero": 0}, {"tp": 8, "zero": 1}, {"tp": 8, "zero": 2}, {"tp": 8, "zero": 3},
    {"tp": 8, "pp": 4, "zero": 1}, {"tp": 4, "pp": 2, "zero": 3},
], ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_llama3_70b_on_64_gpus(settings):
    assert_rows_equal(layout("llama3-70b", 64, **settings))


@pytest.mark.parametrize("settings", [{"tp": 8, "pp": 16, "zero": 1}, {"tp": 8, "zero": 3}], ids=["published", "zero3"])
def test_llama3_405b_on_1024_gpus(settings):
    cfg = layout("llama3-405b", 1024, **settings)
    run = assert_rows_equal(cfg)
    assert run.rows["params"] > 7.9e8  # a real size: 405B / (tp 8 x pp 16) parameters of 2 bytes, or / 1,024


def test_last_pipeline_stage_experts_lora_and_lean_optimizers():
    assert_rows_equal(layout("llama3-405b", 1024, tp=8, pp=16, zero=1), pp_rank=15)  # the head's stage
    assert_rows_equal(layout("mixtral-8x7b", 16, tp=2, ep=8, zero=3))  # experts sharded over expert_dp
    # the lean optimizers' rows (per-tensor statistics and blocks: slow to lay out in Python for a 70B model)
    assert_rows_equal(layout("gpt3-350m", 8, tp=2, zero=3, optim__name="adafactor"))
    assert_rows_equal(layout("gpt3-350m", 8, tp=2, pp=2, zero=1, optim__name="adam8bit"))
    cfg = layout("llama3-8b", 8, tp=2, zero=3)
    cfg.lora.rank = 8  # frozen base sharded like the parameters, adapters trained
    assert_rows_equal(cfg)


def test_padding_is_reported_not_hidden():
    # dp 6 does not divide the units: every ZeRO part is padded to a multiple of 6
    run = assert_rows_equal(layout("gpt3-1.3b", 6, global_batch=510, zero=3))
    assert 0 < run.padding["params"] < 6 * 2 * 200 and run.rows["params"] > run.planned["params"]


def test_shape_only_arrays_take_no_memory():
    big = ShapeOnlyArrays().zeros(10**12, dtype="float32")  # 4 TB
    assert big.nbytes == 4 * 10**12 and big[10:20].reshape(2, 5).shape == (2, 5)
    big[3] = 1.0  # writes land in the one shared cell


def test_memory_command_prints_the_dry_run():
    result = subprocess.run([sys.executable, "-m", "mpitrain", "memory", "configs/tiny.toml", "-n", "6", "--set",
                             "parallel.zero=3", "--set", "parallel.tp=2", "--set", "train.global_batch=12",
                             "--dry-run"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("dry run")[1].splitlines()[1:]
    assert [line.split()[0] for line in lines] == ["params", "grads", "optimizer"]
    assert all(line.endswith("equal") for line in lines), result.stdout


def test_dualpipev_rows_built_by_the_training_code_equal_the_planner():
    for pp_rank in (0, 3):  # V placement: rank 0 holds the embedding and the head
        assert_rows_equal(layout("gpt3-350m", 8, pp=4, zero=1, schedule="dualpipev", virtual_stages=2),
                          pp_rank=pp_rank)


def test_node_sharded_zero_rows_built_by_the_training_code_equal_the_planner():
    """parallel.zero_shard = node: ZeRO shards over one node's dp ranks (state/hierarchical.py NodeShardGroup), so
    the rows are k-way (k = 8 GPUs per node / tp), not dp-way; two_level keeps dp-way rows."""
    for settings, k in (({"tp": 4, "pp": 2, "zero": 1, "zero_shard": "node"}, 2),
                        ({"tp": 2, "zero": 3, "zero_shard": "node"}, 4),
                        ({"tp": 4, "zero": 2, "dp_reduce": "two_level"}, 16)):
        cfg = layout("llama3-70b", 64, **settings)
        run = dry_run(cfg, gpus_per_node=8)
        world = dry_run(layout("llama3-70b", 64, **{**settings, "zero_shard": "world", "dp_reduce": "flat"}))
        for kind in ("params", "grads", "optimizer"):
            assert run.unpadded[kind] == pytest.approx(run.planned[kind], rel=1e-12, abs=1e-6), (kind, run)
        assert run.rows["optimizer"] == pytest.approx(world.rows["optimizer"] * cfg.parallel.dp / k, rel=1e-6)
