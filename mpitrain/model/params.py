"""Parameters as flat buffers with named views (design decision 3).

A `UnitLayout` lists a unit's tensors (name, shape, how to initialise, whether weight decay applies). A `FlatBuffer`
places the units of a stage one after the other in ONE contiguous array, so data-parallel all-reduce, ZeRO sharding,
bucketing, offloading and checkpoints all work on contiguous ranges instead of hundreds of small arrays. Inside a
unit, decayed tensors (matrices) come first, so each unit's decayed part is a single range.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    init: str  # "normal" (std), "zeros", "ones"
    std: float = 0.0

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def decay(self) -> bool:
        """Decoupled weight decay on matrices only (embeddings included), never on biases or norm gains."""
        return len(self.shape) >= 2


@dataclass
class UnitLayout:
    name: str  # global, layout-independent: "embed", "blocks.3", "head"
    specs: list[ParamSpec]

    def __post_init__(self):
        self.specs = sorted(self.specs, key=lambda s: not s.decay)  # stable: matrices first

    @property
    def size(self) -> int:
        return sum(s.size for s in self.specs)

    @property
    def decay_size(self) -> int:
        return sum(s.size for s in self.specs if s.decay)


def init_tensor(spec: ParamSpec, unit_name: str, seed: int) -> np.ndarray:
    """The full initial value of one tensor, a pure function of (seed, tensor name): every layout starts equal."""
    if spec.init == "zeros":
        return np.zeros(spec.shape)
    if spec.init == "ones":
        return np.ones(spec.shape)
    rng = np.random.default_rng([seed, zlib.crc32(f"{unit_name}.{spec.name}".encode())])
    return rng.normal(0.0, spec.std, size=spec.shape)


@dataclass
class FlatBuffer:
    """One contiguous array holding the tensors of several units, with a dict of named views per unit."""
    layouts: list[UnitLayout]
    data: object  # xp array, 1-D
    offsets: list[int] = field(default_factory=list)
    views: list[dict] = field(default_factory=list)

    @classmethod
    def allocate(cls, layouts: list[UnitLayout], xp, dtype) -> "FlatBuffer":
        offsets = np.cumsum([0] + [u.size for u in layouts]).tolist()
        buf = cls(layouts, xp.zeros(offsets[-1], dtype=dtype), offsets)
        buf.views = [buf._unit_views(i) for i in range(len(layouts))]
        return buf

    def _unit_views(self, index: int) -> dict:
        views, position = {}, self.offsets[index]
        for spec in self.layouts[index].specs:
            views[spec.name] = self.data[position:position + spec.size].reshape(spec.shape)
            position += spec.size
        return views

    def unit_range(self, index: int) -> tuple[int, int]:
        return self.offsets[index], self.offsets[index + 1]

    def decay_ranges(self) -> list[tuple[int, int]]:
        """Flat [start, end) ranges that get weight decay."""
        return [(self.offsets[i], self.offsets[i] + u.decay_size) for i, u in enumerate(self.layouts) if u.decay_size]

    def named_views(self):
        for layout, views in zip(self.layouts, self.views):
            for spec in layout.specs:
                yield f"{layout.name}.{spec.name}", views[spec.name]
