"""Dynamic loss scaling for float16 compute: fp16 gradients of a small loss underflow to zero, so the loss is
multiplied by a large scale before backward and the gradients divided by it (in fp32) before the update.

On overflow (a non-finite gradient norm: some fp16 gradient became inf/NaN) the step is skipped and the scale halved;
after `growth_interval` good steps in a row it is doubled again. bfloat16 has float32's exponent range and needs
none of this (scale 1, never skips).
"""
from __future__ import annotations

import math


class DynamicLossScale:
    dynamic = True

    def __init__(self, initial: float = 2.0 ** 16, growth_interval: int = 1000, factor: float = 2.0,
                 minimum: float = 1.0):
        self.scale, self.growth_interval, self.factor, self.minimum = initial, growth_interval, factor, minimum
        self.good_steps = 0
        self.skipped = 0  # steps skipped for overflow, in this run

    def update(self, grad_norm: float) -> bool:
        """After a step's backward: True to take the step, False to skip it (overflow). Adjusts the scale."""
        if not math.isfinite(grad_norm):
            self.scale = max(self.minimum, self.scale / self.factor)
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.factor
            self.good_steps = 0
        return True


class NoLossScale:
    """float32, float64, bfloat16: the loss is not scaled and no step is skipped here."""

    scale = 1.0
    skipped = 0
    dynamic = False

    def update(self, grad_norm: float) -> bool:
        return True


def make_loss_scale(compute: str, growth_interval: int = 1000):
    return DynamicLossScale(growth_interval=growth_interval) if compute == "float16" else NoLossScale()
