"""Fault soak: a long run under randomly timed kills, hangs, NaNs, bit flips and slow ranks, restarted automatically,
that must end with every loss of an uninterrupted run of the same config, bitwise.

    python benchmarks/soak.py [--minutes 20 | --steps N] [--seed 0] [--out /tmp/soak/run]

Two runs of configs/tiny.toml on 2 ranks (float64, synthetic data) go side by side: the reference, uninterrupted,
and the soak, under `mpitrain launch --max-restarts` with MPITRAIN_FAULT set to a seeded random plan of at least one
fault of each kind. Each fault kind is one that the toolkit's handling undoes exactly, so that "bitwise equal" holds:
    kill      SIGKILL at a step's start: the job fails, and the restart resumes from the last checkpoint
              (checkpoint.every = 5) and computes the steps since again, bitwise as before
    hang      SIGSTOP: the peer's watchdog ends the job after fault.timeout_s, then as a kill
    flip      a parameter bit flipped on one rank after its update: the replica check (fault.sdc_every = 1, also run
              before every save) stops the job before any checkpoint holds it, then as a kill
    nan       one rank's gradient turns NaN; gradflip: one rank's largest gradient element's top exponent bit
              flips: the step is bad, and fault attribution (fault.attribute) replays it; the fault does not come
              back (transient), so the replay's update is applied and the trajectory does not change. (Without
              attribution a bad step's update is skipped, which does change the trajectory: the soak would fail.)
    slow      one rank computes `factor` times slower for a few steps: only the clock changes; the straggler report
              should name it
Printed at the end: the faults injected and detected by kind, the time lost to restarts (`launch`'s own accounting),
and the steps lost: steps of the reference run whose loss the soak run lacks or differs from (must be 0).
--minutes sets the number of steps from the measured step time of the two runs side by side (a short calibration
first), so that the soak run takes about that long; --steps sets it directly (the test's short version).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from mpitrain.resilience.faults import parse_faults  # noqa: E402  (the repository on the path first)
from mpitrain.resilience.faulty_hosts import read_faults  # noqa: E402

CHECKPOINT_EVERY = 5
SETTINGS = ["data.synthetic=true", "precision.compute=float64", "logging.peak_flops=1e9", "train.log_every=1",
            f"checkpoint.every={CHECKPOINT_EVERY}", "checkpoint.keep=3", "fault.attribute=true", "fault.sdc_every=1",
            "fault.straggler_factor=1.3", "fault.straggler_steps=3", "train.eval_every=0"]
KINDS = ("kill", "hang", "flip", "nan", "gradflip", "slow")
RESTARTING = ("kill", "hang", "flip")  # detected by ending the job: one failed attempt each
STEPS_PER_FAULT = 40  # --steps: on average one fault of some kind every this many steps (at least one of each)
SECONDS_PER_FAULT = 45  # --minutes: one fault about every this many seconds of the soak run
RESTART_COST_S = 15.0  # about what a restart costs here (start-up, the hang timeout, steps redone): --minutes
SLOW_FACTOR, SLOW_STEPS = 3.0, 6
RANK_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true"}


def fault_plan(steps: int, seed: int, count: int = 0) -> list[str]:
    """A seeded random MPITRAIN_FAULT plan over steps 3..steps-1: `count` faults (0: one every STEPS_PER_FAULT
    steps), at least one of each kind, each on its own step (and a slow window clear of the others)."""
    rng = random.Random(seed)
    count = max(len(KINDS), count or steps // STEPS_PER_FAULT)
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(count - len(KINDS))]
    candidates = list(range(3, steps))
    if len(candidates) < len(kinds) * (SLOW_STEPS + 1):
        raise SystemExit(f"soak: {steps} steps are too few for {len(kinds)} faults; use --steps "
                         f"{3 + len(kinds) * (SLOW_STEPS + 1)} or more")
    taken: set[int] = set()
    plan = []
    for kind in kinds:
        width = SLOW_STEPS if kind == "slow" else 1
        step = rng.choice([s for s in candidates if s + width <= steps and not taken & set(range(s, s + width))])
        taken |= set(range(step, step + width))
        rank = rng.randrange(2)
        if kind == "slow":
            plan.append(f"slow:rank={rank}:step={step}:until={step + width - 1}:factor={SLOW_FACTOR:g}")
        else:
            plan.append(f"{kind}:rank={rank}:step={step}")
    return sorted(plan, key=lambda text: parse_faults(text)[0].step)


def train_command(run_dir: Path, steps: int, extra: list[str]) -> list[str]:
    args = ["configs/tiny.toml", "--out", str(run_dir)]
    for setting in [*SETTINGS, f"train.steps={steps}", *extra]:
        args += ["--set", setting]
    return args


def environment(fault: str = "") -> dict:
    env = {**os.environ, **RANK_ENV, "MPITRAIN_FAULT": fault}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def start_reference(run_dir: Path, steps: int, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "mpitrain", "launch", "-n", "2", *train_command(run_dir, steps, [])]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=environment(), stdout=log, stderr=subprocess.STDOUT)


def start_soak(run_dir: Path, steps: int, plan: list[str], hang_timeout: float, log) -> subprocess.Popen:
    restarts = sum(1 for fault in plan if fault.split(":")[0] in RESTARTING) + 2  # and two spare
    command = [sys.executable, "-m", "mpitrain", "launch", "-n", "2", "--max-restarts", str(restarts),
               *train_command(run_dir, steps, [f"fault.timeout_s={hang_timeout:g}"])]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=environment(";".join(plan)), stdout=log,
                            stderr=subprocess.STDOUT)


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Each logged step's loss; a step logged again after a restart keeps its last row."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {row["step"]: row["loss"] for row in rows}


def seconds_per_step(out: Path, hang_timeout: float) -> float:
    """The wall time per step of the two runs side by side (12 steps each, start-up excluded)."""
    runs = [out / "calibrate_reference", out / "calibrate_soak"]
    with open(out / "calibrate.log", "w") as log:
        jobs = [start_reference(runs[0], 12, log), start_soak(runs[1], 12, [], hang_timeout, log)]
        if any(job.wait() for job in jobs):
            raise SystemExit(f"soak: the calibration runs failed; see {out / 'calibrate.log'}")
    per_step = []
    for run in runs:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        per_step.append((rows[-1]["time"] - rows[1]["time"]) / (len(rows) - 2))
    return max(per_step)


def compare(reference: dict[int, float], soaked: dict[int, float]) -> list[int]:
    """The steps of the reference whose loss the soak run lacks or holds otherwise (bitwise)."""
    return [step for step, loss in sorted(reference.items()) if soaked.get(step) != loss]


def injected(run_dir: Path, plan: list[str], last_step: int) -> dict[str, int]:
    """Faults that struck, by kind: the one-shot ones from RUN_DIR/injected_faults.jsonl, slow ones whose window
    the run reached."""
    counts = dict.fromkeys(KINDS, 0)
    path = run_dir / "injected_faults.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        counts[json.loads(line)["kind"]] += 1
    counts["slow"] = sum(1 for fault in map(parse_faults, plan) if fault[0].kind == "slow" and fault[0].step
                         <= last_step)
    return counts


def detected(run_dir: Path, output: str) -> dict[str, int]:
    """Faults the run noticed, by how: failed attempts (kill, hang and flip end the job), the replica check's sdc
    records (flip), replayed bad steps by verdict (nan, gradflip), straggler reports (slow)."""
    records = read_faults(run_dir)
    counts = {"failed attempts": len(re.findall(r"launch: attempt \d+ failed", output)),
              "watchdog hang reports": output.count("HANG at step"),
              "sdc (replica check)": sum(1 for r in records if r["kind"] == "sdc")}
    for verdict in ("transient", "genuine", "persistent"):
        counts[f"replayed: {verdict}"] = sum(1 for r in records if r.get("verdict") == verdict)
    counts["straggler reports"] = len(set(re.findall(r"straggler: rank (\d+) .* at step (\d+)", output)))
    return counts


def slow_windows_reported(plan: list[str], output: str) -> int:
    """Slow faults that a straggler report named: their rank, at a step of their window."""
    reports = {(int(rank), int(step)) for rank, step in re.findall(r"straggler: rank (\d+) .* at step (\d+)", output)}
    slow = [fault for text in plan for fault in parse_faults(text) if fault.kind == "slow"]
    return sum(1 for f in slow if any((f.rank, step) in reports for step in range(f.step, f.until + 1)))


def summarize(out: Path, plan: list[str], reference: dict, soaked: dict, output: str, status: int,
              wall_s: float) -> dict:
    run_dir = out / "soak"
    lost = compare(reference, soaked)
    summary = {"steps": len(reference), "soak_wall_s": round(wall_s, 1), "soak_exit_status": status,
               "faults_planned": len(plan), "injected": injected(run_dir, plan, max(soaked, default=0)),
               "detected": {**detected(run_dir, output), "slow windows reported": slow_windows_reported(plan, output)},
               "restarts": len(re.findall(r"launch: restart \d+ \(attempt", output)),
               "time_lost_s": round(sum(map(float, re.findall(r"time lost ([0-9.]+) s", output))), 1),
               "steps_lost": len(lost), "first_steps_lost": lost[:10],
               "losses_bitwise_equal": not lost and len(soaked) == len(reference)}
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="about how long the soak run takes")
    parser.add_argument("--steps", type=int, default=0, help="the steps of both runs (instead of --minutes)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the fault plan")
    parser.add_argument("--hang-timeout", type=float, default=10.0, help="fault.timeout_s of the soak run")
    parser.add_argument("--out", default="/tmp/soak/run", help="scratch directory (emptied first)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    steps, count = args.steps, 0
    if not steps:  # the steps that fill the minutes, less what the restarts are likely to cost
        per_step = seconds_per_step(out, args.hang_timeout)
        count = max(len(KINDS), round(args.minutes * 60 / SECONDS_PER_FAULT))
        restarts = count * len(RESTARTING) / len(KINDS)
        # 25 % more: the soak run speeds up once the reference, ahead of it, is done (10 % more gave 19.1 min for 20)
        steps = max(60, round(1.25 * (args.minutes * 60 - restarts * RESTART_COST_S) / per_step))
        print(f"soak: {per_step:.3f} s per step with both runs side by side: {steps} steps and {count} faults for "
              f"about {args.minutes:g} min")
    plan = fault_plan(steps, args.seed, count)
    print(f"soak: {steps} steps, seed {args.seed}, MPITRAIN_FAULT={';'.join(plan)}", flush=True)
    started = time.time()
    with open(out / "reference.log", "w") as ref_log, open(out / "soak.log", "w") as soak_log:
        reference_job = start_reference(out / "reference", steps, ref_log)
        soak_job = start_soak(out / "soak", steps, plan, args.hang_timeout, soak_log)
        status = soak_job.wait()
        wall_s = time.time() - started
        if reference_job.wait():
            raise SystemExit(f"soak: the reference run failed; see {out / 'reference.log'}")
    reference = losses_by_step(out / "reference")
    output = (out / "soak.log").read_text()
    summary = summarize(out, plan, reference, losses_by_step(out / "soak"), output, status, wall_s)
    (out / "summary.json").write_text(json.dumps({**summary, "plan": plan}, indent=1))
    print(f"soak: {summary['steps']} steps in {summary['soak_wall_s']:.0f} s (exit status {status}), "
          f"{summary['restarts']} restarts")
    print(f"  injected: {summary['injected']}")
    print(f"  detected: {summary['detected']}")
    print(f"  time lost to restarts: {summary['time_lost_s']:.1f} s")
    print(f"  steps lost: {summary['steps_lost']} {summary['first_steps_lost'] or ''}; losses bitwise equal to the "
          f"uninterrupted run: {summary['losses_bitwise_equal']}")
    return 0 if summary["losses_bitwise_equal"] and status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
