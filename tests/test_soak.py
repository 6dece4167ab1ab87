"""The fault soak (benchmarks/soak.py) in its short version: one fault of each kind (kill, hang, flip, nan, gradflip,
slow) over 50 steps of configs/tiny.toml on 2 ranks, restarted by `mpitrain launch`; every loss of the uninterrupted
run must be there, bitwise. Plus the seeded fault plan and the comparison it is judged by."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpitrain.resilience.faults import parse_faults
from tests.mpi_helpers import REPO_ROOT, find_mpiexec

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import soak


def test_the_fault_plan_is_seeded_and_holds_every_kind_on_steps_of_its_own():
    plan = soak.fault_plan(50, seed=1)
    assert plan == soak.fault_plan(50, seed=1) and plan != soak.fault_plan(50, seed=2)
    faults = [parse_faults(text)[0] for text in plan]
    assert sorted(f.kind for f in faults) == sorted(soak.KINDS)
    steps = [s for f in faults for s in (range(f.step, f.until + 1) if f.kind == "slow" else [f.step])]
    assert len(steps) == len(set(steps)) and all(3 <= s < 50 for s in steps)
    assert len(soak.fault_plan(2000, seed=0)) == 2000 // soak.STEPS_PER_FAULT
    with pytest.raises(SystemExit, match="too few"):
        soak.fault_plan(20, seed=0)


def test_a_slow_fault_lasts_from_its_step_to_until():
    (slow,) = parse_faults("slow:rank=1:step=4:until=6:factor=3")
    assert [s for s in range(1, 10) if slow.strikes(1, s)] == [4, 5, 6]


def test_steps_lost_are_the_reference_steps_missing_or_different():
    reference = {1: 2.5, 2: 2.25, 3: 2.125}
    assert soak.compare(reference, {1: 2.5, 2: 2.25, 3: 2.125, 4: 9.0}) == []
    assert soak.compare(reference, {1: 2.5, 3: 2.1250000000000004}) == [2, 3]


def test_short_soak_loses_no_step_and_ends_bitwise_as_the_uninterrupted_run(tmp_path):
    if find_mpiexec() is None:
        pytest.skip("no mpiexec beside the Python interpreter or on PATH")
    out = tmp_path / "soak"
    command = [sys.executable, "benchmarks/soak.py", "--steps", "50", "--seed", "1", "--out", str(out)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    shown = f"{result.stdout}\n{result.stderr}\n--- soak.log ---\n{(out / 'soak.log').read_text()[-6000:]}"
    assert result.returncode == 0, shown
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_lost"] == 0 and summary["losses_bitwise_equal"] and summary["steps"] == 50, shown
    injected, detected = summary["injected"], summary["detected"]
    assert all(injected[kind] == 1 for kind in soak.KINDS), shown
    # kill, hang and flip each end one attempt; nan and gradflip are each one transient replay
    assert detected["failed attempts"] == summary["restarts"] == 3, shown
    assert detected["watchdog hang reports"] >= 1 and detected["sdc (replica check)"] >= 1, shown
    assert detected["replayed: transient"] == 2, shown
    assert detected["replayed: genuine"] == detected["replayed: persistent"] == 0, shown
    assert summary["time_lost_s"] > 0, shown
