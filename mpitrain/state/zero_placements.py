"""Where a ZeRO stage keeps the compute-dtype parameters and the gradients (state/zero.py's two choices per stage,
`STAGES`): the whole parameters on every rank (`FullParams`, stages 1-2) or only this rank's shard, a unit gathered
for its forward and backward with the next one prefetched (`ShardedParams`, stage 3, with `ShardedFrozen` for its
frozen tensors); full gradients accumulated over the micro-batches (`AccumulatedGrads`, stage 1) or a part's full
gradient only from its backward to its reduce-scatter (`ShardedGrads`, stages 2-3). Each takes the ZeroState it
serves, whose geometry (parts, windows, groups) it reads; `split_by_reduction` cuts units into those parts.
"""
from __future__ import annotations

import numpy as np

from mpitrain.backend import wire_view
from mpitrain.state.frozen import with_frozen
from mpitrain.state.params import FlatBuffer, UnitLayout, initial_unit_flat
from mpitrain.state.reduce import add_into
from mpitrain.state.zero_quantized import quantized_gather


class FullParams:
    """Stages 1, 2: every rank holds the whole compute-dtype parameters; after a step the shards are all-gathered."""

    def __init__(self, zero):
        self.zero = zero
        self.buffer = FlatBuffer.allocate(zero.parts, zero.backend.xp, zero.backend.dtype, align=zero.align)
        self.unit_views = with_frozen(zero.by_unit(self.buffer.views), zero.frozen)

    def place(self, part: int, full) -> None:
        self.buffer.data[slice(*self.zero.geometry.unit_range(part))] = full

    def shard(self, part: int):
        return self.buffer.data[slice(*self.zero.window(part))]

    def acquire(self, unit: int, phase: str) -> dict:
        return self.unit_views[unit]

    def release(self, unit: int, phase: str) -> None:
        pass

    def publish(self) -> None:
        """Every rank's updated shard to every rank of its part's group."""
        handles = []
        for part in range(len(self.zero.parts)):
            own = self.shard(part).copy()  # MPI forbids the send buffer to alias the receive buffer
            full = self.buffer.data[slice(*self.zero.geometry.unit_range(part))]
            handles.append(self.zero.group_of(part).iall_gather(wire_view(own), wire_view(full)))
        for handle in handles:
            handle.wait()

    def held(self):
        return [(0, self.zero.geometry.size, self.buffer.data, 0)], True  # windows, replicated over each group

    @property
    def nbytes(self) -> int:
        return int(self.buffer.data.nbytes)


class ShardedParams:
    """Stage 3: only this rank's shard; a unit's full parameters are gathered for its forward and backward."""

    def __init__(self, zero):
        self.zero = zero
        self.data = zero.backend.xp.zeros(zero.shard_offsets[-1], dtype=zero.backend.dtype)
        self.gathered: dict[int, list] = {}  # part -> [single-part FlatBuffer, pending handle or None]

    def shard(self, part: int):
        return self.zero.shard_of(self.data, part)

    def place(self, part: int, full) -> None:
        self.shard(part)[...] = full[slice(*self.zero.window(part, local=True))]

    def _start_gathers(self, unit: int) -> None:
        z = self.zero
        for part in z.parts_of[unit]:
            if part not in self.gathered:
                self.gathered[part] = gather(z.parts[part], self.shard(part), z.group_of(part), z)
        if z.frozen_shards is not None:
            z.frozen_shards.start_gathers(unit)

    def acquire(self, unit: int, phase: str) -> dict:
        self._start_gathers(unit)
        z = self.zero
        views = {} if z.frozen is None else dict(z.frozen.views[unit])
        if z.frozen_shards is not None:
            views.update(z.frozen_shards.views(unit))
        for part in z.parts_of[unit]:
            views.update(gathered_views(self.gathered[part]))
        upcoming = unit + 1 if phase == "forward" else unit - 1  # prefetch: overlap the next gather with compute
        if 0 <= upcoming < len(z.layouts):
            self._start_gathers(upcoming)
        return views

    def release(self, unit: int, phase: str) -> None:
        if phase == "backward" or self.zero.reshard_after_forward:
            for part in self.zero.parts_of[unit]:
                self.gathered.pop(part, None)  # free the full parameters: only the shard stays
            if self.zero.frozen_shards is not None:
                self.zero.frozen_shards.release(unit)

    def publish(self) -> None:
        drop_gathers(self.gathered)  # nothing gathered may outlive an update: the next forward gathers anew
        if self.zero.frozen_shards is not None:
            drop_gathers(self.zero.frozen_shards.gathered)  # nor a restore of the frozen shards

    def held(self):
        z = self.zero
        return [(*z.window(p), self.data, z.shard_offsets[p]) for p in range(len(z.parts))], False

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def gather(layout: UnitLayout, shard, group, zero) -> list:
    """[a single-part FlatBuffer, the handle of the all-gather filling it from every rank's shard]."""
    if zero.quantized.gathers_quantized:  # parallel.zero_gather_dtype: a decoded copy (state/zero_quantized.py)
        return quantized_gather(layout, shard, group, zero, zero.quantized.gather, zero.quantized.block)
    buffer = FlatBuffer.allocate([layout], zero.backend.xp, zero.backend.dtype, align=zero.align)
    return [buffer, group.iall_gather(wire_view(shard), wire_view(buffer.data))]


def drop_gathers(gathered: dict) -> None:
    """Forgets gathers, first waiting for any still in flight (a prefetch): MPI must not write into a freed buffer."""
    for entry in gathered.values():
        gathered_views(entry)
    gathered.clear()


def gathered_views(entry: list) -> dict:
    """The views of a gather's buffer, once its all-gather has landed."""
    if entry[1] is not None:
        entry[1].wait()
        entry[1] = None
    return entry[0].views[0]


class ShardedFrozen:
    """Stage 3's frozen tensors (LoRA's base): sharded like the trainable parameters (each unit cut into parts by
    the group that holds its replicas, padded to a multiple of the group size, rank r keeping shard r) and gathered
    whole for a unit's forward and backward, so they cost 1/N per rank; never reduced, no optimizer state."""

    def __init__(self, zero, layouts: list[UnitLayout], seed: int | None):
        self.zero = zero
        self.parts, self.reductions, self.parts_of = split_by_reduction(layouts, {k for k in zero.groups if k})
        self.geometry = FlatBuffer.geometry(self.parts, align=zero.align)
        self.sizes = [(self.geometry.unit_range(p)[1] - self.geometry.unit_range(p)[0]) // self.group_of(p).size
                      for p in range(len(self.parts))]
        self.offsets = np.cumsum([0] + self.sizes).tolist()
        self.data = zero.backend.xp.zeros(self.offsets[-1], dtype=zero.backend.dtype)
        self.gathered: dict[int, list] = {}
        for part, layout in enumerate(self.parts):
            if seed is not None:
                full = initial_unit_flat(layout, seed, self.sizes[part] * self.group_of(part).size)
                self.shard(part)[...] = zero.backend.from_host(full[slice(*self.window(part, local=True))],
                                                                zero.backend.dtype)

    def group_of(self, part: int):
        return self.zero.groups[self.reductions[part]]

    def shard(self, part: int):
        return self.data[self.offsets[part]:self.offsets[part + 1]]

    def window(self, part: int, local: bool = False) -> tuple[int, int]:
        start = (0 if local else self.geometry.unit_range(part)[0]) + self.group_of(part).rank * self.sizes[part]
        return start, start + self.sizes[part]

    def start_gathers(self, unit: int) -> None:
        for part in self.parts_of[unit]:
            if part not in self.gathered:
                self.gathered[part] = gather(self.parts[part], self.shard(part), self.group_of(part), self.zero)

    def views(self, unit: int) -> dict:
        views = {}
        for part in self.parts_of[unit]:
            views.update(gathered_views(self.gathered[part]))
        return views

    def release(self, unit: int) -> None:
        for part in self.parts_of[unit]:
            self.gathered.pop(part, None)

    def keep_changes(self, unit: int) -> None:
        """The gathered (acquired) tensors of `unit` were changed in place, alike on every rank: this rank's window
        of them becomes its shard."""
        for part in self.parts_of[unit]:
            whole = self.gathered[part][0].data
            self.shard(part)[...] = whole[slice(*self.window(part, local=True))]

    def windows(self) -> list:
        """(start, end, array, offset in it) of this rank's shards, in the geometry's coordinates."""
        return [(*self.window(p), self.data, self.offsets[p]) for p in range(len(self.parts))]


class AccumulatedGrads:
    """Stage 1: full gradients accumulate locally over the micro-batches; the last one's backward reduce-scatters
    each part, and the reduced shard is written over this rank's window of the full gradient."""

    every_micro_batch = False

    def __init__(self, zero):
        self.zero = zero
        self.buffer = FlatBuffer.allocate(zero.parts, zero.backend.xp, zero.backend.dtype, align=zero.align)
        self.unit_views = zero.by_unit(self.buffer.views)

    def views(self, unit: int) -> dict:
        return self.unit_views[unit]

    def full(self, part: int):
        return self.buffer.data[slice(*self.zero.geometry.unit_range(part))]

    def shard(self, part: int):
        return self.buffer.data[slice(*self.zero.window(part))]

    def take(self, part: int, received) -> None:
        self.shard(part)[...] = received

    def zero_fill(self) -> None:
        self.buffer.data.fill(0)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.data.nbytes)


class ShardedGrads:
    """Stages 2, 3: a part's full gradient exists from its unit's backward until its reduce-scatter is issued; every
    micro-batch's reduced shard is added into this rank's gradient shard."""

    every_micro_batch = True

    def __init__(self, zero):
        self.zero = zero
        self.data = zero.backend.xp.zeros(zero.shard_offsets[-1], dtype=zero.backend.dtype)
        self.in_backward: dict[int, FlatBuffer] = {}  # part -> its full gradient

    def views(self, unit: int) -> dict:
        z, views = self.zero, {}
        for part in z.parts_of[unit]:
            if part not in self.in_backward:
                self.in_backward[part] = FlatBuffer.allocate([z.parts[part]], z.backend.xp, z.backend.dtype,
                                                             align=z.align)
            views.update(self.in_backward[part].views[0])
        return views

    def full(self, part: int):
        return self.in_backward.pop(part).data  # the reduction in flight keeps it alive until it completes

    def shard(self, part: int):
        return self.zero.shard_of(self.data, part)

    def take(self, part: int, received) -> None:
        add_into(self.shard(part), received)

    def zero_fill(self) -> None:
        self.data.fill(0)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


STAGES = {1: (FullParams, AccumulatedGrads), 2: (FullParams, ShardedGrads), 3: (ShardedParams, ShardedGrads)}


def split_by_reduction(layouts, others) -> tuple[list[UnitLayout], list[str | None], list[list[int]]]:
    """(parts, the reduction each part's tensors share, the parts of each unit): a unit's tensors cut by
    `ParamSpec.reduce_over` where it names a group of `others`, the rest (None: the main group) first. A unit
    without tensors keeps one empty part."""
    parts, reductions, parts_of = [], [], []
    for layout in layouts:
        cut: dict = {}
        for spec in layout.specs:
            cut.setdefault(spec.reduce_over if spec.reduce_over in others else None, []).append(spec)
        parts_of.append([])
        for name, specs in sorted(cut.items(), key=lambda item: item[0] or "") or [(None, [])]:
            parts_of[-1].append(len(parts))
            parts.append(UnitLayout(layout.name, specs))  # the unit's name: checkpoints name tensors by it
            reductions.append(name)
    return parts, reductions, parts_of
