"""Bad steps: skip an update whose loss or gradient is not trustworthy; after too many in a row, roll back.

A step is bad when its loss or global gradient norm is not finite, when its loss is a spike (more than
`fault.spike_zscore` standard deviations above the mean of the last `fault.spike_window` good losses), or when
`fault.skip_steps` names it. A bad step's update is skipped: parameters, Adam moments and Adam's step count stay as
they were; the step number still advances, so its data batch is consumed and the learning-rate schedule goes on.

Every rank must reach the same verdict, or some would update and others not (and the next collective would mix
different models). The loss is reduced over all ranks, but the gradient norm is not reduced over data-parallel
replicas under plain data parallelism (each holds the same all-reduced gradient, and a fault after the all-reduce
touches one replica only), so the verdict is reduced over the world: one 8-byte all-reduce per step, a bitwise OR of
one bit per verdict (the highest set wins) and one bit for a stop request (SIGUSR1/SIGTERM on any rank), so that a
step costs one small collective for both.

After `fault.max_bad_steps` bad steps in a row the trainer rolls back to the last committed checkpoint and skips the
data batches since then (as PaLM did): the step -> batch mapping gets an offset (`data_offset`), saved with each
checkpoint's extra state so that a later resume sees the same data.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import NamedTuple

from mpitrain.errors import MpitrainError

ROLLBACKS_TO_ONE_CHECKPOINT = 3  # then the bad steps come from the state, not from the data: stop
# verdicts, in the order of precedence (the highest of all ranks is the step's)
GOOD, TOLD_TO_SKIP, SPIKE, NONFINITE_GRAD, NONFINITE_LOSS = range(5)
OVERFLOW = 5  # a NONFINITE_GRAD under float16's dynamic loss scale: the trainer halves the scale (never reduced)
REASONS = {TOLD_TO_SKIP: "fault.skip_steps names it", SPIKE: "loss spike",
           OVERFLOW: "float16 overflow, loss scale halved", NONFINITE_GRAD: "non-finite gradient norm on some rank",
           NONFINITE_LOSS: "non-finite loss"}


STOP_BIT = 1 << 16  # beside the verdict bits (1 << verdict) in the step's one all-reduce


class StepVerdict(NamedTuple):
    verdict: int  # GOOD or why the update is skipped, the same on every rank
    stop_requested: bool  # some rank was asked to stop (SIGUSR1/SIGTERM): every rank saves and stops after the step


class TrainingDiverged(MpitrainError):
    """Too many bad steps in a row and nothing to roll back to."""


def is_spike(loss: float, history, zscore: float) -> bool:
    """Is `loss` more than `zscore` standard deviations above the mean of `history` (a full window of good losses)?
    Off when zscore is 0 or the window is not yet full (a few samples give no useful spread)."""
    if zscore <= 0 or history.maxlen is None or len(history) < history.maxlen:
        return False
    mean, spread = statistics.fmean(history), statistics.pstdev(history)
    return spread > 0 and (loss - mean) / spread > zscore


class BadStepGuard:
    """Per-run bad-step bookkeeping, identical on every rank. `world` reduces the verdict; `faults` is the rank's
    FaultPlan (nan injection)."""

    def __init__(self, fault_cfg, world, faults):
        self.cfg, self.world, self.faults = fault_cfg, world, faults
        self.skip_steps = set(fault_cfg.skip_steps)
        self.good_losses: deque = deque(maxlen=fault_cfg.spike_window)
        self.bad_in_a_row = 0
        self.skipped_steps = 0  # totals over the run (kept across rollbacks and resumes)
        self.rollbacks = 0
        self.data_offset = 0  # batch index = step + data_offset (batches skipped by rollbacks)
        self._rollback_target = (None, 0)  # (checkpoint, rollbacks to it in a row)

    def strikes(self, kind: str, done: int) -> bool:
        """Does an injected fault of `kind` (MPITRAIN_FAULT) strike this rank at step `done`? Once only: the plan
        uses a fault up when it strikes, so a rolled-back run passing step `done` again is spared."""
        return bool(self.faults) and self.faults.due(kind, done) is not None

    def inject(self, done: int, segments) -> None:
        """MPITRAIN_FAULT=nan:rank=R:step=S: this rank's gradients become NaN after backward, before the norm."""
        if self.strikes("nan", done):
            for segment in segments:
                segment.grads.fill(math.nan)

    def verdict(self, done: int, loss: float, grad_norm: float) -> int:
        """GOOD or the reason to skip step `done` (from 1); collective over the world, the same on every rank."""
        return self.step_verdict(done, loss, grad_norm).verdict

    def step_verdict(self, done: int, loss: float, grad_norm: float, stop_here: bool = False) -> StepVerdict:
        """The verdict of step `done` and whether any rank was asked to stop (`stop_here`: this rank was), learnt in
        one 8-byte all-reduce over the world (a bitwise OR: every rank's flags are seen, whatever the others')."""
        bits = self.world.all_reduce_bits((1 << self._local_verdict(done, loss, grad_norm))
                                          | (STOP_BIT if stop_here else 0))
        return StepVerdict((bits & (STOP_BIT - 1)).bit_length() - 1, bool(bits & STOP_BIT))

    def _local_verdict(self, done: int, loss: float, grad_norm: float) -> int:
        """This rank's verdict, before the others' are known (the highest of all ranks wins)."""
        local = GOOD
        if not math.isfinite(loss):
            local = NONFINITE_LOSS
        elif not math.isfinite(grad_norm):
            local = NONFINITE_GRAD
        elif is_spike(loss, self.good_losses, self.cfg.spike_zscore):
            local = SPIKE
        elif done in self.skip_steps:
            local = TOLD_TO_SKIP
        return local

    def record(self, verdict: int, loss: float) -> None:
        if verdict == GOOD:
            self.bad_in_a_row = 0
            self.good_losses.append(loss)
            return
        self.skipped_steps += 1
        if verdict not in (TOLD_TO_SKIP, OVERFLOW):  # no sign of trouble: these never trigger a rollback
            self.bad_in_a_row += 1

    def describe_skip(self, done: int, verdict: int, loss: float, grad_norm: float) -> str:
        return (f"step {done}: update skipped ({REASONS[verdict]}; loss {loss:.4f}, grad norm {grad_norm:.3f} on "
                f"rank 0); {self.bad_in_a_row} bad in a row, {self.skipped_steps} skipped in all")

    @property
    def rollback_due(self) -> bool:
        return self.bad_in_a_row >= self.cfg.max_bad_steps

    def metrics(self, skipped: bool) -> dict:
        return {"skipped": skipped, "skipped_steps": self.skipped_steps, "rollbacks": self.rollbacks}

    # -- checkpointed with the model (the manager's "extra_state" entry)
    def state(self) -> dict:
        return {"data_offset": self.data_offset, "skipped_steps": self.skipped_steps, "rollbacks": self.rollbacks}

    def load_state(self, state: dict) -> None:
        self.data_offset = int(state.get("data_offset", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.rollbacks = int(state.get("rollbacks", 0))

    def roll_back(self, checkpoints, done: int, say) -> int:
        """Restore the last committed checkpoint and skip the batches since it; returns the step to continue from
        (collective). The batches of steps after the checkpoint up to `done` are never trained on again."""
        first_bad = done - self.bad_in_a_row + 1
        checkpoints.wait()
        path = checkpoints.find_resume_point("auto")
        if path is None:
            raise TrainingDiverged(f"steps {first_bad}-{done} were bad ({self.bad_in_a_row} in a row, "
                                   f"fault.max_bad_steps = {self.cfg.max_bad_steps}) and {checkpoints.directory} "
                                   f"holds no committed checkpoint to roll back to; stopping (set checkpoint.every "
                                   f"or lower optim.lr)")
        target, times = self._rollback_target
        times = times + 1 if target == path else 1
        if times > ROLLBACKS_TO_ONE_CHECKPOINT:
            raise TrainingDiverged(f"steps {first_bad}-{done} were bad after {times - 1} rollbacks to {path} with "
                                   f"other data each time; stopping (lower optim.lr, or resume from an earlier "
                                   f"checkpoint with --resume)")
        self._rollback_target = (path, times)
        kept = self.state()
        restored = checkpoints.restore(path)
        self.load_state(kept)  # the counters and the offset go on from where this run is, not from the checkpoint's
        self.data_offset += done - restored  # step restored + 1 gets the batch after step done's
        self.rollbacks += 1
        self.bad_in_a_row = 0
        # not in the model now: the batches of skipped updates (a checkpoint saved in the streak holds none of them)
        # and those after the checkpoint
        untrained_from = min(first_bad, restored + 1)
        say(f"rollback: steps {first_bad}-{done} were bad; restored {path} (step {restored}) and skipped the data of "
            f"steps {untrained_from}-{done} (batch offset now {self.data_offset}); rollback {self.rollbacks}")
        return restored
