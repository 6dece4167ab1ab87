"""AdamW over flat buffers, with decoupled weight decay on chosen ranges and global gradient-norm clipping.

The optimizer sees one flat parameter array and the matching flat gradient array (or, under ZeRO, one rank's shard of
them: `decay_ranges` are then given in the shard's coordinates). Its moments are flat arrays of the same length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpitrain.backend import array_module as _xp


@dataclass
class AdamWHyper:
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


class AdamW:
    def __init__(self, params, decay_ranges: list[tuple[int, int]], hyper: AdamWHyper, state_dtype=None):
        xp = _xp(params)
        self.params = params
        self.decay_ranges = decay_ranges
        self.hyper = hyper
        # Moments are fp32 at least (fp64 when the compute dtype is fp64, for parity tests).
        dtype = state_dtype or params.dtype
        self.exp_avg = xp.zeros(params.shape, dtype=dtype)
        self.exp_avg_sq = xp.zeros(params.shape, dtype=dtype)
        self.steps_taken = 0

    def state_nbytes(self) -> int:
        return int(self.exp_avg.nbytes + self.exp_avg_sq.nbytes)

    def step(self, grads, lr: float) -> None:
        """One update of `self.params` in place from `grads` (already averaged and clipped)."""
        h, xp = self.hyper, _xp(self.params)
        self.steps_taken += 1
        t = self.steps_taken
        if h.weight_decay and lr:
            shrink = 1.0 - lr * h.weight_decay  # decoupled: p <- p (1 - lr wd), before the Adam update (as torch)
            for start, end in self.decay_ranges:
                self.params[start:end] *= shrink
        m, v = self.exp_avg, self.exp_avg_sq
        m *= h.beta1
        m += (1.0 - h.beta1) * grads
        v *= h.beta2
        v += (1.0 - h.beta2) * (grads * grads)
        bias1 = 1.0 - h.beta1 ** t
        bias2 = 1.0 - h.beta2 ** t
        denom = xp.sqrt(v)
        denom /= math.sqrt(bias2)
        denom += h.eps
        update = m / denom
        update *= lr / bias1
        self.params -= update


def clip_scale(grad_norm: float, max_norm: float) -> float:
    """Factor to multiply the gradients by so that their global norm is at most max_norm (0 disables)."""
    if max_norm <= 0 or grad_norm <= max_norm or not math.isfinite(grad_norm):
        return 1.0
    return max_norm / (grad_norm + 1e-6)
