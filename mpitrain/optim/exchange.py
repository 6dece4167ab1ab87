"""Per-tensor numbers combined over every rank that holds a piece of the same tensor, so that an optimizer whose math
is per tensor (Adafactor's factored statistics and update clipping, the quantization blocks' absmax) gives the
one-process run in every layout.

One process sees each tensor whole. A rank may hold a piece of it, cut three ways, each by one group of the mesh:
a ZeRO shard is a flat slice of the part (cut over the group that shards the segment: `ShardLayout.segment_groups`),
a tensor-parallel rank holds a box of a tp-split tensor (`ParamSpec.tp_axis`, over tp), and an expert-parallel rank
holds its experts of a stacked expert tensor (`reduce_over = "expert_dp"`, over ep). The pieces of one tensor are
disjoint, so a statistic that is a sum (or max) over the tensor's elements is the sum (max) over the holders of each
one's partial value: one all-reduce per group, in the order shard group, tp, ep, over a vector that holds every
tensor's slots. Every rank of such a group walks the same geometry (the same units and tensors in the same order),
so the vectors line up slot for slot; tensors cut by no group (a chain of no groups) are combined locally only
(several segments of one rank may still hold pieces of one tensor: tests cut tensors so in one process).

A `Piece` is where one tensor lies in one optimizer segment: its elements [start, end) in segment coordinates, the
flat index in this rank's box of the first of them (`first`), the box (this rank's tp / ep piece: its shape and its
corner in the whole tensor) and the tensor's whole shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpitrain.state.strategy import ShardLayout


@dataclass(frozen=True)
class Piece:
    start: int  # [start, end) in segment coordinates
    end: int
    first: int  # the box's flat index of the element at `start`
    box: tuple[int, ...]  # this rank's piece of the tensor (the tensor itself when nothing cuts it)
    corner: tuple[int, ...]  # where the box starts in the tensor
    shape: tuple[int, ...]  # the whole tensor's shape, as one process holds it
    tensor: tuple[int, str]  # (unit of the geometry, tensor name): names it in an exchange

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def count(self) -> int:
        """Elements of the whole tensor (a vocabulary shard's padding beyond its end excluded)."""
        return math.prod(self.shape)


def walk(layout: ShardLayout):
    """(unit, spec, flat offset of the tensor in the geometry) of every tensor of the geometry, in order."""
    geometry = layout.geometry
    for unit, unit_layout in enumerate(geometry.layouts):
        offset = geometry.offsets[unit]
        for spec in unit_layout.specs:
            yield unit, spec, offset
            offset += spec.size


def segment_pieces(layout: ShardLayout) -> list[list[Piece]]:
    """Per optimizer segment (`layout.segment_windows`), the pieces of tensors it holds, in flat order."""
    out = []
    for g0, g1 in layout.segment_windows:
        found = []
        for unit, spec, offset in walk(layout):
            lo, hi = max(g0, offset), min(g1, offset + spec.size)
            if lo < hi:
                found.append(Piece(lo - g0, hi - g0, lo - offset, tuple(spec.shape), tuple(spec.start),
                                   tuple(spec.full_shape), (unit, spec.name)))
        out.append(found)
    return out


def holder_groups(layout: ShardLayout, unit: int, spec, tp=None, ep=None) -> list:
    """The groups whose ranks hold the other pieces of `spec`'s tensor, in exchange order (size-1 groups left out)."""
    shard = layout.segment_groups[unit] if layout.segment_groups else None
    split_tp, split_ep = spec.tp_axis is not None, spec.reduce_over == "expert_dp"
    if (split_tp and tp is None) or (split_ep and ep is None):  # its statistics would silently be the piece's
        raise ValueError(f"{spec.name} is a piece of a tensor split over {'tp' if split_tp else 'ep'}: the "
                         "optimizer needs that group (make_optimizer's tp and ep)")
    groups = [shard, tp if split_tp else None, ep if split_ep else None]
    return [g for g in groups if g is not None and g.size > 1]


class TensorExchange:
    """Slots per tensor (`slots(shape) -> count`, from the whole tensor's shape), laid out per chain of holder
    groups; `buffers` gives zeroed vectors, `view` a tensor's slots in them, `reduce` combines them over the chains."""

    def __init__(self, layout: ShardLayout, slots, tp=None, ep=None):
        self.chains: dict[tuple, list] = {}  # chain key -> [groups, vector length]
        self.where: dict[tuple[int, str], tuple[tuple, int, int]] = {}  # tensor -> (chain key, offset, slots)
        for unit, spec, _ in walk(layout):
            count = slots(tuple(spec.full_shape))
            if not count:
                continue
            groups = holder_groups(layout, unit, spec, tp, ep)
            entry = self.chains.setdefault(tuple(id(g) for g in groups), [groups, 0])
            self.where[(unit, spec.name)] = (tuple(id(g) for g in groups), entry[1], count)
            entry[1] += count

    def buffers(self, xp, dtype) -> dict:
        return {key: xp.zeros(length, dtype=dtype) for key, (_, length) in self.chains.items()}

    def view(self, buffers: dict, tensor: tuple[int, str]):
        key, offset, count = self.where[tensor]
        return buffers[key][offset:offset + count]

    def reduce(self, buffers: dict, op: str = "sum") -> None:
        """Every chain's vector combined over its groups in turn (the same order on every rank)."""
        for key, (groups, _) in self.chains.items():
            for group in groups:
                group.all_reduce(buffers[key], op)


def factored(shape: tuple[int, ...]) -> bool:
    """Adafactor factors the tensors that are matrices in one process."""
    return len(shape) == 2


def stretches(piece: Piece) -> list[tuple[int, int, int]]:
    """(start, end, tensor flat index of start) of the runs of `piece` that are contiguous in the whole tensor's
    flat order: the piece itself when its box spans every axis after the first it cuts (a ZeRO slice, experts,
    a tp split along axis 0), else one per box row along the last cut axis (a tp column block: one per row).
    Elements of a vocabulary shard past the tensor's end are in none."""
    box, corner, shape = piece.box, piece.corner, piece.shape
    if box == shape:
        return [(piece.start, piece.end, piece.first)]
    last = max(axis for axis in range(len(box)) if box[axis] != shape[axis])  # the last axis the box cuts
    inner = math.prod(box[last:])  # box elements of one stretch
    valid = min(box[last], shape[last] - corner[last]) * math.prod(box[last + 1:])
    out = []
    for row in range(piece.first // inner, (piece.first + piece.size - 1) // inner + 1):
        outer = np.unravel_index(row, box[:last]) if last else ()
        index = tuple(corner[a] + int(outer[a]) for a in range(last)) + tuple(corner[last:])
        if any(i >= n for i, n in zip(index, shape)):
            continue  # a padding row of a vocabulary shard
        lo, hi = max(piece.first, row * inner), min(piece.first + piece.size, row * inner + valid)
        if lo < hi:
            origin = int(np.ravel_multi_index(index, shape)) - row * inner
            out.append((piece.start + lo - piece.first, piece.start + hi - piece.first, origin + lo))
    return out
