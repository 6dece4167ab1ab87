"""Data parallelism is exact: dp = 2 and 4 give the single process's losses and parameters (float64, 1e-10).

Runs the real `mpitrain train` command under mpiexec, on a small token file made by `mpitrain data prepare`.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from mpitrain.checkpoint.resume import resolve_checkpoint
from mpitrain.checkpoint.store import Checkpoint
from mpitrain.data.prepare import prepare_dataset
from tests.mpi_helpers import describe, run_mpi

RTOL = 1e-10
# Steps of each parity run: warmup (2) and the decay after it, each checked step by step. More steps prove nothing
# more (every step runs the same code) and cost suite time: the layouts are many.
PARITY_STEPS = 6


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "stdlib.h5"
    prepare_dataset("python-stdlib", path, max_bytes=400_000)
    return path


def train_run(n_ranks, run_dir, dataset, *overrides, config="configs/tiny.toml"):
    settings = [f"data.path={dataset}", "precision.compute=float64", f"train.steps={PARITY_STEPS}", *overrides]
    return run_training(n_ranks, run_dir, settings, config=config)


def run_training(n_ranks, run_dir, settings, config="configs/tiny.toml", resume=None, expect=0, timeout=180):
    """`mpitrain train CONFIG --set ...` on n_ranks, its exit status checked: (metrics rows, final full tensors)."""
    args = ["-m", "mpitrain", "train", config, "--out", str(run_dir)]
    for setting in settings:
        args += ["--set", setting]
    result = run_mpi(n_ranks, args + (["--resume", resume] if resume else []), timeout=timeout)
    assert result.returncode == expect, describe(result)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return metrics, final_params(run_dir)


def final_params(run_dir):
    """Every full tensor of the run's newest checkpoint, whatever layout wrote it."""
    checkpoint = Checkpoint.open(resolve_checkpoint(run_dir))
    return {name: checkpoint.read_box("param", name, (0,) * len(info["global_shape"]), info["global_shape"],
                                      np.float64) for name, info in checkpoint.tensors().items()}


def assert_same_run(reference, other):
    ref_metrics, ref_params = reference
    metrics, params = other
    assert [m["step"] for m in metrics] == [m["step"] for m in ref_metrics]
    for ref, got in zip(ref_metrics, metrics):
        assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL, abs=0), f"step {got['step']}"
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-9)
    for name, value in ref_params.items():
        err = np.linalg.norm(params[name] - value) / np.linalg.norm(value)
        assert err < RTOL, f"{name}: relative difference {err:.2e}"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("micro_batch", [1, 2], ids=["accumulate", "one-micro-batch-at-dp4"])
def test_data_parallel_matches_single_process(tmp_path, dataset, arch, micro_batch):
    extra = [f"model.arch={arch}", f"train.micro_batch={micro_batch}"]
    if arch == "llama":
        extra.append("model.n_kv_head=2")
    single = train_run(1, tmp_path / "dp1", dataset, *extra)
    assert len(single[0]) == PARITY_STEPS and single[0][-1]["loss"] < single[0][0]["loss"]
    for dp in (2, 4):
        assert_same_run(single, train_run(dp, tmp_path / f"dp{dp}", dataset, *extra))


@pytest.mark.parametrize("arch, dp_layout", [("gpt2", "parallel.bucket_mb=0.01"), ("llama", "parallel.zero=2")])
def test_thread_replicas_give_the_one_thread_run(tmp_path, dataset, arch, dp_layout):
    """train.thread_replicas splits each micro-batch's rows over threads (mpitrain/parallel/replicas.py): alone, and
    under dp 2's reductions overlapped with backward (all-reduce in small buckets; ZeRO-2's reduce-scatter), the
    run is the one-thread run."""
    extra = [f"model.arch={arch}"] + (["model.n_kv_head=2"] if arch == "llama" else [])
    single = train_run(1, tmp_path / "one", dataset, *extra, "train.thread_replicas=1")
    assert_same_run(single, train_run(1, tmp_path / "three", dataset, *extra, "train.thread_replicas=3"))
    assert_same_run(single, train_run(2, tmp_path / "dp2", dataset, *extra, "train.thread_replicas=2", dp_layout))


def test_small_buckets_and_no_overlap_give_the_same_run(tmp_path, dataset):
    reference = train_run(2, tmp_path / "a", dataset, "parallel.bucket_mb=0.01")
    assert_same_run(reference, train_run(2, tmp_path / "b", dataset, "parallel.overlap=false"))


def test_comm_bytes_are_the_ring_all_reduce_volume(tmp_path, dataset):
    metrics, params = train_run(4, tmp_path / "dp4", dataset, "train.steps=2", "train.micro_batch=2")
    psi = sum(v.size for v in params.values()) * 8  # float64 gradient bytes
    for record in metrics:
        assert record["comm_bytes"]["all_reduce"] == round(2 * 3 / 4 * psi)
        assert record["comm_bytes"]["reduce_scatter"] == 0


def test_metrics_have_the_contract_keys(tmp_path, dataset):
    metrics, _ = train_run(1, tmp_path / "run", dataset, "train.steps=3", "precision.compute=float32")
    for record in metrics:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "comm_bytes"):
            assert key in record
        assert 0 < record["mfu"] < 1
    assert "val_loss" in metrics[-1]
    assert (tmp_path / "run" / "config.toml").is_file()


@pytest.mark.parametrize("ranks, overrides, message", [
    (2, ["train.global_batch=6", "train.micro_batch=2"], "train.global_batch = 6 is not divisible"),
    (2, ["model.colour=3"], "unknown config key model.colour"),
    (2, ["train.steps=\"ten\""], "config key train.steps must be int"),
    (3, ["parallel.dp=2"], "world size 3 does not match parallel dp"),
    (2, ["data.path=/nonexistent/corpus.h5"], "data file /nonexistent/corpus.h5 not found"),
    (2, ["model.arch=bert"], "model.arch = 'bert' is not allowed"),
])
def test_bad_input_fails_fast_with_one_clear_line(tmp_path, ranks, overrides, message):
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path)]
    for setting in overrides:
        args += ["--set", setting]
    result = run_mpi(ranks, args, timeout=60)
    assert result.returncode != 0, describe(result)
    assert message in result.stderr, describe(result)
    assert "Traceback" not in result.stderr, describe(result)


def test_single_process_works_without_mpiexec(tmp_path, dataset):
    import subprocess
    result = subprocess.run([sys.executable, "-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path),
                             "--set", f"data.path={dataset}", "--set", "train.steps=2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "checkpoints" / "step_00000002" / "COMMITTED").is_file()


def test_ranks_without_blas_thread_settings_are_warned_about(tmp_path, dataset):
    import os
    import subprocess

    from tests.mpi_helpers import OVERSUBSCRIBED_ENV, REPO_ROOT, find_mpiexec
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec beside the Python interpreter or on PATH: pip install -e '.[mpich]'")
    env = {k: v for k, v in {**os.environ, **OVERSUBSCRIBED_ENV}.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "mpitrain", "train", "configs/tiny.toml",
                             "--out", str(tmp_path), "--set", f"data.path={dataset}", "--set", "train.steps=1"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("OMP_NUM_THREADS is not set") == 1  # once, from rank 0
