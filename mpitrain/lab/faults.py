"""Faults: a rank killed mid-run is detected, the job restarts from the last checkpoint and ends exactly where an
uninterrupted run ends; the time lost is the steps since that checkpoint plus the restart, which Young/Daly's
interval sqrt(2 x save time x MTBF) balances against the time spent saving.

Unlike the other labs this one runs `mpitrain launch` (twice: uninterrupted, then with MPITRAIN_FAULT killing
rank 1), since the restart is the launcher's. Checked: the checkpoint it resumes from, the steps redone, and that
every logged loss equals the uninterrupted run's bitwise (float64). Shown: time lost, save and step times, and the
fraction of time lost against the checkpoint interval for an assumed MTBF.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from mpitrain.errors import MpitrainError
from mpitrain.lab.runner import OVERSUBSCRIBED, REPO_ROOT, Row

NAME = "faults"
TITLE = "A killed rank: detected, restarted from the last checkpoint, time lost vs Young/Daly"
PANELS = 2
MTBF_HOURS = 1.0  # assumed for the advice: one failure an hour, about what 10k+ GPU jobs see
NOTICE = ("What to notice: the restarted run logs the same losses as the uninterrupted one, bit for bit: the data "
          "of step s is a function of (seed, s) and the checkpoint holds the whole state. The time lost is the "
          "restart (MPI start-up, loading) plus the steps since the last save; Young/Daly's interval minimises "
          "save time + redone work for a given MTBF, and the curve is flat near its minimum.")


def ranks(quick: bool) -> int:
    return 2


def plan(quick: bool) -> dict:
    return {"steps": 8, "every": 3, "kill": 6} if quick else {"steps": 24, "every": 8, "kill": 14}


def _launch(run_dir: Path, quick: bool, fault: str | None) -> str:
    p = plan(quick)
    settings = ["data.synthetic=true", "precision.compute=float64", f"train.steps={p['steps']}",
                f"checkpoint.every={p['every']}", "logging.peak_flops=1e9", "train.log_every=1", "fault.timeout_s=20"]
    command = [sys.executable, "-m", "mpitrain", "launch", "-n", "2", "--max-restarts", "1", "configs/tiny.toml",
               "--out", str(run_dir), *[arg for s in settings for arg in ("--set", s)]]
    env = {**os.environ, **OVERSUBSCRIBED}
    env.pop("MPITRAIN_FAULT", None)
    if fault:
        env["MPITRAIN_FAULT"] = fault
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, text=True, capture_output=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        raise MpitrainError("lab faults: mpitrain launch did not finish within 300 s") from exc
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise MpitrainError("lab faults: mpitrain launch failed:\n" + "\n".join(output.splitlines()[-15:]))
    return output


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows


def run_host(quick: bool) -> dict:
    from mpitrain.resilience.advice import newest_save_seconds
    p = plan(quick)
    with tempfile.TemporaryDirectory(prefix="mpitrain-lab-faults-") as tmp:
        reference, faulted = Path(tmp) / "reference", Path(tmp) / "faulted"
        _launch(reference, quick, None)
        output = _launch(faulted, quick, f"kill:rank=1:step={p['kill']}")
        resumed = re.search(r"restart 1 of 1 from the checkpoint of step (\d+)", output)
        lost = re.search(r"time lost ([0-9.]+) s, from the save of step \d+.*?(\d+) logged steps redone", output)
        reference_rows, faulted_rows = _rows(reference), _rows(faulted)
        save = newest_save_seconds(faulted / "checkpoints")
    if not (resumed and lost):
        raise MpitrainError("lab faults: the launcher did not report a restart:\n" + output[-2000:])
    return {**p, "resumed_from": int(resumed.group(1)), "time_lost": float(lost.group(1)),
            "redone": int(lost.group(2)), "save_seconds": save or 0.0,
            "reference": {r["step"]: r["loss"] for r in reference_rows},
            "faulted": [[r["step"], r["loss"], r["time"]] for r in faulted_rows],
            "step_seconds": sorted(r["time"] - q["time"] for q, r in itertools.pairwise(reference_rows))}


def rows(result: dict) -> list[Row]:
    from mpitrain.resilience.advice import advise
    every, kill = result["every"], result["kill"]
    last_save = (kill - 1) // every * every  # the last checkpoint committed before step `kill` started
    final = {step: loss for step, loss, _ in result["faulted"]}  # a step logged again keeps its last row
    reference = {int(k): v for k, v in result["reference"].items()}
    differing = sum(final.get(step) != loss for step, loss in reference.items())
    step_seconds = result["step_seconds"][len(result["step_seconds"]) // 2]
    advice = advise(result["save_seconds"], step_seconds, MTBF_HOURS, every)
    return [
        Row(f"rank 1 killed at step {kill}: resumes from", f"last save before it, {every} x floor(({kill}-1)/{every})"
            f" = step {last_save}", f"step {result['resumed_from']}", result["resumed_from"], last_save),
        Row("logged steps redone", f"{kill} - 1 - {last_save} = {kill - 1 - last_save}", str(result["redone"]),
            result["redone"], kill - 1 - last_save),
        Row("losses differing from the uninterrupted run", "0 (bitwise, float64)", f"{differing} of {len(reference)}",
            differing, 0),
        Row("time lost to the fault", "restart + redone steps", f"{result['time_lost']:.1f} s (step "
            f"{step_seconds * 1e3:.0f} ms, save {result['save_seconds'] * 1e3:.0f} ms)"),
        Row(f"Young/Daly interval at MTBF {MTBF_HOURS:g} h", "sqrt(2 x save x MTBF)",
            f"{advice.interval_seconds:.0f} s = {advice.interval_steps} steps, loses "
            f"{100 * advice.fraction_lost:.2f}% (every {every}: {100 * advice.current_fraction_lost:.2f}%)"),
    ]


def plot(result: dict, axes) -> None:
    from mpitrain.resilience.advice import fraction_lost, young_daly_interval
    reference = sorted((int(k), v) for k, v in result["reference"].items())
    axes[0].plot([s for s, _ in reference], [v for _, v in reference], "-", color="k", lw=3, alpha=0.3,
                 label="uninterrupted")
    first = [row for row in result["faulted"] if row[0] <= result["resumed_from"]]  # the resume drops later rows
    again = [row for row in result["faulted"] if row[0] > result["resumed_from"]]
    for rows, colour, label in ((first, "tab:red", "attempt 0 (killed, kept up to its save)"),
                                (again, "tab:blue", "attempt 1 (resumed)")):
        axes[0].plot([r[0] for r in rows], [r[1] for r in rows], "o-", color=colour, ms=3, label=label)
    axes[0].axvline(result["kill"], color="tab:red", ls=":", lw=1)
    axes[0].set(xlabel="step", ylabel="loss", title=f"killed at step {result['kill']}, resumed from "
                f"{result['resumed_from']}")
    axes[0].legend(fontsize=7)
    save, mtbf = max(result["save_seconds"], 1e-3), MTBF_HOURS * 3600
    best = young_daly_interval(save, mtbf)
    intervals = [best * 2 ** (k / 4) for k in range(-16, 17)]
    axes[1].plot(intervals, [100 * fraction_lost(t, save, mtbf) for t in intervals], "-", color="tab:purple")
    axes[1].axvline(best, color="k", ls="--", lw=1, label=f"Young/Daly {best:.0f} s")
    axes[1].set(xscale="log", xlabel="checkpoint interval (s)", ylabel="time lost (%)",
                title=f"save {save * 1e3:.0f} ms, MTBF {MTBF_HOURS:g} h")
    axes[1].legend(fontsize=7)
