"""Which pieces of which tensors a rank holds, and how to rebuild any piece from pieces saved under another layout.

A piece is described in global terms only, so it means the same under every layout:

    kind          "param" | "exp_avg" | "exp_avg_sq"
    tensor        the tensor's global name, e.g. "blocks.3.wq"
    global_shape  the whole tensor's shape
    box_offset, box_shape   the block of the tensor a tensor-parallel rank holds (the whole tensor without tp)
    flat          [start, end) of that block's row-major flattening (ZeRO shards cut flat buffers, not blocks)

Loading computes, for each piece the new layout needs, its overlap with every saved piece of the same tensor, so
dp, ZeRO stage, tp and pp may all change between save and load.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

KINDS = ("param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Piece:
    kind: str
    tensor: str
    global_shape: tuple
    box_offset: tuple
    box_shape: tuple
    flat: tuple  # (start, end) within the box

    @property
    def size(self) -> int:
        return self.flat[1] - self.flat[0]

    @property
    def whole_box(self) -> bool:
        return self.flat == (0, int(np.prod(self.box_shape)))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "tensor": self.tensor, "global_shape": list(self.global_shape),
                "box_offset": list(self.box_offset), "box_shape": list(self.box_shape), "flat": list(self.flat)}

    @classmethod
    def from_dict(cls, d: dict) -> Piece:
        return cls(d["kind"], d["tensor"], tuple(d["global_shape"]), tuple(d["box_offset"]), tuple(d["box_shape"]),
                   tuple(d["flat"]))


@dataclass
class HeldPiece:
    """A piece this rank holds: where it lives in a local 1-D array, and whether this rank writes it."""
    piece: Piece
    array: object  # 1-D host or device array
    start: int  # the piece is array[start:start + piece.size]
    writer: bool  # of identical copies across ranks, exactly one writes

    def view(self):
        return self.array[self.start:self.start + self.piece.size]


def _replica_writer(kind: str, tensor: str, replicas: int, replica_index: int) -> bool:
    """Spread the writing of replicated tensors over their replicas by a stable hash of the name."""
    return zlib.crc32(f"{kind}:{tensor}".encode()) % replicas == replica_index


def held_pieces(kind: str, geometry, windows, dp_replicated: bool, dp: tuple[int, int], tp: tuple[int, int],
                load_only=(), expert_dp: tuple[int, int] | None = None) -> list[HeldPiece]:
    """Pieces in `windows` ((geometry start, end, array, array offset) ranges of the flat geometry).

    dp, tp: (size, rank) of this rank's data- and tensor-parallel groups, for deciding who writes replicated copies.
    load_only: tensor names this rank holds as a copy of another rank's (gpt2's tied embedding on the last pipeline
    stage): filled on restore from the tensor of that name, never written (the owner writes it).
    expert_dp: (size, rank) of the expert-data-parallel group, the replicas of experts under ep > 1."""
    held = []
    for unit, layout in enumerate(geometry.layouts):
        offset = geometry.offsets[unit]
        for spec in layout.specs:
            name = spec.tied_to or f"{layout.name}.{spec.name}"  # a tied copy is read back from its original
            for g0, g1, array, a0 in windows:
                lo, hi = max(offset, g0), min(offset + spec.size, g1)
                if lo >= hi:
                    continue
                replicas, index = 1, 0
                if dp_replicated:
                    replicas, index = expert_dp if expert_dp and spec.reduce_over == "expert_dp" else dp
                if spec.tp_replicated and spec.reduce_over != "expert_dp":  # expert_dp holds every copy of a piece
                    replicas, index = replicas * tp[0], index * tp[0] + tp[1]
                piece = Piece(kind, name, tuple(spec.full_shape), tuple(spec.start), tuple(spec.shape),
                              (lo - offset, hi - offset))
                writer = not spec.tied_to and name not in load_only and _replica_writer(kind, name, replicas, index)
                held.append(HeldPiece(piece, array, a0 + lo - g0, writer))
            offset += spec.size
    return held


def fill_box(target_offset, target_shape, saved: Piece, values: np.ndarray, out: np.ndarray,
             covered: np.ndarray) -> None:
    """Copy the part of a saved piece (its flat values) that falls inside the target box into `out`."""
    t_lo = np.asarray(target_offset)
    t_hi = t_lo + np.asarray(target_shape)
    s_lo = np.asarray(saved.box_offset)
    s_hi = s_lo + np.asarray(saved.box_shape)
    lo, hi = np.maximum(t_lo, s_lo), np.minimum(t_hi, s_hi)
    if np.any(lo >= hi):
        return
    if saved.whole_box:  # fast path: a block, copy the overlapping sub-block
        box = values.reshape(saved.box_shape)
        src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, s_lo))
        dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, t_lo))
        out[dst] = box[src]
        covered[dst] = True
        return
    # general path: a flat range of a block; place element by element via global coordinates
    coords = np.unravel_index(np.arange(*saved.flat), saved.box_shape)
    coords = [c + o for c, o in zip(coords, s_lo)]
    inside = np.ones(len(values), dtype=bool)
    for c, a, b in zip(coords, t_lo, t_hi):
        inside &= (c >= a) & (c < b)
    dst = tuple(c[inside] - a for c, a in zip(coords, t_lo))
    out[dst] = values[inside]
    covered[dst] = True


def count_coverage(saved: Piece, counts: np.ndarray) -> None:
    """Add 1 to every element of the global tensor that the saved piece holds (padding outside it is ignored)."""
    shape = np.asarray(counts.shape)
    lo = np.asarray(saved.box_offset)
    if saved.whole_box:
        hi = np.minimum(lo + np.asarray(saved.box_shape), shape)
        counts[tuple(slice(a, b) for a, b in zip(lo, hi))] += 1
        return
    coords = [c + o for c, o in zip(np.unravel_index(np.arange(*saved.flat), saved.box_shape), lo)]
    inside = np.ones(saved.size, dtype=bool)
    for c, n in zip(coords, shape):
        inside &= c < n
    np.add.at(counts, tuple(c[inside] for c in coords), 1)
