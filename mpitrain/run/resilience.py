"""Resilience in a run: injected faults striking, stragglers, the checkpoint interval advice, the replica check,
bad-step rollbacks and the stop request (SIGUSR1 / SIGTERM)."""
from __future__ import annotations

import signal
from pathlib import Path

from mpitrain.config import Config
from mpitrain.resilience.advice import AdviceReporter
from mpitrain.resilience.inject import strike_hang, strike_kill
from mpitrain.resilience.sdc import ReplicaCheck
from mpitrain.resilience.stragglers import StragglerWatch, format_report


class StopRequest:
    """SIGUSR1 / SIGTERM (SLURM's warning before the time limit, or a requeue) ask to stop after this step."""

    def __init__(self):
        self.received = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Resilience:
    """A context manager (the stop request's signal handlers live inside it). Collective methods are called by
    every rank at the same steps. `faults`: the injected fault plan; `guard`: the bad-step guard; `progress`: the
    watchdog's record (told the step); `replicated`: returns the arrays the replica check compares."""

    def __init__(self, cfg: Config, mesh, faults, guard, progress, run_dir: Path, replicated, say, logger: bool):
        self.cfg, self.mesh, self.faults, self.guard, self.progress, self.say = cfg, mesh, faults, guard, progress, say
        f = cfg.fault
        self.stragglers = StragglerWatch(mesh.world, f.straggler_factor, f.straggler_steps)
        # Young/Daly, printed once
        self.advice = AdviceReporter(f.mtbf_hours if logger else 0.0, cfg.checkpoint.every, say)
        self.replicas = ReplicaCheck(f.sdc_every, cfg.parallel.zero, mesh, run_dir, say, replicated)
        self.stop = StopRequest()

    def __enter__(self) -> Resilience:
        self.stop.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.__exit__(*exc)

    def before_step(self, done: int) -> None:
        self.progress.step = done  # named by hang reports and heartbeats
        strike_kill(self.faults, self.mesh.world.rank, done)
        strike_hang(self.faults, self.mesh.world.rank, done)

    def check_stragglers(self, done: int, compute_seconds: float, record: dict) -> None:
        """Collective, on the logged steps: stragglers go into the record and on the console."""
        for report in self.stragglers.check(done, compute_seconds):
            record.setdefault("stragglers", []).append(report)
            self.say(format_report(report, self.cfg.fault.straggler_factor))

    def after_bad_step(self, result, checkpoints) -> int | None:
        """A skipped update: say why; when the guard calls for a rollback, restore the last checkpoint (collective)
        and return the step to continue from."""
        done = result.step + 1
        self.say(self.guard.describe_skip(done, result.verdict, result.loss, result.grad_norm))
        if self.guard.rollback_due:
            return self.guard.roll_back(checkpoints, done, self.say)
        return None

    def stop_here(self) -> bool:
        """Whether this rank was asked to stop; the step's verdict tells every rank (resilience/guard.py)."""
        return self.stop.received is not None

    def stop_reason(self, done: int, stop_requested: bool) -> str | None:
        """Why the run stops after step `done` (a signal on any rank: `stop_requested`, which every rank learnt with
        the step's verdict, so that all agree whichever got the signal; or train.stop_at), or None."""
        if stop_requested:
            return f"stop requested ({self.stop.received or 'signal on another rank'})"
        stop_at = self.cfg.train.stop_at
        return f"train.stop_at = {stop_at}" if done == stop_at else None

    def check_replicas(self, done: int, saving: bool) -> None:
        """Collective when due: before any save, so no checkpoint is written from a corrupted replica."""
        if self.replicas.due(done, saving):
            self.replicas.check(done)

    def observe_step(self, seconds: float, checkpoint_dir: Path) -> None:
        self.advice.observe(seconds, checkpoint_dir)
