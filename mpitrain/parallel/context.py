"""Context parallelism: the zig-zag split of a sequence over the cp ranks and the ring the K/V blocks travel.

Zig-zag (load-balanced) split. The sequence of T tokens is cut into 2c chunks of m = T/(2c); cp rank r holds chunks
r and 2c-1-r, in that order. Under causal attention a query at position i sees i+1 keys, so a rank holding an early
chunk and the mirrored late one does the same work as every other: sum over its positions of (i + 1) =
m^2 (2c-1) + m (m+1) on every rank, where the contiguous split (rank r holds chunk r of c) costs rank c-1 about
2c-1 times rank 0's (`attention_pairs_per_rank` counts both).

The ring. Every cp rank sends its K/V block (both chunks, packed in one buffer) to the next rank and receives the
previous rank's, c-1 times in forward, non-blocking, while it computes attention against the block it holds. Backward
runs the same ring for K/V again plus a travelling dK/dV accumulator: the accumulator for rank j's block starts at
rank j+1 (one hop after j) and returns to j after c-1 hops. With F = the K/V bytes of the full sequence of one
micro-batch for one block (2 B Hkv T D e on this tp rank), each rank sends per block and micro-batch:

    forward   (c-1)/c F               K/V, c-1 hops of F/c
    backward  2 (c-1)/c F             K/V again, c-1 hops, and dK/dV, c-1 hops (same size)

counted on the cp group under the kind "cp_ring" (comm/group.py). Full recomputation repeats the forward's.

Everything here is about positions and messages; the attention math is mpitrain/layers/ring_attention.py.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from mpitrain.backend import array_module, wire_view
from mpitrain.layers.ring_attention import visible_pairs
from mpitrain.state.params import UnitLayout

RING_KIND = "cp_ring"
KV_TAG, GRAD_TAG = 71, 72  # MPI tags: the K/V blocks and the dK/dV accumulators travel on separate channels


def zigzag_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2c) rank `cp_rank` holds, in the order it holds them."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Absolute positions of this rank's tokens (its two chunks, in order)."""
    m = seq_len // (2 * cp_size)
    return np.concatenate([np.arange(c * m, (c + 1) * m) for c in zigzag_chunks(cp_size, cp_rank)])


def contiguous_positions(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Positions under the plain split (rank r holds the r-th of c chunks): the unbalanced baseline."""
    m = seq_len // cp_size
    return np.arange(cp_rank * m, (cp_rank + 1) * m)


def split_sequence(array, cp_size: int, cp_rank: int):
    """This rank's tokens of a (batch, T, ...) array: its two zig-zag chunks, contiguous."""
    if cp_size == 1:
        return array
    return np.ascontiguousarray(array[:, zigzag_positions(array.shape[1], cp_size, cp_rank)])


def attention_pairs_per_rank(seq_len: int, cp_size: int, layout: str = "zigzag") -> list[int]:
    """(query, key) pairs each rank's causal attention computes: sum of (position + 1) over its queries. Attention
    FLOPs per rank are 4 D H times this (QK^T and PV, 2 FLOPs per multiply-add) in forward."""
    positions = zigzag_positions if layout == "zigzag" else contiguous_positions
    return [int((positions(seq_len, cp_size, r) + 1).sum()) for r in range(cp_size)]


def attention_flops_per_rank(seq_len: int, cp_size: int, heads: int, head_dim: int,
                             layout: str = "zigzag") -> list[int]:
    """Forward attention FLOPs of each rank with a causal mask applied exactly: 2 matmuls (QK^T, PV) of 2 FLOPs per
    multiply-add for every visible (query, key) pair and head."""
    return [4 * heads * head_dim * pairs for pairs in attention_pairs_per_rank(seq_len, cp_size, layout)]


def ring_pairs_computed(cp_size: int) -> list[int]:
    """(query chunk, key chunk) pairs each rank's ring attention runs over a step's c ring steps (m x m blocks; a
    diagonal pair is computed whole and masked): 2c+1 on every rank under zig-zag, the masked pairs skipped."""
    counts = []
    for rank in range(cp_size):
        mine = zigzag_chunks(cp_size, rank)
        counts.append(sum(len(visible_pairs(mine, zigzag_chunks(cp_size, source), 1, np.float64))
                          for source in range(cp_size)))
    return counts


def ring_bytes_per_block(kv_full_bytes: int, cp_size: int) -> dict[str, float]:
    """Bytes one rank sends on the ring for one attention block and micro-batch (module docstring)."""
    share = (cp_size - 1) / cp_size * kv_full_bytes
    return {"forward": share, "backward": 2 * share}


class ContextParallel:
    """The cp group of one rank, what the model needs of it: positions, the sequence split and the ring.

    group: a comm Group over the cp ranks (ring order = group rank order); None with `size` for a layout without
    communication (mpitrain memory counts shapes only). kind: parallel.cp_kind, "ring" (layers/ring_attention.py)
    or "ulysses" (layers/ulysses_attention.py: heads exchanged for tokens by all-to-all).
    """

    def __init__(self, group, size: int | None = None, kind: str = "ring"):
        self.group, self.kind = group, kind
        self.size, self.rank = (group.size, group.rank) if group is not None else (size, 0)
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def positions(self, local_len: int) -> np.ndarray:
        """Absolute positions of a rank's `local_len` tokens (the full sequence is size * local_len)."""
        return zigzag_positions(local_len * self.size, self.size, self.rank)

    def chunks_of(self, cp_rank: int) -> tuple[int, int]:
        return zigzag_chunks(self.size, cp_rank)

    def source(self, step: int) -> int:
        """Whose K/V block this rank holds at ring step `step` (0: its own)."""
        return (self.rank - step) % self.size

    def pass_kv(self, send):
        """Send this K/V buffer (contiguous) to the next rank and receive the previous rank's into a new buffer,
        both non-blocking: (received buffer, [handles]); wait on the handles before reading it."""
        received = array_module(send).empty_like(send)  # a device buffer for device arrays
        return received, [self.group.irecv(received, self.prev, KV_TAG),
                          self.group.isend(send, self.next, KV_TAG, kind=RING_KIND)]

    def send_grads(self, send) -> list:
        """Pass a dK/dV accumulator on to the next rank: [handle]."""
        return [self.group.isend(send, self.next, GRAD_TAG, kind=RING_KIND)]

    def receive_grads(self, like):
        """Post the receive of the previous rank's dK/dV accumulator: (buffer, [handle])."""
        received = array_module(like).empty_like(like)
        return received, [self.group.irecv(received, self.prev, GRAD_TAG)]

    def exchange(self, send):
        """Ulysses' all-to-all: block r of `send` (c blocks on the first axis) goes to cp rank r; the result's block
        s came from rank s."""
        received = array_module(send).empty_like(send)
        self.group.all_to_all(wire_view(send), wire_view(received))  # a copy: bf16 may travel as its bits
        return received


def apply_context_parallel(model, cp: ContextParallel) -> None:
    """Make `model` (a GPT) a cp rank's model: ring (or Ulysses) attention in every block, positions of its zig-zag
    chunks, and every gradient that data parallelism reduces over dp reduced over dp x cp (each cp rank saw other
    tokens of the same sequences). Call before the state is built from model.layouts."""
    if cp.size == 1:
        return
    model.context_parallel = cp
    for unit in model.units:
        for layer in unit.sublayers:
            if cp.kind == "ulysses" and hasattr(layer, "ulysses"):  # the attention core
                layer.ulysses = cp
            elif hasattr(layer, "ring"):  # the attention core, the learned-position table
                layer.ring = cp
        unit.layout = UnitLayout(unit.layout.name, [replace(spec, reduce_over="dp_cp") if spec.reduce_over == "dp"
                                                    else spec for spec in unit.layout.specs])
    model.layouts = [unit.layout for unit in model.units]
