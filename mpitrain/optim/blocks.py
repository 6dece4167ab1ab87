"""Quantization blocks that do not depend on the parallel layout (8-bit Adam's moments, Adafactor's 4-bit one).

Block k of a tensor is elements [k B, (k + 1) B) of the whole tensor's flat index, wherever they live, so one
process and every ZeRO layout quantize the same blocks with the same scales. An optimizer segment (this rank's shard
of a unit, or its whole buffer) holds runs: the pieces of tensors inside it, each with the tensor index of its first
element. A shard boundary inside a block cuts it: each rank holding part of it takes the absmax of its part, and one
all-reduce (max) over the group that shards the part gives every holder the block's absmax (`Cut.slots`: the shard
boundaries inside the block; every holder writes its part's absmax into all of them, so the max covers every holder,
also when a block spans more than two shards). Padding (ZeRO's, at a part's end) lies in no run and is never touched.

Tensor-parallel pieces are strided in their tensor (a column block of a matrix), and expert-parallel pieces that do
not start on a block boundary share a block with another ep rank: both would quantize per rank, so they are refused.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from mpitrain.errors import ConfigError
from mpitrain.state.strategy import ShardLayout


@dataclass(frozen=True)
class Run:
    """The part of one tensor (or of this rank's piece of it) inside a segment."""
    start: int  # [start, end) in segment coordinates
    end: int
    first: int  # the tensor's flat index of the run's first element
    stop: int  # the tensor's flat index just past its piece (its size for a whole tensor)
    key: int = 0  # names the tensor in every layout (seeds quant4's stochastic rounding)

    @property
    def size(self) -> int:
        return self.end - self.start

    def block_range(self, block: int) -> range:
        """The indices in the tensor of the blocks this run overlaps."""
        return range(self.first // block, (self.first + self.size - 1) // block + 1)

    def block_span(self, k: int, block: int) -> tuple[int, int]:
        """Block k of the tensor, whole, in segment coordinates (it may reach beyond the segment)."""
        zero = self.start - self.first  # where the tensor's element 0 would sit
        return zero + k * block, zero + min((k + 1) * block, self.stop)


@dataclass(frozen=True)
class Cut:
    """A block that other ranks of the group hold part of: its segment, its index among the optimizer's blocks, its
    local elements [start, end) in segment coordinates, and its slots in the group's exchange vector."""
    segment: int
    block: int
    start: int
    end: int
    lead: int  # elements of the block before `start` (held by another rank)
    slots: tuple[int, ...]


def _refuse_pieces(spec, name: str) -> None:
    """A piece of a tensor split over tp ranks is strided in it: quantizing it per rank would depend on the layout."""
    if spec.tp_axis is not None:
        raise ConfigError(f"optim.name = {name!r} with parallel.tp > 1: tensor-parallel pieces cut its "
                          "quantization blocks, so the run would not match one process; set parallel.tp = 1 or "
                          "optim.name = adamw")


def _piece(spec, block: int, name: str) -> tuple[int, int]:
    """The tensor's flat indices [first, stop) of this rank's piece ([0, size) for a whole tensor)."""
    _refuse_pieces(spec, name)
    if spec.global_shape is None or tuple(spec.global_shape) == tuple(spec.shape):
        return 0, spec.size
    first = int(np.ravel_multi_index(spec.start, spec.full_shape))
    stop, total = first + spec.size, int(np.prod(spec.full_shape))
    contiguous = tuple(spec.shape[1:]) == tuple(spec.full_shape[1:])  # split along axis 0 only (experts)
    if not contiguous or first % block or (stop % block and stop != total):
        raise ConfigError(f"optim.name = {name!r} with parallel.ep > 1: this rank's experts of {spec.name} (tensor "
                          f"elements {first}..{stop}) do not start and end on {block}-element quantization blocks, "
                          "so the run would not match one process; choose parallel.ep so that each rank's experts "
                          "are whole blocks, or optim.name = adamw")
    return first, stop


def segment_specs(layout: ShardLayout):
    """Per optimizer segment, its window (g0, g1) and the tensors overlapping it as (unit layout, spec, offset of the
    tensor in the flat buffer); `layout` is state.checkpoint_layout() (its segment_windows follow the segments'
    order). The one walk behind segment_runs and factory.segment_tensors."""
    geometry = layout.geometry
    for g0, g1 in layout.segment_windows:
        found = []
        for unit, unit_layout in enumerate(geometry.layouts):
            offset = geometry.offsets[unit]
            for spec in unit_layout.specs:
                if max(g0, offset) < min(g1, offset + spec.size):
                    found.append((unit_layout, spec, offset))
                offset += spec.size
        yield g0, g1, found


def segment_runs(layout: ShardLayout, block: int, name: str = "adam8bit") -> list[list[Run]]:
    """Per optimizer segment, the runs of tensors it holds."""
    out = []
    for g0, g1, found in segment_specs(layout):
        runs = []
        for unit_layout, spec, offset in found:
            lo, hi = max(g0, offset), min(g1, offset + spec.size)
            first, stop = _piece(spec, block, name)
            key = zlib.crc32(f"{unit_layout.name}.{spec.name}".encode())
            runs.append(Run(lo - g0, hi - g0, first + lo - offset, stop, key))
        out.append(runs)
    return out


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


def segment_cuts(layout: ShardLayout, runs: list[list[Run]], block: int) -> list[tuple[object, int, list[Cut]]]:
    """(group, exchange vector length, cuts) per group that shards segments (the layout's `segment_groups`: ZeRO's;
    none without it). Slots: one per shard boundary of each segment's part (N - 1 of them), segments in order."""
    if not layout.segment_groups:
        return []
    geometry, exchanges, blocks = layout.geometry, {}, 0
    for segment, ((g0, g1), group, held) in enumerate(zip(layout.segment_windows, layout.segment_groups, runs)):
        if group is not None and group.size > 1 and g1 > g0:
            entry = exchanges.setdefault(id(group), [group, 0, []])
            offset = g0 - _part_start(geometry, g0)  # the segment's start in its part
            shard, base = g1 - g0, entry[1]
            entry[1] += group.size - 1
            index = blocks
            for run in held:
                for k in run.block_range(block):
                    lo, hi = run.block_span(k, block)
                    slots = tuple(base + r - 1 for r in range(1, group.size) if lo + offset < r * shard < hi + offset)
                    if slots:
                        start = max(lo, run.start)
                        entry[2].append(Cut(segment, index, start, min(hi, run.end), start - lo, slots))
                    index += 1
        blocks += block_count(held, block)
    return [tuple(entry) for entry in exchanges.values()]


def _part_start(geometry, position: int) -> int:
    """The start of the unit (ZeRO: part) range of the geometry that holds `position`."""
    return geometry.offsets[int(np.searchsorted(geometry.offsets, position, side="right")) - 1]
