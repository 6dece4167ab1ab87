"""How gradients travel and are summed over their reduction group (`precision.grad_reduce`).

    native     float32/float64 gradients summed by MPI in their own dtype, in place: no copy, no cast
    float32    bfloat16/float16 gradients widened to fp32, summed by MPI in fp32, rounded back once
    bfloat16   gradients rounded to bf16 for the wire (half the bytes of fp32) and summed in fp32 by the rank that
               owns the block: reduce-scatter = all_to_all of bf16 blocks + a local fp32 sum in rank order (the same
               on every rank, so deterministic); all-reduce = that + an all_gather of the bf16 sums. Blocking: the
               group interface has no non-blocking all_to_all

Every reduction returns a `Handle` (comm/operations.py); its result is ready (and its completion action run) once
test() or wait() says so. reduce_scatter's result is a separate shard, in the reducer's sum dtype: the caller adds or
copies it.

Every buffer made here is in the memory of the gradients handed in (the array module of the data: numpy, or CuPy on
a GPU), so the caller can add or copy the result where its gradients live. The groups decide how device buffers
travel: NCCL groups take them as they are, host-staged MPI groups copy them through host memory and back (MPI never
sees device memory; docs/architecture.md, Backends).
"""
from __future__ import annotations

import numpy as np

from mpitrain.backend import BFLOAT16, array_module, wire_view
from mpitrain.comm.operations import Handle
from mpitrain.state.params import padded

GRAD_REDUCE = ("float32", "bfloat16")


def add_into(target, values) -> None:
    """target += values, summed in the wider dtype and rounded once (bf16 + fp32 sums in fp32)."""
    if target.dtype == values.dtype:
        target += values
    else:
        target[...] = target.astype(values.dtype) + values


class GradReducer:
    def __init__(self, group, grad_dtype, grad_reduce: str = "float32"):
        if grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"precision.grad_reduce must be one of {GRAD_REDUCE}, got {grad_reduce!r}")
        self.group = group
        if grad_reduce == "bfloat16":
            self.mode = "bfloat16"
        else:
            self.mode = "native" if np.dtype(grad_dtype).itemsize >= 4 else "float32"

    def all_reduce(self, buf) -> Handle:
        """Sum `buf` over the group, in place."""
        if self.mode == "native":
            return Handle.after(self.group.iall_reduce(buf))
        if self.mode == "float32":
            wide = buf.astype(np.float32)
            return Handle.after(self.group.iall_reduce(wide)).then(lambda: buf.__setitem__(Ellipsis, wide))
        xp, n = array_module(buf), self.group.size
        wire = xp.zeros(padded(buf.size, n), dtype=BFLOAT16)
        wire[:buf.size] = buf
        own = self._sum_own_block(wire).astype(BFLOAT16)
        gathered = xp.empty_like(wire)
        self.group.all_gather(wire_view(own), wire_view(gathered))
        buf[...] = gathered[:buf.size]
        return Handle.completed()

    def reduce_scatter(self, send) -> Handle:
        """This rank's block of the sum of `send` (group.size equal blocks) as the handle's `result`."""
        xp, shard = array_module(send), send.size // self.group.size
        if self.mode == "native":
            received = xp.empty(shard, send.dtype)
            return Handle.after(self.group.ireduce_scatter(send, received)).then(lambda: received)
        if self.mode == "float32":
            received = xp.empty(shard, np.float32)
            return Handle.after(self.group.ireduce_scatter(send.astype(np.float32), received)).then(lambda: received)
        return Handle.completed(self._sum_own_block(send.astype(BFLOAT16, copy=False)))  # only read: no copy

    def _sum_own_block(self, wire):
        """all_to_all of the bf16 blocks, then the fp32 sum of the N copies of this rank's block, in rank order."""
        n = self.group.size
        blocks = array_module(wire).empty_like(wire)
        self.group.all_to_all(wire_view(wire), wire_view(blocks))
        return blocks.reshape(n, -1).astype(np.float32).sum(axis=0)
