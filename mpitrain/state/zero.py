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
"""
from __future__ import annotations

import numpy as np

from mpitrain.backend import wire_view
from mpitrain.optim.adamw import Segment
from mpitrain.state.offload import OnDevice, resident_nbytes
from mpitrain.state.params import FlatBuffer, initial_unit_flat, intersect
from mpitrain.state.reduce import GradReducer, add_into
from mpitrain.state.strategy import StateStrategy, add_up, norm_ranges, squared_sum


class FullParams:
    """Stages 1, 2: every rank holds the whole compute-dtype parameters; after a step the shards are all-gathered."""

    def __init__(self, zero):
        self.zero = zero
        self.buffer = FlatBuffer.allocate(zero.layouts, zero.backend.xp, zero.backend.dtype, align=zero.group.size)

    def place(self, unit: int, full) -> None:
        self.buffer.data[slice(*self.zero.geometry.unit_range(unit))] = full

    def shard(self, unit: int):
        return self.buffer.data[slice(*self.zero.window(unit))]

    def acquire(self, unit: int, phase: str) -> dict:
        return self.buffer.views[unit]

    def release(self, unit: int, phase: str) -> None:
        pass

    def publish(self) -> None:
        """Every rank's updated shard to every rank."""
        handles = []
        for unit in range(len(self.zero.layouts)):
            own = self.shard(unit).copy()  # MPI forbids the send buffer to alias the receive buffer
            full = self.buffer.data[slice(*self.zero.geometry.unit_range(unit))]
            handles.append(self.zero.group.iall_gather(wire_view(own), wire_view(full)))
        for handle in handles:
            handle.wait()

    def held(self):
        return [(0, self.zero.geometry.size, self.buffer.data, 0)], True  # windows, replicated over dp

    @property
    def nbytes(self) -> int:
        return int(self.buffer.data.nbytes)


class ShardedParams:
    """Stage 3: only this rank's shard; a unit's full parameters are gathered for its forward and backward."""

    def __init__(self, zero):
        self.zero = zero
        self.data = zero.backend.xp.zeros(zero.shard_offsets[-1], dtype=zero.backend.dtype)
        self.gathered: dict[int, list] = {}  # unit -> [single-unit FlatBuffer, pending handle or None]

    def shard(self, unit: int):
        return self.zero.shard_of(self.data, unit)

    def place(self, unit: int, full) -> None:
        self.shard(unit)[...] = full[slice(*self.zero.window(unit, local=True))]

    def _start_gather(self, unit: int) -> None:
        z = self.zero
        buffer = FlatBuffer.allocate([z.layouts[unit]], z.backend.xp, z.backend.dtype, align=z.group.size)
        self.gathered[unit] = [buffer, z.group.iall_gather(wire_view(self.shard(unit)), wire_view(buffer.data))]

    def acquire(self, unit: int, phase: str) -> dict:
        if unit not in self.gathered:
            self._start_gather(unit)
        entry = self.gathered[unit]
        if entry[1] is not None:
            entry[1].wait()
            entry[1] = None
        upcoming = unit + 1 if phase == "forward" else unit - 1  # prefetch: overlap the next gather with compute
        if 0 <= upcoming < len(self.zero.layouts) and upcoming not in self.gathered:
            self._start_gather(upcoming)
        return entry[0].views[0]

    def release(self, unit: int, phase: str) -> None:
        if phase == "backward" or self.zero.reshard_after_forward:
            self.gathered.pop(unit, None)  # free the full parameters: only the shard stays

    def publish(self) -> None:
        self.gathered.clear()  # nothing gathered may outlive an update: the next forward gathers anew

    def held(self):
        z = self.zero
        return [(*z.window(u), self.data, z.shard_offsets[u]) for u in range(len(z.layouts))], False

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class AccumulatedGrads:
    """Stage 1: full gradients accumulate locally over the micro-batches; the last one's backward reduce-scatters
    each unit, and the reduced shard is written over this rank's window of the full gradient."""

    every_micro_batch = False

    def __init__(self, zero):
        self.zero = zero
        self.buffer = FlatBuffer.allocate(zero.layouts, zero.backend.xp, zero.backend.dtype, align=zero.group.size)

    def views(self, unit: int) -> dict:
        return self.buffer.views[unit]

    def full(self, unit: int):
        return self.buffer.data[slice(*self.zero.geometry.unit_range(unit))]

    def shard(self, unit: int):
        return self.buffer.data[slice(*self.zero.window(unit))]

    def take(self, unit: int, received) -> None:
        self.shard(unit)[...] = received

    def zero_fill(self) -> None:
        self.buffer.data.fill(0)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.data.nbytes)


class ShardedGrads:
    """Stages 2, 3: a unit's full gradient exists from its backward until its reduce-scatter is issued; every
    micro-batch's reduced shard is added into this rank's gradient shard."""

    every_micro_batch = True

    def __init__(self, zero):
        self.zero = zero
        self.data = zero.backend.xp.zeros(zero.shard_offsets[-1], dtype=zero.backend.dtype)
        self.in_backward: dict[int, FlatBuffer] = {}

    def views(self, unit: int) -> dict:
        if unit not in self.in_backward:
            z = self.zero
            self.in_backward[unit] = FlatBuffer.allocate([z.layouts[unit]], z.backend.xp, z.backend.dtype,
                                                         align=z.group.size)
        return self.in_backward[unit].views[0]

    def full(self, unit: int):
        return self.in_backward.pop(unit).data  # the reduction in flight keeps it alive until it completes

    def shard(self, unit: int):
        return self.zero.shard_of(self.data, unit)

    def take(self, unit: int, received) -> None:
        add_into(self.shard(unit), received)

    def zero_fill(self) -> None:
        self.data.fill(0)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


STAGES = {1: (FullParams, AccumulatedGrads), 2: (FullParams, ShardedGrads), 3: (ShardedParams, ShardedGrads)}


class ZeroState(StateStrategy):
    sharded = True

    def __init__(self, layouts, backend, seed: int, group, stage: int, overlap: bool = True,
                 reshard_after_forward: bool = True, grad_reduce: str = "float32", placement=None):
        """placement: where the master shard lives when it is separate (mpitrain/state/offload.py; None: device)."""
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        self.layouts, self.backend, self.group, self.stage = layouts, backend, group, stage
        self.overlap, self.reshard_after_forward = overlap, reshard_after_forward
        n = group.size
        self.geometry = FlatBuffer.geometry(layouts, align=n)  # unit ranges padded to multiples of n
        self.shard_sizes = [(self.geometry.unit_range(u)[1] - self.geometry.unit_range(u)[0]) // n
                            for u in range(len(layouts))]
        self.shard_offsets = np.cumsum([0] + self.shard_sizes).tolist()
        self.reducer = GradReducer(group, backend.dtype, grad_reduce)
        params_kind, grads_kind = STAGES[stage]
        self.params, self.grads = params_kind(self), grads_kind(self)
        self.master = None  # None: the parameters' own shard is the master (float32/float64 compute)
        if backend.mixed:
            placement = placement or OnDevice(backend.xp)
            self.master = placement.zeros("master", self.shard_offsets[-1], backend.optimizer_dtype)
        for unit, (layout, size) in enumerate(zip(layouts, self.shard_sizes)):
            # in the optimizer's dtype, rounded from there to the compute dtype (as after every step)
            full = backend.from_host(initial_unit_flat(layout, seed, size * n), backend.optimizer_dtype)
            self.params.place(unit, full.astype(backend.dtype, copy=False))
            if self.master is not None:
                self.master_shard(unit)[...] = full[slice(*self.window(unit, local=True))]
        self._pending: list = []  # (Pending, unit)
        self._last_micro_batch = False

    # -- geometry
    def shard_of(self, flat_shards, unit: int):
        return flat_shards[self.shard_offsets[unit]:self.shard_offsets[unit + 1]]

    def window(self, unit: int, local: bool = False) -> tuple[int, int]:
        """This rank's shard of `unit` in the coordinates of the padded full flat buffer (local: of the unit)."""
        start = (0 if local else self.geometry.unit_range(unit)[0]) + self.group.rank * self.shard_sizes[unit]
        return start, start + self.shard_sizes[unit]

    def master_shard(self, unit: int):
        return self.params.shard(unit) if self.master is None else self.shard_of(self.master, unit)

    # -- what the model calls
    def acquire(self, unit: int, phase: str) -> dict:
        return self.params.acquire(unit, phase)

    def release(self, unit: int, phase: str) -> None:
        self.params.release(unit, phase)

    def grad_views(self, unit: int) -> dict:
        return self.grads.views(unit)

    def unit_done(self, unit: int) -> None:
        if self.grads.every_micro_batch or self._last_micro_batch:
            pending = self.reducer.reduce_scatter(self.grads.full(unit))
            self._pending.append((pending, unit))
            if not self.overlap:
                pending.wait()
        self._progress(wait=False)

    def _progress(self, wait: bool) -> None:
        """Hand every completed reduction's shard to the gradient placement, in issue order."""
        still = []
        for pending, unit in self._pending:
            if wait:
                pending.wait()
            if not still and pending.test():
                self.grads.take(unit, pending.result)
            else:
                still.append((pending, unit))
        self._pending = still

    # -- what the trainer calls
    def zero_grads(self) -> None:
        self.grads.zero_fill()

    def begin_micro_batch(self, last: bool) -> None:
        self._last_micro_batch = last

    def finish(self) -> None:
        self._progress(wait=True)

    def grad_sq_sums(self) -> dict:
        """From the shards: each rank sums its windows, the dp group adds up."""
        local = add_up([{key: squared_sum(self.grads.shard(u), intersect(ranges, *self.window(u)))
                         for key, ranges in norm_ranges(self.geometry).items()} for u in range(len(self.layouts))])
        return {key: self.group.all_reduce_scalar(value) for key, value in sorted(local.items())}

    def reduced_grad_window(self, unit: int):
        return self.geometry, self.window(unit), self.grads.shard(unit)

    def optimizer_segments(self) -> list[Segment]:
        decay = self.geometry.ranges(lambda spec: spec.decay)
        return [Segment(self.master_shard(u), self.grads.shard(u), intersect(decay, *self.window(u)))
                for u in range(len(self.layouts))]

    def after_step(self) -> None:
        if self.master is not None:
            for unit in range(len(self.layouts)):
                self.params.shard(unit)[...] = self.master_shard(unit)  # rounded to the compute dtype
        self.params.publish()

    def checkpoint_layout(self) -> dict:
        """Where this rank's master weights sit in the padded flat geometry (see mpitrain/checkpoint/pieces.py)."""
        units = range(len(self.layouts))
        if self.master is None:
            windows, replicated = self.params.held()
        else:
            windows, replicated = [(*self.window(u), self.master, self.shard_offsets[u]) for u in units], False
        return {"geometry": self.geometry, "param_windows": windows, "params_dp_replicated": replicated,
                "segment_windows": [self.window(u) for u in units], "moments_dp_replicated": False}

    def after_restore(self) -> None:
        """Derive the compute-dtype parameters from the loaded masters; nothing gathered may outlive them."""
        self.after_step()

    def memory(self) -> dict:
        """Bytes of the arrays this state keeps between steps (transient gathers and unit gradients excluded)."""
        master = resident_nbytes(self.master)  # None (the params are the master) or offloaded: 0
        return {"params": self.params.nbytes, "grads": self.grads.nbytes, "master": master}
