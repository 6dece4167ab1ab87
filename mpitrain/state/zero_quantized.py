"""Quantized ZeRO communication (ZeRO++): block-quantized parameter all-gathers (`parallel.zero_gather_dtype`,
ZeRO-3) and gradient reduce-scatters (`parallel.zero_grad_reduce`), with the codecs of comm/quantized.py.

Parameters (qwZ): each rank encodes its shard of a part (codes + one fp32 scale per block, packed into one byte
message), one all-gather carries every rank's message, and every rank decodes all of them into the gathered buffer.
Every rank therefore computes with the same decoded weights (its own shard included), while the master weights the
optimizer updates stay exact: the error is that of one quantization of the current weights, never accumulated.

Gradients (qgZ): the reduce-scatter runs as an all-to-all of quantized pieces and a local sum in full precision.
Why not a quantized ring reduce-scatter: a ring passes partial sums along, so each of its N-1 hops would decode, add
and re-quantize a growing sum, compounding N-1 rounding errors, each relative to the largest partial sum. The
all-to-all quantizes each rank's own contribution exactly once; the owner of a block decodes the N pieces and sums
them in fp32 (or float64) in rank order, the same on every rank, so the error is at most the sum of N single
quantization errors. Both send (N-1)/N of the message per rank.

Bytes this rank sends, k elements per shard, N ranks, e bytes per element on the wire (`comm/counters.py` counts the
same), per gather or reduce-scatter of one part:

    exact         (N-1) k e
    quantized     (N-1) (codes(k) + 4 ceil(k / block))     codes(k) = k (int8, fp8) or ceil(k / 2) (int4)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpitrain.backend import array_module
from mpitrain.comm.operations import Handle
from mpitrain.comm.quantized import block_count, decode, encode, payload_nbytes, wire_nbytes
from mpitrain.state.params import FlatBuffer, UnitLayout
from mpitrain.state.reduce import GradReducer


@dataclass(frozen=True)
class QuantizedComm:
    """What ZeRO's collectives put on the wire: "same" / "exact" leave a collective as it is."""
    gather: str = "same"
    grad_reduce: str = "exact"
    block: int = 256

    @property
    def gathers_quantized(self) -> bool:
        return self.gather != "same"


def pack(x, block: int, codec: str) -> np.ndarray:
    """One uint8 message: the codes of `x`, then its fp32 scales' bytes."""
    payload, scales = encode(x, block, codec)
    return array_module(payload).concatenate([payload, scales.view(np.uint8)])


def unpack(message, n: int, block: int, codec: str) -> np.ndarray:
    """The n float32 values of a `pack`ed message."""
    codes = payload_nbytes(codec, n)
    scales = message[codes:codes + 4 * block_count(n, block)].copy().view(np.float32)  # copy: 4-byte aligned
    return decode(message[:codes], scales, n, block, codec)


def split_messages(received, pieces: int):
    """The `pieces` equal messages of a received buffer, in rank order."""
    return received.reshape(pieces, -1)


def quantized_gather(layout: UnitLayout, shard, group, zero, codec: str, block: int) -> list:
    """[a single-part FlatBuffer, the handle of the all-gather that fills it with every rank's decoded shard] (as
    state/zero.gather returns for an exact gather)."""
    buffer = FlatBuffer.allocate([layout], zero.backend.xp, zero.backend.dtype, align=zero.align)
    message = pack(shard, block, codec)
    received = array_module(message).empty(group.size * message.size, np.uint8)  # where the shard lives
    k = shard.size

    def decode_all():
        for rank, piece in enumerate(split_messages(received, group.size)):
            buffer.data[rank * k:(rank + 1) * k] = unpack(piece, k, block, codec)

    return [buffer, Handle.after(group.iall_gather(message, received)).then(decode_all)]


class QuantizedGradReducer:
    """reduce_scatter as an all-to-all of block-quantized pieces and a local full-precision sum (see the module)."""

    def __init__(self, group, grad_dtype, codec: str, block: int):
        self.group, self.codec, self.block = group, codec, block
        self.sum_dtype = np.result_type(np.dtype(grad_dtype), np.float32)  # fp32, or float64 for float64 runs

    def reduce_scatter(self, send) -> Handle:
        """This rank's block of the sum of `send` (group.size equal blocks) as the handle's `result`. Blocking: the
        group interface has no non-blocking all_to_all."""
        n = self.group.size
        k = send.size // n
        pieces, xp = send.reshape(n, k), array_module(send)
        outgoing = xp.concatenate([pack(pieces[rank], self.block, self.codec) for rank in range(n)])
        received = xp.empty_like(outgoing)
        self.group.all_to_all(outgoing, received)
        total = xp.zeros(k, self.sum_dtype)
        for piece in split_messages(received, n):  # rank order: the same sum on every rank
            total += unpack(piece, k, self.block, self.codec)
        return Handle.completed(total)


def make_grad_reducer(group, grad_dtype, grad_reduce: str, quantized: QuantizedComm | None):
    """The reducer of ZeRO's gradient reduce-scatter over `group`: quantized, or state/reduce.py's GradReducer."""
    if quantized is None or quantized.grad_reduce == "exact":
        return GradReducer(group, grad_dtype, grad_reduce)
    return QuantizedGradReducer(group, grad_dtype, quantized.grad_reduce, quantized.block)


# ---- bytes per operation and per step, for the planner (pure functions) ----------------------------------------------
def gather_bytes(shard: int, group_size: int, element_bytes: int, gather: str = "same", block: int = 256) -> int:
    """Bytes one rank sends in one ZeRO-3 all-gather of a part with `shard` elements per rank."""
    each = shard * element_bytes if gather == "same" else wire_nbytes(gather, shard, block)
    return (group_size - 1) * each


def reduce_scatter_bytes(shard: int, group_size: int, wire_element_bytes: int, grad_reduce: str = "exact",
                         block: int = 256) -> int:
    """Bytes one rank sends in one gradient reduce-scatter of a part with `shard` elements per rank
    (wire_element_bytes: 4 for bf16/fp16 gradients summed in fp32, else the gradients' own size)."""
    each = shard * wire_element_bytes if grad_reduce == "exact" else wire_nbytes(grad_reduce, shard, block)
    return (group_size - 1) * each


def zero_step_bytes(stage: int, shards: list[int], group_size: int, element_bytes: int, wire_element_bytes: int,
                    quantized: QuantizedComm, micro_batches: int = 1, reshard_after_forward: bool = True) -> dict:
    """{counter kind: bytes} one rank sends per ZeRO training step over the group that shards `shards` (elements
    per rank of each part). Stage 3 gathers each part before its forward and, resharded, again for its backward,
    and reduce-scatters its gradient, in every micro-batch; stage 2 reduce-scatters every micro-batch, stage 1 once,
    and both all-gather the updated parameters once (in the compute dtype: quantized gathers are ZeRO-3's). The
    quantized reduce-scatter is an all-to-all, counted under that kind."""
    gather = quantized.gather if stage == 3 else "same"
    gathers = micro_batches * (2 if reshard_after_forward else 1) if stage == 3 else 1
    reduces = micro_batches if stage >= 2 else 1
    gathered = gathers * sum(gather_bytes(k, group_size, element_bytes, gather, quantized.block) for k in shards)
    reduced = reduces * sum(reduce_scatter_bytes(k, group_size, wire_element_bytes, quantized.grad_reduce,
                                                 quantized.block) for k in shards)
    kind = "reduce_scatter" if quantized.grad_reduce == "exact" else "all_to_all"
    return {"all_gather": gathered, kind: reduced}
