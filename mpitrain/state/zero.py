"""ZeRO-1/2/3 (FSDP): shard optimizer state, then gradients, then parameters across the data-parallel group.

Every unit's flat range is padded to a multiple of the group size N and cut into N equal shards; rank r owns shard r
of every unit (so any parameter count works, and one unit is one all-gather / reduce-scatter). A stage is two
choices, each a small object below: where the compute-dtype parameters live (`FullParams` | `ShardedParams`) and
where gradients live (`AccumulatedGrads` | `ShardedGrads`). The master weights (fp32 when the compute dtype is
lower; else the parameters' own shard) and Adam's moments are always sharded. Bytes per parameter kept between steps
(e = compute bytes; bf16 with Adam: e = 2, master + moments = 12; at float32 the master is the parameters):

    stage 1  FullParams    + AccumulatedGrads   e + e + 12/N       the reduced shard lands in the full gradient
    stage 2  FullParams    + ShardedGrads       e + (e + 12)/N     a unit's full gradient lives only from its
                                                                   backward until its reduce-scatter is issued
    stage 3  ShardedParams + ShardedGrads       (2e + 12)/N        a unit's full parameters are all-gathered just
                                                                   before its forward, freed after it, gathered
                                                                   again for its backward (next one prefetched)

Communication per step, ring algorithms: stages 1 and 2 reduce-scatter gradients and all-gather the updated
parameters: 2(N-1)/N Psi, the same as plain data parallelism's all-reduce. Stage 3 gathers twice and reduce-scatters
once: 3(N-1)/N Psi, or 2(N-1)/N Psi with reshard_after_forward = false (parameters kept from forward to backward).
Stages 2 and 3 reduce-scatter every micro-batch (their full gradients are gone by the next one); stage 1 once a step.

Expert parallelism: a tensor is sharded over the group that sums its gradient (`ParamSpec.reduce_over`). Each unit
is cut into parts, one per such group (an MoE block: its dense tensors over dp, its experts over expert_dp, the dp
ranks that hold the same experts); a part is the unit of sharding, reduce-scatter and all-gather, so an expert's
state per rank falls by the expert-dp size (dp / ep), the dense tensors' by dp. Without experts, part = unit.
"""
from __future__ import annotations

import math

import numpy as np

from mpitrain.backend import wire_view
from mpitrain.state.frozen import frozen_nbytes, hold_frozen, split_frozen, with_frozen
from mpitrain.state.hierarchical_quantized import make_grad_reducer
from mpitrain.state.offload import OnDevice
from mpitrain.state.params import FlatBuffer, UnitLayout, initial_unit_flat, intersect
from mpitrain.state.reduce import add_into
from mpitrain.state.strategy import Segment, ShardLayout, StateStrategy, add_up, norm_ranges, squared_sum
from mpitrain.state.zero_quantized import QuantizedComm, quantized_gather


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


class ZeroState(StateStrategy):
    sharded = True

    def __init__(self, layouts, backend, seed: int | None, group, stage: int, overlap: bool = True,
                 reshard_after_forward: bool = True, grad_reduce: str = "float32", placement=None,
                 other_groups=None, quantized: QuantizedComm | None = None):
        """placement: where the master shard lives when it is separate (mpitrain/state/offload.py; None: device).
        other_groups: {ParamSpec.reduce_over: group} for tensors not reduced over `group` (experts: expert_dp):
        they are sharded over that group. Frozen tensors in `layouts` are held whole beside the parameters at
        stages 1 and 2 (state/frozen.py), sharded and gathered like the parameters at stage 3 (ShardedFrozen)."""
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        self.layouts, self.backend, self.group, self.stage = layouts, backend, group, stage
        self.overlap, self.reshard_after_forward = overlap, reshard_after_forward
        self.groups = {None: group, **(other_groups or {})}  # by reduction name (None: the main group)
        self.align = math.lcm(*(g.size for g in self.groups.values()))  # every part splits over its group
        self.frozen = self.frozen_shards = None
        if stage == 3:  # frozen tensors sharded and gathered like the parameters
            layouts, frozen_layouts = split_frozen(layouts)
            self.frozen_shards = ShardedFrozen(self, frozen_layouts, seed) if frozen_layouts else None
        else:  # frozen tensors whole beside the full parameters
            layouts, self.frozen = hold_frozen(layouts, backend, seed)
        self.layouts = layouts
        self.parts, self.reductions, self.parts_of = split_by_reduction(layouts, other_groups or {})
        self.geometry = FlatBuffer.geometry(self.parts, align=self.align)  # part ranges padded to multiples
        self.shard_sizes = [(self.geometry.unit_range(p)[1] - self.geometry.unit_range(p)[0]) // self.group_of(p).size
                            for p in range(len(self.parts))]
        self.shard_offsets = np.cumsum([0] + self.shard_sizes).tolist()
        self.quantized = quantized or QuantizedComm()  # ZeRO++'s quantized wire formats (state/zero_quantized.py)
        self.reducers = {name: make_grad_reducer(g, backend.dtype, grad_reduce, self.quantized)
                         for name, g in self.groups.items()}
        self.norm_ranges = norm_ranges(self.geometry)
        params_kind, grads_kind = STAGES[stage]
        self.params, self.grads = params_kind(self), grads_kind(self)
        self.master = None  # None: the parameters' own shard is the master (float32/float64 compute)
        self.placement = placement or OnDevice(backend.xp)
        if backend.mixed:
            self.master = self.placement.zeros("master", self.shard_offsets[-1], backend.optimizer_dtype)
        for part, (layout, size) in enumerate(zip(self.parts, self.shard_sizes)):
            if seed is None:  # left at zero: a checkpoint fills them (plan/dryrun.py only counts their bytes)
                break
            # in the optimizer's dtype, rounded from there to the compute dtype (as after every step)
            full = backend.from_host(initial_unit_flat(layout, seed, size * self.group_of(part).size),
                                     backend.optimizer_dtype)
            self.params.place(part, full.astype(backend.dtype, copy=False))
            if self.master is not None:
                self.master_shard(part)[...] = full[slice(*self.window(part, local=True))]
        self._pending: list = []  # (Handle, part)
        self._last_micro_batch = False

    # -- geometry
    def group_of(self, part: int):
        return self.groups[self.reductions[part]]

    def by_unit(self, part_views: list[dict]) -> list[dict]:
        """Per-part views merged into one dict per unit (what the model asks for)."""
        return [{name: view for part in parts for name, view in part_views[part].items()} for parts in self.parts_of]

    def shard_of(self, flat_shards, part: int):
        return flat_shards[self.shard_offsets[part]:self.shard_offsets[part + 1]]

    def window(self, part: int, local: bool = False) -> tuple[int, int]:
        """This rank's shard of `part` in the coordinates of the padded full flat buffer (local: of the part)."""
        start = (0 if local else self.geometry.unit_range(part)[0]) + self.group_of(part).rank * self.shard_sizes[part]
        return start, start + self.shard_sizes[part]

    @property
    def reduces_every_micro_batch(self) -> bool:
        """Stages 2 and 3: each micro-batch's full gradient is reduce-scattered and freed (stage 1 keeps it)."""
        return self.grads.every_micro_batch

    def master_shard(self, part: int):
        return self.params.shard(part) if self.master is None else self.shard_of(self.master, part)

    # -- what the model calls
    def acquire(self, unit: int, phase: str) -> dict:
        return self.params.acquire(unit, phase)

    def release(self, unit: int, phase: str) -> None:
        self.params.release(unit, phase)

    def frozen_changed(self, unit: int) -> None:
        if self.frozen_shards is not None:  # stage 3: the acquired frozen tensors are a gathered copy
            self.frozen_shards.keep_changes(unit)

    def grad_views(self, unit: int) -> dict:
        return self.grads.views(unit)

    def unit_done(self, unit: int) -> None:
        if self.grads.every_micro_batch or self._last_micro_batch:
            for part in self.parts_of[unit]:
                pending = self.reducers[self.reductions[part]].reduce_scatter(self.grads.full(part))
                self._pending.append((pending, part))
                if not self.overlap:
                    pending.wait()
        self._progress(wait=False)

    def _progress(self, wait: bool) -> None:
        """Hand every completed reduction's shard to the gradient placement, in issue order."""
        still = []
        for pending, part in self._pending:
            if wait:
                pending.wait()
            if not still and pending.test():
                self.grads.take(part, pending.result)
            else:
                still.append((pending, part))
        self._pending = still

    # -- what the trainer calls
    def zero_grads(self) -> None:
        self.grads.zero_fill()

    def begin_micro_batch(self, last: bool) -> None:
        self._last_micro_batch = last

    def finish(self) -> None:
        self._progress(wait=True)

    def grad_sq_sums(self) -> dict:
        """From the shards: each rank sums its windows, the group that shards them adds up (experts: expert_dp;
        the caller then sums their key over ep)."""
        totals = []
        for name, group in self.groups.items():
            parts = [p for p in range(len(self.parts)) if self.reductions[p] == name]
            keys = sorted({spec.norm_groups for p in parts for spec in self.parts[p].specs})
            local = add_up([{key: squared_sum(self.grads.shard(p), intersect(self.norm_ranges.get(key, []),
                                                                             *self.window(p))) for key in keys}
                            for p in parts])
            totals.append({key: group.all_reduce_scalar(value) for key, value in sorted(local.items())})
        return add_up(totals)

    def reduced_grad_window(self, unit: int):
        part, *more = self.parts_of[unit]
        if more:
            raise NotImplementedError(f"unit {self.layouts[unit].name} is sharded over several groups")
        return self.geometry, self.window(part), self.grads.shard(part)

    def optimizer_segments(self) -> list[Segment]:
        decay = self.geometry.ranges(lambda spec: spec.decay)
        return [Segment(self.master_shard(p), self.grads.shard(p), intersect(decay, *self.window(p)))
                for p in range(len(self.parts))]

    def after_step(self) -> None:
        if self.master is not None:
            for part in range(len(self.parts)):
                self.params.shard(part)[...] = self.master_shard(part)  # rounded to the compute dtype
        self.params.publish()

    def checkpoint_layout(self) -> ShardLayout:
        """Master weights and moments by part: this rank's window of each (the parameters whole under stages 1-2
        when they are their own master)."""
        parts = range(len(self.parts))
        if self.master is None:
            windows, replicated = self.params.held()
        else:
            windows, replicated = [(*self.window(p), self.master, self.shard_offsets[p]) for p in parts], False
        shards = self.frozen_shards
        return ShardLayout(self.geometry, [self.window(p) for p in parts], windows, params_dp_replicated=replicated,
                           moments_dp_replicated=False, segment_groups=[self.group_of(p) for p in parts],
                           frozen=self.frozen if shards is None else shards.geometry,
                           frozen_windows=None if shards is None else shards.windows())

    def after_restore(self) -> None:
        """Derive the compute-dtype parameters from the loaded masters; nothing gathered may outlive them."""
        self.after_step()

    def memory(self) -> dict:
        """Bytes of the arrays this state keeps between steps (transient gathers and unit gradients excluded)."""
        master = self.placement.resident_nbytes(self.master)  # None (the params are the master) or off the device: 0
        params = self.params.nbytes + frozen_nbytes(self.frozen)
        params += 0 if self.frozen_shards is None else int(self.frozen_shards.data.nbytes)
        return {"params": params, "grads": self.grads.nbytes, "master": master}
