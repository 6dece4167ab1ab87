"""What every optimizer over flat segments shares: the bounds of its state per segment, the gradient as the update
sees it (widened, times the clip / loss-scale factor) and decoupled weight decay.

An optimizer offers `step(lr, grad_scale)`, `steps_taken`, `state_nbytes()`, `state_arrays()` (what it keeps between
steps), `checkpoint_arrays()` (element-wise kinds -> flat arrays over its segments, in `bounds` coordinates, which the
checkpoint cuts into pieces in global coordinates) and `after_restore()` (fold those arrays back into its state).
"""
from __future__ import annotations


def segment_bounds(segments) -> list[tuple[int, int]]:
    bounds, total = [], 0
    for segment in segments:
        bounds.append((total, total + segment.params.size))
        total += segment.params.size
    return bounds


def scaled_grad(segment, dtype, grad_scale: float):
    """The gradient in the state's dtype (low-precision gradients are widened), times grad_scale (a new array or a
    view: callers never write into it)."""
    g = segment.grads
    if g.dtype != dtype:
        g = g.astype(dtype)
    return g * grad_scale if grad_scale != 1.0 else g


def decay(segment, lr: float, weight_decay: float) -> None:
    """Decoupled weight decay p <- p (1 - lr wd) on the segment's decayed ranges, before the update (as torch)."""
    if weight_decay and lr:
        shrink = 1.0 - lr * weight_decay
        for start, end in segment.decay_ranges:
            segment.params[start:end] *= shrink
