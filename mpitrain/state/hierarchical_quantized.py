"""ZeRO++'s quantized gradient reduction in two levels (qgZ's hierarchical all-to-all), for the hierarchical groups
of state/hierarchical.py: only quantized bytes cross the links between nodes.

    parallel.dp_reduce = "two_level"   a quantized all-to-all inside the node, each rank summing the k decoded
                                       pieces of its node's share in full precision, then a quantized all-to-all
                                       across nodes of that partial sum, summed the same way: rank r ends with
                                       block r of the sum, as in the flat mode (the blocks reordered node-major first,
                                       as TwoLevelGroup does)
    parallel.zero_shard = "node"       the same inside the node (ZeRO shards over its k ranks); across nodes the shard
                                       is all-reduced as a quantized all-to-all of n pieces, summed in full precision,
                                       then a quantized all-gather of the sums. Every copy, its owner's included,
                                       takes the decoded sums, so the n copies of a shard stay identical

Why the node first: the inside level divides what each rank holds by k before anything crosses, so each rank sends
(n-1) pieces of Psi/(n k) across nodes; the other order would send (n-1) pieces of Psi/n, k times the bytes, over the
slow links. Each level quantizes the full-precision partial sum once: a reduced element is off by at most the
codec's bound times the sum of its k pieces' block absmaxes (inside) plus that of its n partial sums' (across), and
under zero_shard = node plus one more quantization of the sum (the all-gather).

The parameter gathers need nothing here: state/zero_quantized.quantized_gather's one message per rank travels through
the hierarchical group's all-gather like any buffer (across then inside under two_level, inside only under node).

Bytes one rank sends across nodes per step are ZeRO's over n ranks, on each part's shard (`cross_node_step_bytes`):
two_level is a flat ZeRO of the shards over the n ranks at the same place on each node; under zero_shard = node
each reduction sends 2 (n-1) quantized pieces of ceil(k'/n) elements (k' = the node shard), the gathers nothing.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np

from mpitrain.backend import array_module
from mpitrain.comm.operations import Handle
from mpitrain.comm.quantized import wire_nbytes
from mpitrain.comm.two_level import NodeShardGroup, TwoLevelGroup
from mpitrain.state import zero_quantized
from mpitrain.state.zero_quantized import QuantizedComm, QuantizedGradReducer, pack, split_messages, unpack


class TwoLevelQuantizedReducer:
    """reduce_scatter over a TwoLevelGroup: quantized all-to-all inside, then across (see the module)."""

    def __init__(self, group: TwoLevelGroup, grad_dtype, codec: str, block: int):
        self.group = group
        self.inside = QuantizedGradReducer(group.inside, grad_dtype, codec, block)
        self.across = QuantizedGradReducer(group.across, grad_dtype, codec, block)

    def reduce_scatter(self, send) -> Handle:
        """This rank's block of the sum of `send` (group.size equal blocks) as the handle's `result`. Run through the
        group's Sequencer, after what is queued there, so every rank issues the levels in the same order."""
        g, sums = self.group, {}
        node_major = send.reshape(g.size, -1)[g.order].reshape(-1)  # a copy: the blocks in the order levels hand out

        def inside():
            sums["node"] = self.inside.reduce_scatter(node_major).wait()

        def across():
            sums["all"] = self.across.reduce_scatter(sums["node"]).wait()
        g.sequencer.submit([inside, across]).wait()
        return Handle.completed(sums["all"])


class NodeShardQuantizedReducer:
    """reduce_scatter over a NodeShardGroup: quantized all-to-all inside, then a quantized all-reduce across (see the
    module), the result the same on every copy of the shard."""

    def __init__(self, group: NodeShardGroup, grad_dtype, codec: str, block: int):
        self.group, self.codec, self.block = group, codec, block
        self.inside = QuantizedGradReducer(group.inside, grad_dtype, codec, block)
        self.across = QuantizedGradReducer(group.across, grad_dtype, codec, block)

    def reduce_scatter(self, send) -> Handle:
        g, sums = self.group, {}

        def inside():
            sums["node"] = self.inside.reduce_scatter(send).wait()

        def across():
            sums["all"] = self._all_reduce_across(sums["node"])
        g.sequencer.submit([inside, across]).wait()
        return Handle.completed(sums["all"])

    def _all_reduce_across(self, partial):
        """The sum over nodes of `partial`: a quantized reduce-scatter of n pieces, then a quantized all-gather."""
        across, xp = self.group.across, array_module(partial)
        n, size = across.size, partial.size
        piece = -(-size // n)
        padded = xp.zeros(n * piece, partial.dtype)
        padded[:size] = partial
        mine = self.across.reduce_scatter(padded).wait()
        message = pack(mine, self.block, self.codec)
        received = xp.empty(n * message.size, np.uint8)
        across.all_gather(message, received)
        total = xp.concatenate([unpack(m, piece, self.block, self.codec) for m in split_messages(received, n)])
        return total[:size].astype(self.inside.sum_dtype)


def make_grad_reducer(group, grad_dtype, grad_reduce: str, quantized: QuantizedComm | None):
    """ZeRO's gradient reducer over `group`: the two-level quantized one for a hierarchical group with a quantized
    zero_grad_reduce, else state/zero_quantized.make_grad_reducer's."""
    codec = "exact" if quantized is None else quantized.grad_reduce
    if codec != "exact" and isinstance(group, TwoLevelGroup):
        return TwoLevelQuantizedReducer(group, grad_dtype, codec, quantized.block)
    if codec != "exact" and isinstance(group, NodeShardGroup):
        return NodeShardQuantizedReducer(group, grad_dtype, codec, quantized.block)
    return zero_quantized.make_grad_reducer(group, grad_dtype, grad_reduce, quantized)


# ---- bytes across nodes per step, for the planner (pure functions) ---------------------------------------------------
def cross_node_step_bytes(zero: int, zero_shard: str, shards: list[int], nodes: int, element_bytes: int,
                          wire_element_bytes: int, quantized: QuantizedComm, micro_batches: int = 1,
                          reshard_after_forward: bool = True) -> dict:
    """{counter kind: bytes} one rank sends across nodes per step with hierarchical ZeRO (zero >= 1), `shards` the
    elements per rank of each part (of the flat group under two_level, of the node's group under node). Exact
    modes give state/hierarchical.cross_node_bytes' total."""
    if zero_shard != "node":  # two_level: the across level is ZeRO over the n ranks at this rank's place
        return zero_quantized.zero_step_bytes(zero, shards, nodes, element_bytes, wire_element_bytes, quantized,
                                              micro_batches, reshard_after_forward)
    reductions = micro_batches if zero >= 2 else 1
    if quantized.grad_reduce == "exact":  # an all-reduce (ring) of the shard
        each = sum(Fraction(2 * (nodes - 1) * k * wire_element_bytes, nodes) for k in shards)
        return {"all_reduce": reductions * each}
    pieces = [-(-k // nodes) for k in shards]
    each = sum((nodes - 1) * wire_nbytes(quantized.grad_reduce, p, quantized.block) for p in pieces)
    return {"all_to_all": reductions * each, "all_gather": reductions * each}
