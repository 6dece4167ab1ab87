"""`mpitrain bench comm`: the nccl-tests style table, the alpha-beta fit (exact on synthetic points), the JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mpi_helpers import OVERSUBSCRIBED_ENV, REPO_ROOT, describe

from mpitrain.errors import MpitrainError
from mpitrain.profile.comm_bench import bus_factor, fit_alpha_beta, parse_ops, parse_sizes


def test_sizes_ops_and_factors():
    assert parse_sizes("1K..8K") == [1024, 2048, 4096, 8192]
    assert parse_sizes("1K,1M, 64M") == [1024, 2**20, 64 * 2**20]
    assert parse_sizes("256M..256M") == [256 * 2**20]
    with pytest.raises(MpitrainError, match="--sizes"):
        parse_sizes("1X..2K")
    with pytest.raises(MpitrainError, match="--ops"):
        parse_ops("all_reduce,broadcastish")
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    assert bus_factor("sendrecv", 8) == 1.0


def test_fit_recovers_alpha_and_beta():
    sizes = [2**k for k in range(10, 24)]
    seconds = [20e-6 + size / 5e9 for size in sizes]
    fit = fit_alpha_beta(sizes, seconds, factor=1.0)
    assert fit["alpha_s"] == pytest.approx(20e-6, rel=1e-6)
    assert fit["algbw_GBps"] == pytest.approx(5.0, rel=1e-6) and fit["max_relative_error"] < 1e-6
    flat = fit_alpha_beta(sizes, [30e-6 - 1e-15 * size for size in sizes], factor=2.0)  # no growth with size
    assert flat["beta_s_per_byte"] == 0 and flat["algbw_GBps"] is None and flat["busbw_GBps"] is None


def test_bench_comm_two_ranks(tmp_path):
    out = tmp_path / "comm.json"
    command = [sys.executable, "-m", "mpitrain", "bench", "comm", "-n", "2", "--sizes", "1K..64K",
               "--ops", "all_reduce,all_gather,sendrecv", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), **OVERSUBSCRIBED_ENV)
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, describe(result)
    assert "algbw (GB/s)" in result.stdout and "busbw (GB/s)" in result.stdout
    for op in ("all_reduce", "all_gather", "sendrecv"):
        assert f"# {op} on group world (2 ranks)" in result.stdout
        assert f"fit {op} on world: alpha" in result.stdout
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and len(report["results"]) == 3 * 7
    fit = report["fit"]["all_reduce"]["world"]
    assert fit["ranks"] == 2 and fit["alpha_s"] >= 0 and fit["beta_s_per_byte"] >= 0
    row = report["results"][0]
    assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 1.0)  # all_reduce on 2 ranks: 2(n-1)/n = 1
