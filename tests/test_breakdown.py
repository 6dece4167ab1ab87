"""The step time breakdown (mpitrain/profile/breakdown.py) and the FLOP counts behind MFU (profile/flops.py).

What is checked never depends on how fast the machine is: the parts of every rank's step add up to its measured
step time, each part lands where it belongs (with a fake clock), and an injected delay in one kind of collective
shows up in that kind's exposed time at least as long as the delay itself.
"""
from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest
from mpi_helpers import describe, run_mpi

from mpitrain.backend import Backend
from mpitrain.comm.operations import Operation, ProgressRecord
from mpitrain.config import ModelConfig
from mpitrain.errors import ConfigError
from mpitrain.parallel.timeline import Timeline
from mpitrain.profile.breakdown import (
    Breakdown,
    RunSummary,
    comm_kind,
    device_synchronize,
    format_summary,
    max_over_ranks,
    parse_delays,
    parts_total,
)
from mpitrain.profile.flops import block_matmul_weights, recomputed_flops_per_token, table_peak


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def tick(self, seconds):
        self.now += seconds


def _operation(name, group):
    return Operation(name, group, (0, 1), f"{group}@0", 1, 8, (1,))


def test_comm_kinds():
    assert comm_kind(_operation("iall_reduce", "dp")) == "all_reduce.dp"
    assert comm_kind(_operation("all_reduce", "tp")) == "all_reduce.tp"
    assert comm_kind(_operation("irecv", "pp")) == "recv.pp"
    assert comm_kind(_operation("isend", "pp")) == "send.pp"
    assert comm_kind(_operation("all_reduce_scalar", "world")) == "control.world"
    assert comm_kind(_operation("ireduce_scatter", "dp")) == "reduce_scatter.dp"


def test_parts_are_exclusive_and_add_up():
    """Nested parts and waits take their time out of what surrounds them; the parts sum to the step exactly."""
    clock = FakeClock()
    breakdown = Breakdown(clock, delays={})
    record = ProgressRecord(0)
    record.listener = breakdown
    timeline = Timeline(0, clock)
    timeline.breakdown = breakdown
    clock.tick(5.0)  # before the step: not counted
    breakdown.start_step()
    clock.tick(0.5)  # other
    with breakdown.part("data"):
        clock.tick(1.0)
    with timeline.record("forward", 0):
        clock.tick(2.0)
        record.begin_wait(_operation("all_reduce", "tp"))
        clock.tick(0.25)
        record.end_wait()
        clock.tick(1.0)
    with timeline.record("backward", 0):
        clock.tick(3.0)
        with breakdown.part("backward_weight"):
            clock.tick(1.5)
    with timeline.record("recv_backward", 1):  # waiting on a neighbour: the wait is the bubble
        record.begin_wait(_operation("irecv", "pp"))
        clock.tick(0.75)
        record.end_wait()
    record.begin_wait(_operation("isend", "pp"))  # the executor waiting for its sends to be received
    clock.tick(0.25)
    record.end_wait()
    breakdown.push("optimizer")
    clock.tick(0.5)
    record.begin_wait(_operation("all_reduce_scalar", "world"))
    clock.tick(0.125)
    record.end_wait()
    breakdown.pop()
    parts = breakdown.finish_step()
    assert parts["data"] == 1.0 and parts["forward"] == 3.0 and parts["comm.all_reduce.tp"] == 0.25
    assert parts["backward_input"] == 3.0 and parts["backward_weight"] == 1.5
    assert parts["pipeline_bubble"] == 1.0 and "comm.recv.pp" not in parts and "comm.send.pp" not in parts
    assert parts["optimizer"] == 0.5 and parts["comm.control.world"] == 0.125 and parts["other"] == 0.5
    assert parts["step_s"] == pytest.approx(clock.now - 5.0)
    assert parts_total(parts) == pytest.approx(parts["step_s"])
    assert breakdown.waits == {"all_reduce.tp": 1, "control.world": 1}


def test_checkpoint_between_steps_is_carried_and_the_rest_dropped():
    clock = FakeClock()
    breakdown = Breakdown(clock, delays={})
    breakdown.start_step()
    clock.tick(1.0)
    first = breakdown.finish_step()
    clock.tick(7.0)  # logging, validation: no step's time
    with breakdown.part("checkpoint"):
        clock.tick(2.0)
        breakdown.begin_wait(_operation("all_reduce_scalar", "world"))  # a checkpoint's own collective
        clock.tick(0.5)
        breakdown.end_wait()
    clock.tick(3.0)
    breakdown.start_step()
    clock.tick(1.0)
    with breakdown.excluded():
        clock.tick(10.0)
    second = breakdown.finish_step()
    assert first["step_s"] == 1.0 and first["checkpoint"] == 0.0
    assert second["checkpoint"] == 2.5 and second["other"] == 1.0 and second["step_s"] == 3.5
    assert parts_total(second) == pytest.approx(second["step_s"])


class QueuedDevice:
    """A GPU as its host sees it: launched work returns at once; synchronizing waits (the clock runs) until it ran."""

    def __init__(self, clock):
        self.clock, self.queued, self.synchronized = clock, 0.0, 0

    def launch(self, seconds):
        self.queued += seconds

    def synchronize(self):
        self.synchronized += 1
        self.clock.tick(self.queued)
        self.queued = 0.0


@dataclasses.dataclass(frozen=True)
class RecordingBackend(Backend):
    device_model: QueuedDevice = None

    def synchronize(self):
        self.device_model.synchronize()


def queued_step(backend, device, clock):
    """A step whose parts each queue device work and return at once; the breakdown of `backend`'s choosing."""
    breakdown = Breakdown(clock, delays={}, synchronize=device_synchronize(backend))
    breakdown.start_step()
    with breakdown.part("forward"):
        device.launch(2.0)  # kernels queued
        clock.tick(0.125)  # the host's own time
    breakdown.begin_wait(_operation("iall_reduce", "dp"))  # the compute stream waits on the reduction's event
    device.launch(0.5)
    breakdown.end_wait()
    with breakdown.part("optimizer"):
        device.launch(1.0)
    return breakdown.finish_step()


def test_a_device_backend_is_synchronized_at_every_part_boundary_and_numpy_never():
    """On a GPU each part must be charged the device work it queued, not where the host next blocks: with a CuPy
    backend the breakdown synchronizes at every boundary (8 here: the step's start and end, 3 parts in and out)."""
    clock = FakeClock()
    device = QueuedDevice(clock)
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Stream=types.SimpleNamespace(null=types.SimpleNamespace(synchronize=device.synchronize))))
    parts = queued_step(Backend("cuda", fake_cupy, np.dtype(np.float32)), device, clock)  # Backend.synchronize
    assert device.synchronized == 8
    assert parts["forward"] == 2.125 and parts["comm.all_reduce.dp"] == 0.5 and parts["optimizer"] == 1.0
    assert parts["step_s"] == parts_total(parts) == 3.625

    clock, on_host = FakeClock(), QueuedDevice(FakeClock())
    parts = queued_step(RecordingBackend("cpu", np, np.dtype(np.float32), device_model=on_host), on_host, clock)
    assert on_host.synchronized == 0, "numpy has nothing to synchronize"
    assert parts["forward"] == 0.125 and parts["comm.all_reduce.dp"] == 0.0


def test_summary_and_delays():
    summary = RunSummary()
    summary.add({"forward": 1.0, "other": 0.5, "step_s": 1.5})
    summary.add({"forward": 3.0, "other": 0.5, "step_s": 3.5})
    assert summary.means() == {"forward": 2.0, "other": 0.5, "step_s": 2.5}
    worst = max_over_ranks([summary.means(), {"forward": 1.0, "comm.all_reduce.dp": 4.0, "step_s": 5.0}])
    assert worst == {"forward": 2.0, "other": 0.5, "step_s": 5.0, "comm.all_reduce.dp": 4.0}
    table = format_summary([summary.means()], 2)
    assert "forward" in table and "2000.00 ms" in table
    assert parse_delays("all_reduce.dp=0.05, all_gather.tp=1") == {"all_reduce.dp": 0.05, "all_gather.tp": 1.0}
    with pytest.raises(ConfigError, match="MPITRAIN_COMM_DELAY"):
        parse_delays("all_reduce.dp")


def test_recomputed_flops():
    """Full recomputation repeats each block's forward (2 per matmul weight + attention's 4 d s), selective only
    attention's products; recompute_layers counts blocks per pipeline stage."""
    cfg = ModelConfig(arch="gpt2", n_layer=4, d_model=64, n_head=4, seq_len=32)
    assert block_matmul_weights(cfg) == 12 * 64 * 64
    attention = 4 * 64 * 32
    assert recomputed_flops_per_token(cfg, [2, 2], "none") == 0
    assert recomputed_flops_per_token(cfg, [2, 2], "selective") == 4 * attention
    assert recomputed_flops_per_token(cfg, [2, 2], "full") == 4 * (attention + 2 * 12 * 64 * 64)
    assert recomputed_flops_per_token(cfg, [3, 1], "full", layers=1) == 2 * (attention + 2 * 12 * 64 * 64)
    llama = ModelConfig(arch="llama", n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=96)
    assert block_matmul_weights(llama) == 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96


def test_known_peaks():
    assert table_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert table_peak("NVIDIA H200", "float32") == 494.5e12
    assert table_peak("NVIDIA A100-SXM4-40GB", "float16") == 312e12
    assert table_peak("NVIDIA B200", "bfloat16") == 2.25e15
    assert table_peak("Tesla T4", "bfloat16") is None


# ---- real runs ------------------------------------------------------------------------------------------------------
def _train(tmp_path, n, settings, env=None):
    run_dir = tmp_path / "run"
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir), "--set", "data.synthetic=true",
            "--set", "logging.peak_flops=1e9", "--set", "train.eval_batches=1"]
    for setting in settings:
        args += ["--set", setting]
    result = run_mpi(n, args, timeout=300, env=env)
    assert result.returncode == 0, describe(result)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, rows, json.loads((run_dir / "breakdown.json").read_text())


def _check_sums(rows, ranks):
    for row in rows:
        assert len(row["breakdown"]) == ranks
        for parts in row["breakdown"]:
            assert parts_total(parts) == pytest.approx(parts["step_s"], rel=0.02)
            assert parts["forward"] > 0 and parts["backward_input"] > 0 and parts["backward_weight"] > 0
        assert row["breakdown"][0]["step_s"] == pytest.approx(row["step_time_s"], rel=1e-5)


def test_tp2_pp2_parts_sum_to_the_step(tmp_path):
    """Also: 10 ms slept in every tensor-parallel all-reduce wait (inside forwards and backwards) is taken out of
    the compute parts and shows as that kind's exposed time."""
    delay = 0.01
    result, rows, summary = _train(tmp_path, 4, ["parallel.tp=2", "parallel.pp=2", "train.steps=4",
                                                 "checkpoint.every=2", "memory.recompute=full"],
                                   env={"MPITRAIN_COMM_DELAY": f"all_reduce.tp={delay}"})
    _check_sums(rows, 4)
    # per micro-batch and block: attention and MLP outputs forward, recomputed forward, their inputs backward
    blocks, micro_batches = 1, 2
    waits = 6 * blocks * micro_batches
    for row in rows:
        for parts in row["breakdown"]:
            assert parts["comm.all_reduce.tp"] >= delay * waits
    assert all(row["hardware_mfu"] > row["mfu"] for row in rows)  # full recomputation: more hardware FLOPs
    kinds = {key for row in rows for parts in row["breakdown"] for key in parts}
    assert "comm.all_reduce.tp" in kinds and "pipeline_bubble" in kinds
    assert all(parts["checkpoint"] > 0 for parts in rows[2]["breakdown"])  # step 2's save stalls step 3
    assert all(parts["checkpoint"] == 0 for parts in rows[1]["breakdown"])
    assert summary["steps"] == 4 and len(summary["per_rank"]) == 4
    assert summary["max_over_ranks"]["step_s"] >= max(row["step_time_s"] for row in rows) / 4
    assert "time breakdown: mean over 4 steps, max over 4 rank(s)" in result.stdout
    assert " | ETA 0:00:00" in result.stdout


def test_dp2_injected_delay_is_exposed(tmp_path):
    """A 50 ms sleep inside every wait on the dp gradient all-reduce: that kind's exposed time holds it."""
    delay = 0.05
    _, rows, summary = _train(tmp_path, 2, ["parallel.dp=2", "train.steps=3"],
                              env={"MPITRAIN_COMM_DELAY": f"all_reduce.dp={delay}"})
    _check_sums(rows, 2)
    for row in rows:
        for parts in row["breakdown"]:
            assert parts["comm.all_reduce.dp"] >= delay
    assert summary["max_over_ranks"]["comm.all_reduce.dp"] >= delay
