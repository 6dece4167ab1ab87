"""Norms as sublayers: LayerNorm with bias (gpt2) or RMSNorm (llama), over the last axis, replicated over tp.

Under sequence parallelism a rank normalises only its chunk of the sequence, so its weight gradients are partial
sums: `partial_grads` names them for the unit to all-reduce (once per unit, with the others it has).
"""
from __future__ import annotations

from mpitrain.layers import ops
from mpitrain.layers.tensor_parallel import TensorParallel
from mpitrain.state.params import ParamSpec


class Norm:
    def __init__(self, kind: str, prefix: str, width: int, eps: float, tp: TensorParallel):
        """kind: "layernorm" | "rmsnorm"; tensors f"{prefix}_w" (and f"{prefix}_b" for layernorm)."""
        self.kind, self.width, self.eps, self.tp = kind, width, eps, tp
        self.weight, self.bias = f"{prefix}_w", f"{prefix}_b" if kind == "layernorm" else None
        self.specs = [ParamSpec(self.weight, (width,), "ones")]
        if self.bias:
            self.specs.append(ParamSpec(self.bias, (width,), "zeros"))
        self.partial_grads = [s.name for s in self.specs] if tp.sequence_parallel and tp.size > 1 else []

    def forward(self, params, x, ctx=None):
        if self.bias:
            return ops.layernorm_forward(x, params[self.weight], params[self.bias], self.eps)
        return ops.rmsnorm_forward(x, params[self.weight], self.eps)

    def backward(self, params, grads, saved, dy, residual=None):
        """dx, plus `residual` where given: the gradient the block's skip connection carries past the norm."""
        if self.bias:
            return ops.layernorm_backward(saved, params[self.weight], dy, grads[self.weight], grads[self.bias],
                                          residual)
        return ops.rmsnorm_backward(saved, params[self.weight], dy, grads[self.weight], residual)

    def saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        """The normalised input and 1/std per position of this rank's part of the sequence."""
        seq_len = len(range(seq_len)[self.tp.sequence_chunk(seq_len)])
        return [((batch, seq_len, self.width), dtype), ((batch, seq_len, 1), dtype)]
