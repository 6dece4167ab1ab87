"""Parameters as flat buffers with named views (docs/architecture.md, State strategies).

A `UnitLayout` lists a unit's tensors. Each `ParamSpec` knows the tensor's GLOBAL shape and where this rank's piece
sits in it (`offset`): with tensor parallelism a rank holds a block of a weight, and checkpoints, initialisation and
gradient norms need to know which. A `FlatBuffer` places units one after the other in ONE contiguous array, so
data-parallel all-reduce, ZeRO sharding, bucketing, offloading and checkpoints work on contiguous ranges instead of
hundreds of small arrays. Each unit's range can be padded to a multiple of the data-parallel size, so ZeRO shards are
equal without any "must be divisible" rule (padding is zero and stays zero).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]  # this rank's piece
    init: str  # "normal" (std), "zeros", "ones"
    std: float = 0.0
    global_shape: tuple[int, ...] | None = None  # None: the piece is the whole tensor
    offset: tuple[int, ...] | None = None  # where the piece starts in the global tensor
    tp_replicated: bool = True  # identical on every tensor-parallel rank (counted once in norms, saved once)
    # What the state strategies derive everything from (gradient buffers, reductions, norms, checkpoint replicas):
    trainable: bool = True  # False: no gradient buffer, no optimizer state, no reduction (frozen, e.g. under LoRA)
    tp_axis: int | None = None  # the axis split over the tensor-parallel ranks (None: replicated or tp = 1)
    reduce_over: str = "dp"  # the mesh group that sums its gradient ("dp"; "expert_dp" for experts under ep > 1)
    tied_to: str | None = None  # global name of the tensor this one is a copy of (gpt2's head copy of "embed.wte")

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.global_shape or self.shape

    @property
    def start(self) -> tuple[int, ...]:
        return self.offset or (0,) * len(self.shape)

    @property
    def decay(self) -> bool:
        """Decoupled weight decay on matrices only (embeddings included), never on biases or norm gains."""
        return len(self.shape) >= 2

    @property
    def norm_groups(self) -> tuple[str, ...]:
        """Mesh groups over which the squares of this tensor's gradient are summed into the global norm, beyond the
        ranks that share its reduction (a tp-split tensor's pieces differ per tp rank; a replicated one does not)."""
        split = () if self.tp_replicated else ("tp",)
        return split + ("ep",) if self.reduce_over == "expert_dp" else split  # each ep rank holds other experts

    def piece(self, full: np.ndarray) -> np.ndarray:
        """This rank's piece of the full tensor."""
        return full[tuple(slice(s, s + n) for s, n in zip(self.start, self.shape))]


@dataclass
class UnitLayout:
    name: str  # global, layout-independent: "embed", "blocks.3", "head"
    specs: list[ParamSpec]

    def __post_init__(self):
        # Stable order: trainable tensors first (frozen ones form the unit's tail), decayed before the rest,
        # tensor-parallel-sharded before replicated within each: each such class is a few contiguous ranges.
        self.specs = sorted(self.specs, key=lambda s: (not s.trainable, not s.decay, s.tp_replicated))

    @property
    def size(self) -> int:
        return sum(s.size for s in self.specs)


def init_tensor(spec: ParamSpec, unit_name: str, seed: int) -> np.ndarray:
    """Initial value of this rank's piece: a slice of the full tensor, itself a pure function of (seed, tensor name),
    so every layout starts from the same model."""
    if spec.init == "zeros":
        return np.zeros(spec.shape)
    if spec.init == "ones":
        return np.ones(spec.shape)
    rng = np.random.default_rng([seed, zlib.crc32(f"{unit_name}.{spec.name}".encode())])
    return spec.piece(rng.normal(0.0, spec.std, size=spec.full_shape))


def padded(size: int, align: int) -> int:
    return -(-size // align) * align


@dataclass
class FlatBuffer:
    """One contiguous array holding the tensors of several units, with a dict of named views per unit."""
    layouts: list[UnitLayout]
    data: object  # xp array, 1-D
    offsets: list[int] = field(default_factory=list)  # unit i occupies [offsets[i], offsets[i] + layouts[i].size)
    views: list[dict] = field(default_factory=list)

    @classmethod
    def geometry(cls, layouts: list[UnitLayout], align: int = 1) -> FlatBuffer:
        """Offsets and ranges only, no array: for code that needs to know where tensors sit (ZeRO-3 shards)."""
        return cls(layouts, None, np.cumsum([0] + [padded(u.size, align) for u in layouts]).tolist())

    @classmethod
    def allocate(cls, layouts: list[UnitLayout], xp, dtype, align: int = 1, zeros=None) -> FlatBuffer:
        """zeros(size, dtype): where the array lives (default xp.zeros; offloaded masters: state/offload.py)."""
        buf = cls.geometry(layouts, align)
        buf.data = zeros(buf.offsets[-1], dtype) if zeros else xp.zeros(buf.offsets[-1], dtype=dtype)
        buf.views = [buf._unit_views(i) for i in range(len(layouts))]
        return buf

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def _unit_views(self, index: int) -> dict:
        views, position = {}, self.offsets[index]
        for spec in self.layouts[index].specs:
            views[spec.name] = self.data[position:position + spec.size].reshape(spec.shape)
            position += spec.size
        return views

    def unit_range(self, index: int) -> tuple[int, int]:
        """[start, end) of unit `index`, padding included."""
        return self.offsets[index], self.offsets[index + 1]

    def ranges(self, predicate) -> list[tuple[int, int]]:
        """Flat [start, end) ranges holding the tensors for which predicate(spec) is true, adjacent ones merged."""
        found: list[list[int]] = []
        for layout, start in zip(self.layouts, self.offsets):
            for spec in layout.specs:
                if predicate(spec):
                    if found and found[-1][1] == start:
                        found[-1][1] = start + spec.size
                    else:
                        found.append([start, start + spec.size])
                start += spec.size
        return [tuple(r) for r in found]

    def named_views(self):
        for layout, views in zip(self.layouts, self.views):
            for spec in layout.specs:
                yield f"{layout.name}.{spec.name}", views[spec.name]


def initial_unit_flat(layout: UnitLayout, seed: int, size: int) -> np.ndarray:
    """The unit's initial parameters as one host float64 flat array of `size` (padding zero), in layout order."""
    flat = np.zeros(size)
    position = 0
    for spec in layout.specs:
        flat[position:position + spec.size] = init_tensor(spec, layout.name, seed).reshape(-1)
        position += spec.size
    return flat


def initialise(buffer: FlatBuffer, seed: int, backend) -> None:
    """Every unit of `buffer` at its initial value (a pure function of the seed and the tensors' names)."""
    for index, layout in enumerate(buffer.layouts):
        start, end = buffer.unit_range(index)
        buffer.data[start:end] = backend.from_host(initial_unit_flat(layout, seed, end - start), buffer.data.dtype)


def intersect(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of `ranges` inside [start, end), shifted so that `start` becomes 0."""
    return [(max(a, start) - start, min(b, end) - start) for a, b in ranges if a < end and b > start]
