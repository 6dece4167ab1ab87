"""ZeRO-1/2/3 (FSDP): shard optimizer state, then gradients, then parameters across the data-parallel group.

Every unit's flat range is padded to a multiple of the group size N and cut into N equal shards; rank r owns shard r
of every unit (so any parameter count works, and one unit is one all-gather / reduce-scatter). A stage is two
choices, each a small object of state/zero_placements.py: where the compute-dtype parameters live (`FullParams` |
`ShardedParams`) and where gradients live (`AccumulatedGrads` | `ShardedGrads`). The master weights (fp32 when the
compute dtype is lower; else the parameters' own shard) and Adam's moments are always sharded. Bytes per parameter
kept between steps (e = compute bytes; bf16 with Adam: e = 2, master + moments = 12; at float32 the master is the
parameters):

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

from mpitrain.state.frozen import frozen_nbytes, hold_frozen, split_frozen
from mpitrain.state.hierarchical_quantized import make_grad_reducer
from mpitrain.state.offload import OnDevice
from mpitrain.state.params import FlatBuffer, initial_unit_flat, intersect
from mpitrain.state.strategy import Segment, ShardLayout, StateStrategy, add_up, norm_ranges, squared_sum
from mpitrain.state.zero_placements import (  # noqa: F401 (gather, gathered_views: importers' names)
    STAGES,
    ShardedFrozen,
    gather,
    gathered_views,
    split_by_reduction,
)
from mpitrain.state.zero_quantized import QuantizedComm


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
