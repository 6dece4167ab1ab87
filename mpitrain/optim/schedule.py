"""Learning-rate schedule: linear warm-up, then cosine decay to min_lr at the last step."""
from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based). A pure function of the step, so a resumed run continues exactly."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
