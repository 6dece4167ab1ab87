"""Quantization blocks that do not depend on the parallel layout (8-bit Adam's moments, Adafactor's 4-bit one).

Block k of a tensor is elements [k B, (k + 1) B) of the whole tensor's flat index, wherever they live, so one
process and every layout quantize the same blocks with the same scales. An optimizer segment (this rank's shard of a
unit, or its whole buffer) holds runs: stretches of tensors that are contiguous in the whole tensor's flat order,
each with the tensor index of its first element (optim/exchange.py's `stretches`: a ZeRO slice or a rank's experts
is one run, a tensor-parallel column block one run per row). A run covers its blocks wholly except perhaps its first
and last; those are shared with other runs (of this rank or of the ranks holding the tensor's other pieces): each
holder takes the absmax of its part, and one all-reduce (max) per chain of holder groups gives every holder the
block's absmax (`BlockExchange`). Padding (ZeRO's, at a part's end; a vocabulary shard's past the tensor's end) lies
in no run and is never touched.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from mpitrain.optim.exchange import TensorExchange, segment_pieces, stretches
from mpitrain.state.strategy import ShardLayout


@dataclass(frozen=True)
class Run:
    """A stretch of one tensor inside a segment, contiguous in the tensor's flat order."""
    start: int  # [start, end) in segment coordinates
    end: int
    first: int  # the tensor's flat index of the run's first element
    total: int  # elements of the whole tensor
    key: int = 0  # names the tensor in every layout (seeds quant4's stochastic rounding)
    tensor: tuple = ()  # (unit, name): the tensor's slots in a BlockExchange

    @property
    def size(self) -> int:
        return self.end - self.start

    def block_range(self, block: int) -> range:
        """The indices in the tensor of the blocks this run overlaps."""
        return range(self.first // block, (self.first + self.size - 1) // block + 1)

    def partial_blocks(self, block: int) -> list[int]:
        """Positions (0-based in block_range) of the blocks the run covers only in part: its first, its last."""
        count, out = len(self.block_range(block)), []
        if self.first % block:
            out.append(0)
        end = self.first + self.size
        if end % block and end != self.total and count - 1 not in out:
            out.append(count - 1)
        return out

    def block_elements(self, position: int, block: int) -> tuple[int, int]:
        """[a, b) in run coordinates of the run's elements in its block at `position`."""
        k = self.first // block + position
        return max(0, k * block - self.first), min(self.size, (k + 1) * block - self.first)


def segment_runs(layout: ShardLayout) -> list[list[Run]]:
    """Per optimizer segment, the runs of tensors it holds."""
    out = []
    for pieces in segment_pieces(layout):
        runs = []
        for piece in pieces:
            unit_name = layout.geometry.layouts[piece.tensor[0]].name
            key = zlib.crc32(f"{unit_name}.{piece.tensor[1]}".encode())
            runs += [Run(a, b, first, piece.count, key, piece.tensor) for a, b, first in stretches(piece)]
        out.append(runs)
    return out


class BlockExchange:
    """The absmax of every block that a run covers in part, over all of the block's holders: the blocks' slots of
    each tensor (one per block of the whole tensor), max-reduced over the tensor's holder groups."""

    def __init__(self, layout: ShardLayout, block: int, tp=None, ep=None):
        self.block = block
        self.exchange = TensorExchange(layout, lambda shape: -(-math.prod(shape) // block), tp, ep)

    def share(self, xp, dtype, entries) -> None:
        """entries: (run, position in its block_range, 1-element array of the local absmax); each array is set to
        the block's absmax over every holder. Every rank of the groups calls it the same number of times."""
        buffers = self.exchange.buffers(xp, dtype)
        for run, position, value in entries:
            slot = self.exchange.view(buffers, run.tensor)[run.first // self.block + position:][:1]
            xp.maximum(slot, value, out=slot)
        self.exchange.reduce(buffers, "max")
        for run, position, value in entries:
            value[...] = self.exchange.view(buffers, run.tensor)[run.first // self.block + position:][:1]


def block_count(runs: list[Run], block: int) -> int:
    return sum(len(run.block_range(block)) for run in runs)


def blocks_spanned(n: int, lead: int, block: int) -> int:
    """Blocks that n elements overlap, the first of them `lead` elements into its block."""
    return (lead + n - 1) // block + 1 if n else 0


def padded_blocks(values, xp, lead: int, block: int):
    """A 1-D array as (blocks, block) rows, placed `lead` elements into zero padding (a run's elements sit where they
    sit in their tensor's blocks)."""
    n = values.size
    padded = xp.zeros(blocks_spanned(n, lead, block) * block, dtype=values.dtype)
    padded[lead:lead + n] = values
    return padded.reshape(-1, block)


def block_values(expanded, lead: int, block: int, xp):
    """Each block's value from an array that repeats it on every element (a checkpoint's element-wise scales, the
    first element `lead` into its block), or None where the elements of a block disagree (they were saved from
    other blocks: the caller requantizes)."""
    n = expanded.size
    edges = np.clip(np.arange(blocks_spanned(n, lead, block) + 1) * block - lead, 0, n)
    values = expanded[xp.asarray(edges[:-1])]
    return values if bool((xp.repeat(values, np.diff(edges).tolist()) == expanded).all()) else None
