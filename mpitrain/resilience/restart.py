"""Automatic restart: `mpitrain launch --max-restarts K` runs the job again after a failure, from its last committed
checkpoint, and says what each failure cost.

A job that ends with status 0 is done; 75 means "stopped on request, saved" (SIGUSR1/SIGTERM): never restarted here,
the one who asked continues it. 73 (the run directory is in use by another live job, run/lock.py) and 74 (a
checkpoint could not be written: disk full, quota, read-only or I/O error; checkpoint/manager.py) are not restarted
either: a restart would meet the same job or the same disk. Any other status is a failure: the next attempt runs
the same command with `--resume auto` (the newest committed checkpoint that verifies) and MPITRAIN_ATTEMPT set to its
number (for the job's own logs; injected faults need no attempt number: each strikes once per run,
resilience/faults.py).

Time lost by a restart = the wall time from the save of the checkpoint it resumes from (the index's "created") to
the start of its first step (the first metrics.jsonl row it writes: "time" at the row's end minus "step_time_s").
It covers the steps done after that save and thrown away, noticing the failure, starting again and loading. The
steps redone are the rows the failed attempt logged after that save (logged steps only: with train.log_every > 1
it did more).
"""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mpitrain.config import CheckpointConfig, load_config
from mpitrain.errors import ConfigError
from mpitrain.profile.jsonl import read_records

STOPPED_EXIT_CODE = 75  # mpitrain.checkpoint.manager.PREEMPTED_EXIT_CODE (not imported: keep launch light)
RUN_DIR_IN_USE_EXIT_CODE = 73  # mpitrain.run.lock's
STORAGE_FAILED_EXIT_CODE = 74  # mpitrain.checkpoint.manager's
PEER_RECORD = "peer_latest.json"  # CKPT_DIR/peer_latest.json: the step and time of the newest peer copy in memory
NOT_RESTARTED = (0, STOPPED_EXIT_CODE, RUN_DIR_IN_USE_EXIT_CODE, STORAGE_FAILED_EXIT_CODE)
POLL_SECONDS = 0.25


# ----------------------------------------------------------------------------- what is on disk
@dataclass(frozen=True)
class SavedPoint:
    step: int
    saved_at: float  # Unix time of the commit
    save_seconds: float | None = None  # how long the save took (None: not recorded)


def saved_points(checkpoint_dir: Path) -> list[SavedPoint]:
    """The committed checkpoints, oldest first. The rule of mpitrain.checkpoint.store (step_* with COMMITTED, an
    index.json) read here without importing it: slurm/train.sbatch starts this module once per failure, and numpy
    and h5py cost seconds to import on a loaded node."""
    directory = Path(checkpoint_dir)
    points = []
    for marker in sorted(directory.glob("step_*/COMMITTED")) if directory.is_dir() else []:
        try:
            index = json.loads((marker.parent / "index.json").read_text())
            points.append(SavedPoint(int(index["step"]), float(index["created"]), index.get("save_seconds")))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return points


def last_committed(checkpoint_dir: Path) -> SavedPoint | None:
    """The newest committed checkpoint's step and save time (what `--resume auto` picks unless it fails to verify)."""
    points = saved_points(checkpoint_dir)
    return points[-1] if points else None


def peer_copy_point(checkpoint_dir: Path) -> SavedPoint | None:
    """The newest copy in node memory that every rank made (checkpoint/peer.py records it in PEER_RECORD), or None.
    Whether it survives a failure only the restart learns."""
    try:
        record = json.loads((Path(checkpoint_dir) / PEER_RECORD).read_text())
        return SavedPoint(int(record["step"]), float(record["created"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resumed_step(rows: list[dict], since: float) -> int | None:
    """The step an attempt continued from: its first logged row's step minus one (a resume logs its first step)."""
    later = [row for row in rows if row.get("time", 0.0) > since and "step" in row]
    return min(later, key=lambda row: row["time"])["step"] - 1 if later else None


def steps_logged_between(rows: list[dict], start: float, end: float) -> int:
    """How many rows were logged after `start` and up to `end` (steps done after a save, before a failure)."""
    return sum(1 for row in rows if start < row.get("time", 0.0) <= end)


def first_step_started(rows: list[dict], since: float) -> float | None:
    """When the first step logged after `since` began (the row's end time minus its step time)."""
    later = [row for row in rows if row.get("time", 0.0) > since]
    if not later:
        return None
    first = min(later, key=lambda row: row["time"])
    return first["time"] - first.get("step_time_s", 0.0)


def describe_status(status: int) -> str:
    """An exit status in words: 137 is SIGKILL, as shells report a killed child."""
    if status > 128 and status - 128 < signal.NSIG:
        try:
            return f"{status} ({signal.Signals(status - 128).name})"
        except ValueError:
            pass
    return str(status)


def with_resume_auto(train_args: list[str]) -> list[str]:
    """The train options with any --resume replaced by `--resume auto`."""
    kept, skip = [], False
    for arg in train_args:
        if skip:
            skip = False
            continue
        if arg == "--resume":
            skip = True
            continue
        if arg.startswith("--resume="):
            continue
        kept.append(arg)
    return [*kept, "--resume", "auto"]


# ----------------------------------------------------------------------------- the supervisor
@dataclass
class PendingRestart:
    """A restart whose time lost is known once its first step is logged."""
    number: int
    status: int
    failed_at: float
    started_at: float
    saved: SavedPoint | None
    steps_redone: int | None
    peer: SavedPoint | None = None  # a newer copy in node memory (checkpoint.peer_every), if the restart takes it
    peer_redone: int | None = None
    from_peer: bool = False

    def resumed_at(self, step: int | None) -> None:
        """Once the attempt logged its first step: count from the peer copy when that is where it continued."""
        if self.peer is not None and step == self.peer.step:
            self.saved, self.steps_redone, self.from_peer = self.peer, self.peer_redone, True

    def line(self, first_step_at: float | None) -> str:
        head = f"launch: restart {self.number} (attempt {self.number}) after exit status {describe_status(self.status)}"
        if self.saved is None:
            return (f"{head}: no committed checkpoint, started from step 0; failure to restart "
                    f"{self.started_at - self.failed_at:.1f} s")
        if first_step_at is None:
            return f"{head}: ended before its first step; time lost not known (checkpoint of step {self.saved.step})"
        redone = f", {self.steps_redone} logged steps redone" if self.steps_redone is not None else ""
        saved = "peer copy in memory" if self.from_peer else "save"
        return (f"{head}: time lost {first_step_at - self.saved.saved_at:.1f} s, from the {saved} of step "
                f"{self.saved.step} at {clock(self.saved.saved_at)} to the first step again at "
                f"{clock(first_step_at)} (failure to restart {self.started_at - self.failed_at:.1f} s{redone})")


def clock(unix_time: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix_time)) + f".{int(unix_time % 1 * 10)}"


class Supervisor:
    """Runs `command` (mpiexec ... mpitrain train ...) until it succeeds, stops on request, or fails K+1 times.
    SIGINT, SIGTERM and SIGUSR1 are passed on to the job (mpiexec forwards them to every rank); after a SIGTERM or
    SIGINT nothing is restarted (a cancelled job stays cancelled)."""

    def __init__(self, command: list[str], train_args: list[str], env: dict, max_restarts: int,
                 metrics_path: Path, checkpoint_dir: Path, echo):
        self.command, self.train_args = command, list(train_args)
        # the attempts are one job: a restarted one takes over the run directory's lock of the one before (run/lock.py)
        self.env = {"MPITRAIN_JOB_ID": f"launch-{os.getpid()}@{socket.gethostname()}", **env}
        self.max_restarts, self.metrics_path, self.checkpoint_dir = max_restarts, metrics_path, checkpoint_dir
        self.echo = echo
        self.process: subprocess.Popen | None = None
        self.cancelled = False
        self._metrics_seen = None  # (size, mtime) of metrics.jsonl when last read

    def _forward(self, signum, frame):
        if signum in (signal.SIGTERM, signal.SIGINT):
            self.cancelled = True
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
        try:
            return self._attempts()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _attempts(self) -> int:
        attempt, pending = 0, None
        while True:
            args = self.train_args if attempt == 0 else with_resume_auto(self.train_args)
            env = dict(self.env, MPITRAIN_ATTEMPT=str(attempt)) if attempt else self.env
            started = time.time()
            if pending is not None:
                pending.started_at = started
            self.process = subprocess.Popen([*self.command, *args], env=env)
            while self.process.poll() is None:
                time.sleep(POLL_SECONDS)
                pending = self._report_when_known(pending, started)
            status = self.process.returncode
            status = 128 - status if status < 0 else status  # killed by a signal: as a shell reports it
            ended = time.time()
            if pending is not None:  # ended before a first step was logged
                pending = self._report_when_known(pending, started, final=True)
            if status in NOT_RESTARTED or self.cancelled:
                return status
            if attempt >= self.max_restarts:
                self.echo(f"launch: attempt {attempt} failed with exit status {describe_status(status)}; "
                          f"no restart left (--max-restarts {self.max_restarts})")
                return status
            attempt += 1
            saved = last_committed(self.checkpoint_dir)
            after_save = max(started, saved.saved_at) if saved is not None else started
            rows = read_records(self.metrics_path)
            redone = steps_logged_between(rows, after_save, ended)
            peer = peer_copy_point(self.checkpoint_dir)
            peer = peer if peer is not None and peer.step > (saved.step if saved else 0) else None
            self.echo(f"launch: attempt {attempt - 1} failed with exit status {describe_status(status)}; restart "
                      f"{attempt} of {self.max_restarts} from "
                      + (f"the checkpoint of step {saved.step}" if saved else "step 0 (no committed checkpoint)")
                      + (f" or the peer copy of step {peer.step} in memory, if every rank's survived" if peer else ""))
            pending = PendingRestart(attempt, status, ended, ended, saved, redone, peer,
                                     peer and steps_logged_between(rows, max(started, peer.saved_at), ended))

    def _report_when_known(self, pending: PendingRestart | None, started: float, final: bool = False):
        if pending is None:
            return None
        if not final and not self._metrics_changed():
            return pending  # polled 4 times a second: parse a long run's metrics.jsonl only when a row was added
        rows = read_records(self.metrics_path)
        first = first_step_started(rows, started)
        if first is None and not final:
            return pending
        pending.resumed_at(resumed_step(rows, started))
        self.echo(pending.line(first))
        return None

    def _metrics_changed(self) -> bool:
        try:
            stat = Path(self.metrics_path).stat()
            seen = (stat.st_size, stat.st_mtime_ns)
        except OSError:
            seen = None
        changed, self._metrics_seen = seen != self._metrics_seen, seen
        return changed


# ----------------------------------------------------------------------------- the restarted attempt's first line
def restart_banner(checkpoint: Path, layout: str, env: dict, now: float) -> str | None:
    """For an attempt after a failure (MPITRAIN_ATTEMPT > 0, set by slurm/train.sbatch and `mpitrain launch`): which
    nodes it left out (MPITRAIN_LEFT_OUT), the checkpoint it resumes from, its layout, and the time lost so far (from
    that checkpoint's save to now; the batch script prints the whole, to the first step, once the attempt ends).
    None for a first attempt."""
    try:
        attempt = int(env.get("MPITRAIN_ATTEMPT", "0"))
    except ValueError:
        return None
    if attempt <= 0:
        return None
    left_out = env.get("MPITRAIN_LEFT_OUT", "")
    try:
        index = json.loads((Path(checkpoint) / "index.json").read_text())
        step, saved_at = int(index["step"]), float(index["created"])
        lost = f"time lost so far {now - saved_at:.1f} s (from the save of step {step} at {clock(saved_at)})"
    except (OSError, ValueError, KeyError, TypeError):
        step, lost = "?", "time lost not known (no readable index.json)"
    left = f"left out node {left_out}" if left_out else "no node left out"
    return f"restart (attempt {attempt}): {left}; resuming from {checkpoint} (step {step}) on {layout}; {lost}"


# ----------------------------------------------------------------------------- for slurm/train.sbatch
def run_checkpoint_dir(run_dir: Path) -> Path:
    """Where a run keeps its checkpoints: checkpoint.dir of RUN_DIR/config.toml (the trainer writes it), else
    RUN_DIR/checkpoints."""
    try:
        checkpoint = load_config(run_dir / "config.toml").checkpoint if (run_dir / "config.toml").is_file() else None
    except ConfigError:
        checkpoint = None
    return (checkpoint or CheckpointConfig()).directory(run_dir)


def seconds_to_next_checkpoint(run_dir: Path, startup_seconds: float, saved: SavedPoint | None) -> float | None:
    """What an attempt needs to get back to where it is worth something: start-up, checkpoint.every steps at the
    median logged step time, and one save (as long as the last one took). None: not known yet."""
    rows = read_records(run_dir / "metrics.jsonl")
    times = sorted(row["step_time_s"] for row in rows if "step_time_s" in row)
    if not times or not (run_dir / "config.toml").is_file():
        return None
    try:
        cfg = load_config(run_dir / "config.toml")
    except ConfigError:
        return None
    every = cfg.checkpoint.every or max(1, cfg.train.steps - (saved.step if saved else 0))
    save = (saved.save_seconds or 0.0) if saved else 0.0
    return startup_seconds + every * times[len(times) // 2] + save


def _main(argv: list[str]) -> int:
    """For slurm/train.sbatch, times in Unix seconds:
    failed RUN_DIR STARTED_AT FAILED_AT
        after a failed attempt (started then), before the restart (which trims metrics.jsonl) and before retention
        deletes its checkpoint: prints "SAVED_STEP SAVED_AT NEEDED_S" ('-' when not known; NEEDED_S: start-up,
        checkpoint.every steps and a save, as measured), then one line in words
    lost RUN_DIR ATTEMPT STATUS SAVED_STEP SAVED_AT FAILED_AT RESTARTED_AT
        after the restart has run: its time-lost line"""
    if len(argv) == 4 and argv[0] == "failed":
        run_dir, started_at, failed_at = Path(argv[1]), float(argv[2]), float(argv[3])
        rows = read_records(run_dir / "metrics.jsonl")
        before = [point for point in saved_points(run_checkpoint_dir(run_dir)) if point.saved_at < failed_at]
        saved = before[-1] if before else None
        first = first_step_started(rows, started_at)
        needed = seconds_to_next_checkpoint(run_dir, first - started_at if first is not None else 0.0, saved)
        print(f"{saved.step if saved else '-'} {saved.saved_at if saved else '-'} "
              f"{math.ceil(needed) if needed is not None else '-'}")
        if saved is None:
            print("no committed checkpoint: the restart starts from step 0")
        else:
            redone = steps_logged_between(rows, saved.saved_at, failed_at)
            print(f"the restart resumes from the checkpoint of step {saved.step} saved at {clock(saved.saved_at)}; "
                  f"{redone} logged steps done since are redone")
        return 0
    if len(argv) == 8 and argv[0] == "lost":
        run_dir, attempt, status = Path(argv[1]), int(argv[2]), int(argv[3])
        saved = SavedPoint(int(argv[4]), float(argv[5])) if argv[4] != "-" else None
        failed_at, restarted_at = float(argv[6]), float(argv[7])
        pending = PendingRestart(attempt, status, failed_at, restarted_at, saved, None)
        first = first_step_started(read_records(run_dir / "metrics.jsonl"), restarted_at)
        print(pending.line(first).replace("launch: ", "", 1))
        return 0
    print(_main.__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
