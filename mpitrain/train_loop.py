"""The run loop: `train` runs a Trainer's steps (mpitrain/train.py) from the start or a checkpoint, with the parts of a
run around them (mpitrain/run/: the run log, checkpointing, resilience), under the rank's watchdog and the run
directory's lock. `mpitrain train` calls it on every rank.
"""
from __future__ import annotations

import sys
from pathlib import Path

from mpitrain.checkpoint.manager import STORAGE_FAILED_EXIT_CODE
from mpitrain.checkpoint.store import CheckpointWriteFailed
from mpitrain.comm.flight import FlightRecorder, flight_signals
from mpitrain.config import Config
from mpitrain.errors import MpitrainError
from mpitrain.profile.breakdown import write_run_summary
from mpitrain.resilience.heartbeat import start_fault_watch
from mpitrain.resilience.sdc import replicated_arrays
from mpitrain.run.checkpointing import Checkpointing
from mpitrain.run.lock import RUN_DIR_IN_USE_EXIT_CODE, STALE_AFTER_S, RunDirClaim
from mpitrain.run.log import RunLog
from mpitrain.run.resilience import Resilience
from mpitrain.train import Trainer


def train(cfg: Config, world_comm, run_dir: Path, echo=print, resume: str | None = None,
          allowed_changes: list[str] = ()) -> int:
    """Run the steps from the start or from a checkpoint; returns the exit status (0, or PREEMPTED_EXIT_CODE after a
    stop request was saved). allowed_changes: the keys that alter the run's meaning a resume may change (see
    checkpoint/resume.review_changes). Rank 0 writes RUN_DIR/{config.toml, metrics.jsonl} and prints progress;
    every rank writes its checkpoint shards to checkpoint.dir (default RUN_DIR/checkpoints). Throughout, each rank's
    watchdog writes RUN_DIR/heartbeat/ and ends the job when a communication hangs ([fault] timeout_s, heartbeat).
    Before anything is written there, rank 0 takes RUN_DIR/.lock (run/lock.py): a run directory that another live
    job writes is refused, every rank returning RUN_DIR_IN_USE_EXIT_CODE. A checkpoint that cannot be written (disk
    full, quota, read-only, I/O error) ends every rank with STORAGE_FAILED_EXIT_CODE after one line on rank 0."""
    with RunDirClaim(run_dir, world_comm, max(STALE_AFTER_S, 2 * cfg.fault.timeout_s), echo, _to_stderr) as claim:
        if claim.refused:
            return RUN_DIR_IN_USE_EXIT_CODE
        try:
            return _watched_train(cfg, world_comm, run_dir, echo, resume, allowed_changes)
        except CheckpointWriteFailed as failed:  # every rank, the save cleaned up: one line, no traceback
            if world_comm.Get_rank() == 0:
                _to_stderr(f"ERROR: {failed}")
            return STORAGE_FAILED_EXIT_CODE


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _watched_train(cfg: Config, world_comm, run_dir: Path, echo, resume, allowed_changes) -> int:
    with start_fault_watch(cfg.fault, world_comm, run_dir) as watchdog:
        progress = watchdog.progress
        if cfg.fault.flight_ops:  # the last operations, for `mpitrain doctor hang` (comm/flight.py)
            progress.flight = FlightRecorder(cfg.fault.flight_ops, Path(run_dir) / "flight", world_comm.Get_rank())
        try:
            return _train(cfg, world_comm, run_dir, echo, resume, allowed_changes, progress)
        except BaseException as exc:
            # Not for a clean exit, nor for an error said in one line (a user error, a refused save): the ring tells
            # nothing of those, and a refused restart would put its own record over an earlier hang's.
            if progress.flight is not None and not (isinstance(exc, SystemExit) and exc.code in (None, 0)) \
                    and not isinstance(exc, MpitrainError):
                progress.flight.write("failure", progress)  # before abort_on_error ends the job
            raise


def _train(cfg: Config, world_comm, run_dir: Path, echo, resume, allowed_changes, progress) -> int:
    trainer = Trainer(cfg, world_comm, progress, run_dir)
    if progress.flight is not None:
        progress.flight.phase = trainer.breakdown.current_part  # what a flight record says the rank was doing
    logger, t = trainer.is_logger, cfg.train
    say = echo if logger else (lambda text: None)
    manager = trainer.checkpoint_manager(cfg.checkpoint.directory(run_dir), cfg.checkpoint.keep, say)
    checkpoints = Checkpointing(manager, cfg, trainer.breakdown, say, logger)
    start = checkpoints.start(resume, trainer.mesh.describe_layout(), allowed_changes)
    with RunLog(cfg, run_dir, start, echo if logger else None) as log:
        log.banner(trainer.banner(run_dir))
        with Resilience(cfg, trainer.mesh, trainer.faults, trainer.guard, progress, run_dir,
                        lambda: replicated_arrays(trainer.state, trainer.optimizer), say, logger) as resilience, \
                flight_signals(progress):  # after the stop request's handlers: SIGTERM writes, then asks to stop
            step = start
            while step < t.steps:
                done = step + 1
                resilience.before_step(done)
                evaluate = done == t.steps or (t.eval_every and done % t.eval_every == 0)
                logged = evaluate or done % t.log_every == 0 or step == start
                result = trainer.train_step(step, measure_bubble=logged, stop_here=resilience.stop_here)
                record = trainer.metrics(result)
                if evaluate:
                    record["val_loss"] = trainer.evaluate()
                if logged:  # small gathers of compute times and time breakdowns on the logging cadence
                    trainer.gather_breakdown(record, result, run_dir / "timeline.json")
                    resilience.check_stragglers(done, result.compute_seconds, record)
                if logged or result.skipped:
                    log.write(record)
                if result.skipped and (restored := resilience.after_bad_step(result, manager)) is not None:
                    step = restored
                    checkpoints.rolled_back(restored)
                    continue
                checkpoints.poll()
                stopping = resilience.stop_reason(done, result.stop_requested)
                resilience.check_replicas(done, saving=stopping is not None or checkpoints.due(done))
                if stopping:
                    return checkpoints.save_and_stop(done, stopping)
                checkpoints.save_on_cadence(done)
                resilience.observe_step(result.seconds, checkpoints.directory)
                step += 1
    write_run_summary(trainer.mesh.world, trainer.run_summary, run_dir / "breakdown.json", say)
    checkpoints.finish(trainer.tokenizer, run_dir)
    return 0
