"""AdamW over flat segments, with decoupled weight decay on chosen ranges, and global gradient-norm clipping.

The optimizer never sees tensors: it updates `Segment`s (state/strategy.py), each a 1-D parameter view with its
gradient view and the ranges inside it that get weight decay. Plain data parallelism hands it one segment (the whole
flat buffer); ZeRO hands it one per unit (this rank's shard of each unit). Its moments are one flat array over all
segments.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpitrain import tiles
from mpitrain.backend import array_module
from mpitrain.kernels import fused
from mpitrain.state.offload import OnDevice
from mpitrain.state.strategy import Segment


@dataclass
class AdamWHyper:
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


class AdamW:
    def __init__(self, segments: list[Segment], hyper: AdamWHyper, state_dtype=None, placement=None):
        """placement: where the moments live and how a step reaches them (mpitrain/state/offload.py; None: the
        device, whole segments)."""
        xp = array_module(segments[0].params)
        self.segments, self.hyper = segments, hyper
        self.placement = placement or OnDevice(xp)
        self.bounds = []
        total = 0
        for segment in segments:
            self.bounds.append((total, total + segment.params.size))
            total += segment.params.size
        # Moments in the master weights' dtype: float32 (float64 in parity runs), never lower.
        dtype = state_dtype or segments[0].params.dtype
        self.exp_avg = self.placement.zeros("exp_avg", total, dtype)
        self.exp_avg_sq = self.placement.zeros("exp_avg_sq", total, dtype)
        self.steps_taken = 0

    def state_arrays(self) -> list:
        return [self.exp_avg, self.exp_avg_sq]

    def checkpoint_arrays(self) -> dict:
        """Element-wise state for the checkpoint (optim/common.py); offloaded moments are read and written in place
        through their memory maps."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def after_restore(self) -> None:
        pass  # the loaded moments are the whole state

    def state_nbytes(self) -> int:
        return self.placement.resident_nbytes(self.exp_avg) + self.placement.resident_nbytes(self.exp_avg_sq)

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One update of every segment's parameters in place from its gradients (already averaged) times grad_scale
        (the clipping factor, divided by the loss scale under fp16). The gradients themselves are left unchanged."""
        self.steps_taken += 1
        for segment, m, v in self.placement.stream(self.segments, self.bounds, [self.exp_avg, self.exp_avg_sq]):
            self._update(segment, m, v, lr, grad_scale)  # elementwise: a chunk's update is the segment's

    def _update(self, segment: Segment, m, v, lr: float, grad_scale: float) -> None:
        h, xp, t = self.hyper, array_module(segment.params), self.steps_taken
        p, g = segment.params, segment.grads
        if h.weight_decay and lr:
            shrink = 1.0 - lr * h.weight_decay  # decoupled: p <- p (1 - lr wd), before the Adam update (as torch)
            for start, end in segment.decay_ranges:
                p[start:end] *= shrink
        if xp is not np and p.dtype == m.dtype:  # CuPy: the moments and the step in one fused kernel
            fused.adamw_update(p, g, m, v, lr=lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, step=t,
                               grad_scale=grad_scale)
            return
        step_size, bias_root = lr / (1.0 - h.beta1 ** t), math.sqrt(1.0 - h.beta2 ** t)

        def update(_, start, stop):  # one cache-sized chunk: its temporaries never leave the cache
            gs, ms, vs = g[start:stop], m[start:stop], v[start:stop]
            # low-precision gradients, fp32 master and moments: the update is computed in fp32
            gs = gs.astype(m.dtype) if gs.dtype != m.dtype else gs
            if grad_scale != 1.0:
                gs = gs * grad_scale
            ms *= h.beta1
            scratch = (1.0 - h.beta1) * gs
            ms += scratch
            vs *= h.beta2
            xp.multiply(gs, gs, out=scratch)
            scratch *= 1.0 - h.beta2
            vs += scratch
            xp.sqrt(vs, out=scratch)
            scratch /= bias_root
            scratch += h.eps
            xp.divide(ms, scratch, out=scratch)
            scratch *= step_size
            p[start:stop] -= scratch

        if xp is np:
            tiles.for_each_tile(p.size, tiles.tile_rows(m.itemsize), update)
        else:
            update(0, 0, p.size)


def clip_scale(grad_norm: float, max_norm: float) -> float:
    """Factor to multiply the gradients by so that their global norm is at most max_norm (0 disables)."""
    if max_norm <= 0 or grad_norm <= max_norm or not math.isfinite(grad_norm):
        return 1.0
    return max_norm / (grad_norm + 1e-6)
