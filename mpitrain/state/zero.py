"""ZeRO-1/2/3 (FSDP): shard optimizer state, then gradients, then parameters across the data-parallel group.

Every unit's flat range is padded to a multiple of the group size N and cut into N equal shards; rank r owns shard r
of every unit (so any parameter count works, and one unit is one all-gather / reduce-scatter). What each stage keeps
between steps, per rank, with Psi parameters in the compute dtype (on CPU the fp32/fp64 parameters are their own
master copy):

    stage 1: full parameters, full gradients,  shard of gradients, shard of Adam moments
    stage 2: full parameters,                  shard of gradients, shard of Adam moments
             (a unit's full gradient lives only from its backward until its reduce-scatter is issued)
    stage 3:                                   shard of parameters, gradients and moments: everything / N
             (a unit's full parameters are all-gathered just before its forward, freed after it, gathered again
             for its backward; the next unit's gather is prefetched while the current one computes)

Communication per step, ring algorithms: stages 1 and 2 reduce-scatter gradients and all-gather the updated
parameters: 2(N-1)/N Psi, the same as plain data parallelism's all-reduce. Stage 3 gathers twice and reduce-scatters
once: 3(N-1)/N Psi, or 2(N-1)/N Psi with reshard_after_forward = false (parameters kept from forward to backward).
Stages 2 and 3 reduce-scatter every micro-batch (their full gradients are gone by the next one); stage 1 once a step.
"""
from __future__ import annotations

import numpy as np

from mpitrain.optim.adamw import Segment
from mpitrain.state.params import FlatBuffer, initial_unit_flat, intersect
from mpitrain.state.replicated import initialise, squared_sum


class ZeroState:
    sharded = True

    def __init__(self, layouts, backend, seed: int, group, stage: int, overlap: bool = True,
                 reshard_after_forward: bool = True):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        xp, dtype = backend.xp, backend.dtype
        self.layouts, self.backend, self.group, self.stage = layouts, backend, group, stage
        self.overlap, self.reshard_after_forward = overlap, reshard_after_forward
        n, r = group.size, group.rank
        self.geometry = FlatBuffer.geometry(layouts, align=n)  # unit ranges padded to multiples of n
        self.shard_sizes = [(self.geometry.unit_range(u)[1] - self.geometry.unit_range(u)[0]) // n
                            for u in range(len(layouts))]
        self.shard_offsets = np.cumsum([0] + self.shard_sizes).tolist()
        self.grad_shard = xp.zeros(self.shard_offsets[-1], dtype=dtype)
        if stage < 3:
            self.params = FlatBuffer.allocate(layouts, xp, dtype, align=n)
            initialise(self.params, seed, backend)
        else:
            self.param_shard = xp.zeros(self.shard_offsets[-1], dtype=dtype)
            for u, layout in enumerate(layouts):
                size = self.shard_sizes[u]
                full = initial_unit_flat(layout, seed, size * n)
                self._shard(self.param_shard, u)[...] = backend.from_host(full[r * size:(r + 1) * size], dtype)
            self.gathered: dict[int, list] = {}  # unit -> [single-unit FlatBuffer, pending handle or None]
        self.full_grads = FlatBuffer.allocate(layouts, xp, dtype, align=n) if stage == 1 else None
        self.unit_grads: dict[int, FlatBuffer] = {}  # stages 2, 3: full gradients of units in backward now
        self._pending: list = []  # (handle, received shard or None, unit)
        self._last_micro_batch = False

    # -- geometry
    def _shard(self, flat_shards, unit: int):
        return flat_shards[self.shard_offsets[unit]:self.shard_offsets[unit + 1]]

    def _window(self, unit: int) -> tuple[int, int]:
        """This rank's shard of `unit` in the coordinates of the padded full flat buffer."""
        start = self.geometry.unit_range(unit)[0] + self.group.rank * self.shard_sizes[unit]
        return start, start + self.shard_sizes[unit]

    def _param_shard(self, unit: int):
        if self.stage < 3:
            return self.params.data[slice(*self._window(unit))]
        return self._shard(self.param_shard, unit)

    # -- parameters: what the model calls
    def _start_gather(self, unit: int) -> None:
        buffer = FlatBuffer.allocate([self.layouts[unit]], self.backend.xp, self.backend.dtype, align=self.group.size)
        self.gathered[unit] = [buffer, self.group.iall_gather(self._param_shard(unit), buffer.data)]

    def acquire(self, unit: int, phase: str) -> dict:
        if self.stage < 3:
            return self.params.views[unit]
        if unit not in self.gathered:
            self._start_gather(unit)
        entry = self.gathered[unit]
        if entry[1] is not None:
            entry[1].wait()
            entry[1] = None
        upcoming = unit + 1 if phase == "forward" else unit - 1  # prefetch: overlap the next gather with compute
        if 0 <= upcoming < len(self.layouts) and upcoming not in self.gathered:
            self._start_gather(upcoming)
        return entry[0].views[0]

    def release(self, unit: int, phase: str) -> None:
        if self.stage < 3 or (phase == "forward" and not self.reshard_after_forward):
            return
        self.gathered.pop(unit, None)  # free the full parameters: only the shard stays

    # -- gradients
    def grad_views(self, unit: int) -> dict:
        if self.stage == 1:
            return self.full_grads.views[unit]
        if unit not in self.unit_grads:
            self.unit_grads[unit] = FlatBuffer.allocate([self.layouts[unit]], self.backend.xp, self.backend.dtype,
                                                        align=self.group.size)
        return self.unit_grads[unit].views[0]

    def unit_done(self, unit: int) -> None:
        if self.stage == 1:
            if self._last_micro_batch:  # accumulated locally; one reduce-scatter per step, straight into the shard
                send = self.full_grads.data[slice(*self.geometry.unit_range(unit))]
                self._reduce_scatter(send, self._shard(self.grad_shard, unit), None, unit)
        else:
            full = self.unit_grads.pop(unit)  # freed once its reduce-scatter completes
            self._reduce_scatter(full.data, self.backend.xp.empty(self.shard_sizes[unit], full.data.dtype), full, unit)
        self._progress(wait=False)

    def _reduce_scatter(self, send, recv, keep_alive, unit: int) -> None:
        if self.overlap:
            self._pending.append((self.group.ireduce_scatter(send, recv), recv, keep_alive, unit))
        else:
            self.group.reduce_scatter(send, recv)
            self._accumulate(recv, keep_alive, unit)

    def _accumulate(self, received, keep_alive, unit: int) -> None:
        if keep_alive is not None:  # stages 2, 3: add this micro-batch's reduced shard
            self._shard(self.grad_shard, unit)[...] += received

    def _progress(self, wait: bool) -> None:
        still = []
        for handle, received, keep_alive, unit in self._pending:
            if wait:
                handle.wait()
            if handle.done or handle.test():
                self._accumulate(received, keep_alive, unit)
            else:
                still.append((handle, received, keep_alive, unit))
        self._pending = still

    # -- what the trainer calls
    def zero_grads(self) -> None:
        self.grad_shard.fill(0)
        if self.full_grads is not None:
            self.full_grads.data.fill(0)

    def begin_micro_batch(self, last: bool) -> None:
        self._last_micro_batch = last

    def finish(self) -> None:
        self._progress(wait=True)

    def grad_sq_sums(self) -> tuple[float, float]:
        """Like ReplicatedState.grad_sq_sums, from the shards: each rank sums its windows, the dp group adds up."""
        sums = []
        for replicated in (False, True):
            ranges = self.geometry.ranges(lambda spec, r=replicated: spec.tp_replicated == r)
            local = sum(squared_sum(self._shard(self.grad_shard, u), intersect(ranges, *self._window(u)))
                        for u in range(len(self.layouts)))
            sums.append(self.group.all_reduce_scalar(local))
        return tuple(sums)

    def reduced_grad_window(self, unit: int):
        """(geometry, (start, end) in it, values): this rank's reduced shard of `unit`'s gradient after finish()."""
        return self.geometry, self._window(unit), self._shard(self.grad_shard, unit)

    def optimizer_segments(self) -> list[Segment]:
        decay = self.geometry.ranges(lambda spec: spec.decay)
        return [Segment(self._param_shard(u), self._shard(self.grad_shard, u), intersect(decay, *self._window(u)))
                for u in range(len(self.layouts))]

    def after_step(self) -> None:
        """Stages 1, 2: all-gather the updated shards into the full parameters. Stage 3: nothing is gathered now."""
        if self.stage == 3:
            self.gathered.clear()
            return
        handles = []
        for unit in range(len(self.layouts)):
            own = self._param_shard(unit).copy()  # MPI forbids the send buffer to alias the receive buffer
            handles.append(self.group.iall_gather(own, self.params.data[slice(*self.geometry.unit_range(unit))]))
        for handle in handles:
            handle.wait()

    def checkpoint_layout(self) -> dict:
        """Where this rank's state sits in the padded flat geometry (see mpitrain/checkpoint/pieces.py)."""
        units = range(len(self.layouts))
        if self.stage < 3:
            param_windows = [(0, self.geometry.size, self.params.data, 0)]
        else:
            param_windows = [(*self._window(u), self.param_shard, self.shard_offsets[u]) for u in units]
        return {"geometry": self.geometry, "param_windows": param_windows, "params_dp_replicated": self.stage < 3,
                "segment_windows": [self._window(u) for u in units], "moments_dp_replicated": False}

    def after_restore(self) -> None:
        """Called after a checkpoint was loaded into the arrays: nothing gathered may outlive it."""
        if self.stage == 3:
            self.gathered.clear()

    def memory(self) -> dict:
        """Bytes of the arrays this state keeps between steps (transient gathers and unit gradients excluded)."""
        params = self.params.data if self.stage < 3 else self.param_shard
        grads = int(self.grad_shard.nbytes) + (int(self.full_grads.data.nbytes) if self.full_grads else 0)
        return {"params": int(params.nbytes), "grads": grads}
