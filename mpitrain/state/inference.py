"""The parameter state of generation: the weights in the compute dtype and nothing else.

A forward pass for serving reads only the weights: no gradients, no fp32 master copy, no optimizer moments (about 2
bytes per parameter in bf16, the memory lab's "serving"). It answers the part of the state protocol a forward pass
uses (mpitrain/model/gpt.py: acquire/release); backward would fail on the missing grad_views, as it should.
"""
from __future__ import annotations

from mpitrain.state.params import FlatBuffer


class InferenceState:
    def __init__(self, layouts, backend):
        """Parameters left at zero, for the caller to fill (generate.load_checkpoint_model reads a checkpoint)."""
        self.params = FlatBuffer.allocate(layouts, backend.xp, backend.dtype)

    def acquire(self, unit: int, phase: str) -> dict:
        return self.params.views[unit]

    def release(self, unit: int, phase: str) -> None:
        pass

    def memory(self) -> dict:
        return {"params": int(self.params.data.nbytes)}
