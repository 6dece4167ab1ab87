"""Data parallelism: every rank holds the whole model and sums gradients over the data-parallel group.

`ReplicatedState` is the parameter/gradient state for `parallel.zero = 0` and the reference for the ZeRO states
(`zero.py`), which offer the same methods. The model calls the first four during forward/backward; the trainer calls
the rest around them:

    acquire(unit, phase) -> views   release(unit, phase)   grad_views(unit) -> views   unit_done(unit)
    zero_grads()   begin_micro_batch(last)   finish()   grad_sq_sums()   optimizer_segments()   after_step()

Gradients are reduced in buckets: contiguous ranges of the flat gradient buffer, formed from the last unit backwards
(the order backward finishes them). During the last micro-batch's backward, a bucket's non-blocking all-reduce starts
as soon as all its units are done, and pending requests are tested after every unit so that MPI makes progress while
the remaining layers compute. `finish()` waits for the rest before the optimizer step.
"""
from __future__ import annotations

from mpitrain.optim.adamw import Segment
from mpitrain.state.params import FlatBuffer, initial_unit_flat


def initialise(buffer: FlatBuffer, seed: int, backend) -> None:
    for index, layout in enumerate(buffer.layouts):
        start, end = buffer.unit_range(index)
        buffer.data[start:end] = backend.from_host(initial_unit_flat(layout, seed, end - start), buffer.data.dtype)


def squared_sum(flat, ranges: list[tuple[int, int]]) -> float:
    return float(sum(flat[a:b] @ flat[a:b] for a, b in ranges))


def make_buckets(grads: FlatBuffer, bucket_bytes: int) -> list[tuple[int, int, set[int]]]:
    """(flat start, flat end, units) per bucket, from the last unit backwards, each at least bucket_bytes."""
    buckets, units = [], []
    for unit in reversed(range(len(grads.layouts))):
        units.append(unit)
        start, end = grads.unit_range(min(units))[0], grads.unit_range(max(units))[1]
        if (end - start) * grads.data.itemsize >= bucket_bytes or unit == 0:
            buckets.append((start, end, set(units)))
            units = []
    return buckets


class ReplicatedState:
    """parallel.zero = 0: full parameters and gradients on every rank; gradients summed by bucketed all-reduce.

    `group` is the data-parallel group (None: a single process, e.g. generation)."""

    sharded = False

    def __init__(self, layouts, backend, seed: int | None, group=None, bucket_bytes: int = 4 << 20,
                 overlap: bool = True):
        """seed None: parameters left at zero, for the caller to fill (generation from a checkpoint)."""
        xp, dtype = backend.xp, backend.dtype
        self.group, self.overlap = group, overlap
        self.params = FlatBuffer.allocate(layouts, xp, dtype)
        if seed is not None:
            initialise(self.params, seed, backend)
        self.grads = FlatBuffer.allocate(layouts, xp, dtype)
        self.buckets = make_buckets(self.grads, bucket_bytes)
        self.bucket_of_unit = {u: b for b, (_, _, units) in enumerate(self.buckets) for u in units}
        self._remaining: list[int] = []
        self._handles: list = []
        self._syncing = False

    # -- what the model calls
    def acquire(self, unit: int, phase: str) -> dict:
        return self.params.views[unit]

    def release(self, unit: int, phase: str) -> None:
        pass

    def grad_views(self, unit: int) -> dict:
        return self.grads.views[unit]

    def unit_done(self, unit: int) -> None:
        if not self._syncing:
            return
        bucket = self.bucket_of_unit[unit]
        self._remaining[bucket] -= 1
        if self._remaining[bucket] == 0 and self.overlap:
            start, end, _ = self.buckets[bucket]
            self._handles.append(self.group.iall_reduce(self.grads.data[start:end]))
        for handle in self._handles:  # drive progress of the reductions already in flight
            handle.test()

    # -- what the trainer calls
    def zero_grads(self) -> None:
        self.grads.data.fill(0)

    def begin_micro_batch(self, last: bool) -> None:
        """Only the last micro-batch of a step reduces: earlier ones just accumulate into the same buffer."""
        self._syncing = last and self.group is not None and self.group.size > 1
        self._remaining = [len(units) for _, _, units in self.buckets]

    def finish(self) -> None:
        if not self._syncing:
            return
        if not self.overlap:
            for start, end, _ in self.buckets:
                self.group.all_reduce(self.grads.data[start:end])
        for handle in self._handles:
            handle.wait()
        self._handles = []
        self._syncing = False

    def grad_sq_sums(self) -> tuple[float, float]:
        """Sums of squared gradients of (tensor-parallel-sharded, tensor-parallel-replicated) tensors; every dp rank
        holds all of them after the all-reduce. The caller sums the first over the tp group, the second not."""
        return tuple(squared_sum(self.grads.data, self.grads.ranges(lambda spec, r=replicated: spec.tp_replicated == r))
                     for replicated in (False, True))

    def reduced_grad_window(self, unit: int):
        """(geometry, (start, end) in it, values): the reduced gradient of `unit` this rank holds after finish()."""
        start, end = self.grads.unit_range(unit)
        return self.grads, (start, end), self.grads.data[start:end]

    def optimizer_segments(self) -> list[Segment]:
        return [Segment(self.params.data, self.grads.data, self.params.ranges(lambda spec: spec.decay))]

    def after_step(self) -> None:
        pass

    def checkpoint_layout(self) -> dict:
        """Where this rank's state sits in the flat geometry (see mpitrain/checkpoint/pieces.py)."""
        return {"geometry": self.params, "param_windows": [(0, self.params.size, self.params.data, 0)],
                "params_dp_replicated": True, "segment_windows": [(0, self.params.size)],
                "moments_dp_replicated": True}

    def after_restore(self) -> None:
        """Called after a checkpoint was loaded into the arrays."""

    def memory(self) -> dict:
        """Bytes of the arrays this state keeps between steps."""
        return {"params": int(self.params.data.nbytes), "grads": int(self.grads.data.nbytes)}
