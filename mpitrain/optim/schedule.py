"""Schedules over the steps, each a pure function of the step so that a resumed run continues exactly: the learning
rate (`optim.schedule`) and the global batch size (`train.batch_rampup`).

Learning rate, for optimizer step `step` (0-based) of `total_steps`, after a linear warm-up over `warmup_steps`:

    cosine     cosine from lr down to min_lr over the steps after the warm-up (the default)
    linear     a straight line from lr down to min_lr over the same steps
    constant   lr
    wsd        warm-up, stable at lr, then decay to min_lr over the last decay_fraction of the steps, shaped
               linear (1 - p), cosine, or sqrt (1 - sqrt(p), the shape the warmup-stable-decay papers found best)

cosine and linear share the decay's clock: progress (step - warmup) / (total - warmup), the same as the cosine this
code always had, so the last step sits one step short of min_lr. wsd counts its decay so that the last step is exactly
min_lr: the point of the schedule is an annealed final checkpoint. The names each key takes are config_rules'
LR_SCHEDULES and DECAY_SHAPES.
"""
from __future__ import annotations

import bisect
import math


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int, schedule: str = "cosine",
          decay_fraction: float = 0.2, decay_shape: str = "linear") -> float:
    """LR for optimizer step `step` (0-based): optim.lr, min_lr, warmup_steps, schedule, decay_fraction, decay_shape
    of the config, train.steps as `total_steps`."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if schedule == "wsd":
        return _warmup_stable_decay(step, lr, min_lr, total_steps, decay_fraction, decay_shape)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def wsd_decay_steps(total_steps: int, decay_fraction: float) -> int:
    """How many of the last steps the wsd schedule decays over: the fraction of train.steps, rounded, at least 1."""
    return max(1, round(decay_fraction * total_steps))


def _warmup_stable_decay(step: int, lr: float, min_lr: float, total_steps: int, decay_fraction: float,
                         decay_shape: str) -> float:
    """After the warm-up: lr until the last `decay` steps, which go down to min_lr, reaching it at the last step."""
    decay = wsd_decay_steps(total_steps, decay_fraction)
    first_decay_step = total_steps - decay
    if step < first_decay_step:
        return lr
    progress = min(1.0, (step - first_decay_step + 1) / decay)
    if decay_shape == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    elif decay_shape == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        remaining = 1.0 - progress
    return min_lr + (lr - min_lr) * remaining


class BatchRamp:
    """The global batch of each step under `train.batch_rampup = [start, increment, ramp_samples]`, with Megatron's
    meaning of its --rampup-batch-size: the batch grows from `start` sequences by `increment` until it is the full
    `global_batch`, in (global_batch - start) / increment increments spread evenly over the first `ramp_samples`
    samples. The batch of a step is decided by the samples consumed before it:

        size = start + increment * floor(consumed * increments / ramp_samples), and global_batch past ramp_samples

    (Megatron computes floor(consumed / (ramp_samples / increments)) in floating point; this is the exact value.)
    Steps of one size form a phase; the phases are laid out once, so the size of a step and the samples before it
    are pure functions of the step, computed in O(log phases): what the data sampler needs for an exact resume."""

    def __init__(self, start: int, increment: int, ramp_samples: int, global_batch: int):
        self.global_batch = global_batch
        increments = (global_batch - start) // increment
        self.phase_steps, self.phase_samples, self.phase_sizes = [], [], []  # each phase's first step, samples before
        step = consumed = 0
        while True:
            k = min(increments, consumed * increments // ramp_samples)
            size = start + k * increment
            self.phase_steps.append(step)
            self.phase_samples.append(consumed)
            self.phase_sizes.append(size)
            if k == increments:
                break
            next_threshold = -(-(k + 1) * ramp_samples // increments)  # the first consumed count of increment k + 1
            steps = -(-(next_threshold - consumed) // size)
            step, consumed = step + steps, consumed + steps * size

    def _phase(self, step: int) -> int:
        return bisect.bisect_right(self.phase_steps, step) - 1

    def batch_size(self, step: int) -> int:
        """Sequences in the global batch of `step` (0-based)."""
        return self.phase_sizes[self._phase(step)]

    def samples_before(self, step: int) -> int:
        """Sequences consumed by the steps before `step`: the first sample index of its batch."""
        phase = self._phase(step)
        return self.phase_samples[phase] + (step - self.phase_steps[phase]) * self.phase_sizes[phase]

    def sizes(self) -> list[int]:
        """Every batch size the ramp runs through, in order."""
        return list(self.phase_sizes)

    def describe(self) -> str:
        """One line for the run's banner: the sizes and the step from which the batch is whole."""
        sizes = " -> ".join(map(str, self.phase_sizes))
        return (f"batch ramp (train.batch_rampup): global batch {sizes} sequences, the full {self.global_batch} "
                f"from step {self.phase_steps[-1] + 1}")


def make_batch_ramp(batch_rampup: list, global_batch: int) -> BatchRamp | None:
    """train.batch_rampup (checked by the config) as a BatchRamp; None when it is empty (the batch never changes)."""
    if not batch_rampup:
        return None
    start, increment, ramp_samples = batch_rampup
    return BatchRamp(start, increment, ramp_samples, global_batch)
