"""The bad-step verdict and the stop request share one 8-byte all-reduce per step (resilience/guard.py): every rank's
verdict and stop flag are seen whatever the others' (a bitwise OR, not a max of a packed number); a 2-rank run makes
exactly one world collective per step; a SIGUSR1 to rank 1 alone stops both ranks after the same step, saved.

Jobs are waited for with generous subprocess deadlines only: no test reads a clock to judge speed."""
from __future__ import annotations

import os
import signal
import sys
import time
from functools import reduce
from operator import or_
from types import SimpleNamespace

import numpy as np

from mpitrain.resilience.faults import FaultPlan
from mpitrain.resilience.guard import GOOD, NONFINITE_GRAD, NONFINITE_LOSS, SPIKE, TOLD_TO_SKIP, BadStepGuard
from mpitrain.resilience.heartbeat import read_heartbeats
from tests.mpi_helpers import describe, find_mpiexec, run_mpi, run_python_mpi_results
from tests.test_watchdog import finish_job, start_job, tiny_settings


class OredWorld:
    """A world whose other ranks sent `others` (their words); records every collective this rank makes."""

    def __init__(self, *others: int):
        self.others, self.calls = others, []

    def all_reduce_bits(self, bits):
        self.calls.append(("all_reduce_bits", bits))
        return reduce(or_, self.others, bits)

    def all_reduce_scalar(self, x, op="sum"):
        self.calls.append(("all_reduce_scalar", x))
        return x


def guard_on(world) -> BadStepGuard:
    cfg = SimpleNamespace(skip_steps=[3], spike_zscore=0.0, spike_window=3, max_bad_steps=2)
    return BadStepGuard(cfg, world, FaultPlan([], rank=0))


# (step done, loss, gradient norm) that give a rank each local verdict (step 3 is in fault.skip_steps)
INPUTS = {GOOD: (1, 3.0, 1.0), TOLD_TO_SKIP: (3, 3.0, 1.0), NONFINITE_GRAD: (1, 3.0, np.inf),
          NONFINITE_LOSS: (1, np.nan, 1.0)}


def word_of(verdict: int, stop: bool) -> int:
    """What a rank with this local verdict and stop flag sends (the encoding under test, built from the guard)."""
    world = OredWorld()
    guard_on(world).step_verdict(*INPUTS[verdict], stop)
    return world.calls[0][1]


def test_every_ranks_verdict_and_stop_are_seen_in_one_collective():
    cases = [  # (this rank: verdict, stop), (another rank: verdict, stop) -> (step's verdict, stop)
        ((GOOD, False), (GOOD, False), (GOOD, False)),
        ((GOOD, True), (NONFINITE_GRAD, False), (NONFINITE_GRAD, True)),  # a max of one packed number loses one
        ((NONFINITE_GRAD, False), (GOOD, True), (NONFINITE_GRAD, True)),
        ((TOLD_TO_SKIP, False), (NONFINITE_LOSS, False), (NONFINITE_LOSS, False)),
        ((NONFINITE_LOSS, True), (TOLD_TO_SKIP, True), (NONFINITE_LOSS, True)),
    ]
    for (mine, stop), other, expected in cases:
        world = OredWorld(word_of(*other))
        assert tuple(guard_on(world).step_verdict(*INPUTS[mine], stop)) == expected
        assert [name for name, _ in world.calls] == ["all_reduce_bits"]
    assert SPIKE > TOLD_TO_SKIP and GOOD == 0  # the precedence the highest bit gives


def test_the_word_is_one_8_byte_control_message_on_two_ranks():
    results = run_python_mpi_results(2, """
        import json
        from mpi4py import MPI
        from mpitrain.comm.group import Group
        world = Group(MPI.COMM_WORLD, "world")
        word = world.all_reduce_bits((1 << 3) if world.rank == 1 else (1 | 1 << 16))
        counters = world.counters()
        gathered = MPI.COMM_WORLD.gather((word, counters["control"], world.progress.entered), root=0)
        if world.rank == 0:
            print("RESULTS " + json.dumps(gathered))
    """)
    for word, control_bytes, entered in results:
        assert word == 1 | 1 << 3 | 1 << 16 and control_bytes == 8 and entered == {"world@0": 1}


def world_operations(run_dir, steps: int) -> int:
    """Operations the 2-rank run of `steps` steps entered on the world group (from rank 0's last heartbeat)."""
    result = run_mpi(2, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir),
                         *tiny_settings(f"train.steps={steps}", "train.log_every=1000", "train.eval_every=0")],
                     timeout=240)
    assert result.returncode == 0, describe(result)
    return read_heartbeats(run_dir / "heartbeat")[0]["entered"]["world@0"]


def test_one_world_collective_per_step(tmp_path):
    """Start-up, the first logged step, the last step's evaluation and the final save cost the same in both runs;
    each step costs its verdict-and-stop all-reduce, nothing else on the world group."""
    short, long = world_operations(tmp_path / "short", 4), world_operations(tmp_path / "long", 10)
    assert (long - short) / (10 - 4) == 1


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    run_dir = tmp_path / "run"
    process = start_job([find_mpiexec(), "-n", "2", sys.executable, "-m", "mpitrain", "train", "configs/tiny.toml",
                         "--out", str(run_dir), *tiny_settings("train.steps=100000")],
                        env={"MPITRAIN_FAULT": "slow:factor=20"})  # sleeps only: still running when signalled
    pid = None
    while process.poll() is None and pid is None:
        beats = read_heartbeats(run_dir / "heartbeat") if (run_dir / "heartbeat").is_dir() else {}
        if beats.get(1, {}).get("step", 0) >= 3 and beats[1].get("state") == "running":
            pid = beats[1]["pid"]
        time.sleep(0.05)
    assert pid is not None, describe(finish_job(process))
    os.kill(pid, signal.SIGUSR1)
    result = finish_job(process)
    assert result.returncode == 75, describe(result)
    assert "stop requested (signal on another rank): saved step " in result.stdout, describe(result)
    beats = read_heartbeats(run_dir / "heartbeat")
    assert beats[0]["step"] == beats[1]["step"] and beats[0]["state"] == beats[1]["state"] == "finished", beats
    saved = int(result.stdout.split("(signal on another rank): saved step ")[1].split(";")[0])
    assert (run_dir / "checkpoints" / f"step_{saved:08d}" / "COMMITTED").is_file()
    assert not (run_dir / ".lock").exists()  # released on the way out of a stop request (run/lock.py)

