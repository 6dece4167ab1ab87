"""SGD with (heavy-ball) momentum, as torch.optim.SGD without dampening or Nesterov: b <- mu b + g, p <- p - lr b.

Weight decay is decoupled (p <- p (1 - lr wd)) like our AdamW, not torch's L2 term added to the gradient, so one
optim.weight_decay means the same shrinkage under every optimizer. State: one buffer, the parameters' dtype, where
the placement puts it (memory.offload: streamed in chunks as AdamW's moments; the update is elementwise).
"""
from __future__ import annotations

from mpitrain.backend import array_module
from mpitrain.optim.common import decay, scaled_grad, segment_bounds
from mpitrain.state.offload import OnDevice


class SGD:
    def __init__(self, segments, momentum: float = 0.9, weight_decay: float = 0.0, state_dtype=None, placement=None):
        xp = array_module(segments[0].params)
        self.segments, self.momentum, self.weight_decay = segments, momentum, weight_decay
        self.placement = placement or OnDevice(xp)
        self.bounds = segment_bounds(segments)
        self.dtype = state_dtype or segments[0].params.dtype
        self.buffer = self.placement.zeros("momentum", self.bounds[-1][1] if momentum else 0, self.dtype)
        self.steps_taken = 0

    def state_arrays(self) -> list:
        return [self.buffer]

    def state_nbytes(self) -> int:
        return self.placement.resident_nbytes(self.buffer)

    def checkpoint_arrays(self) -> dict:
        return {"momentum": self.buffer} if self.momentum else {}

    def after_restore(self) -> None:
        pass

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        self.steps_taken += 1
        buffers = [self.buffer] if self.momentum else []
        for segment, *held in self.placement.stream(self.segments, self.bounds, buffers):
            g = scaled_grad(segment, self.dtype, grad_scale)
            decay(segment, lr, self.weight_decay)
            if held:
                b = held[0]
                b *= self.momentum
                b += g
                g = b
            segment.params -= lr * g
