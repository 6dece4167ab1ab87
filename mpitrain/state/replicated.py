"""Data parallelism: every rank holds the whole model and sums gradients over the data-parallel group.

`ReplicatedState` is the parameter/gradient state for `parallel.zero = 0`; it and the ZeRO states (`zero.py`)
implement the interface declared in `strategy.py`. With a low-precision compute dtype (bfloat16, float16) it keeps a
full fp32 master copy that the optimizer updates and the compute-dtype parameters are rounded from after each step:
2 + 2 + 4 (+ 8 for Adam's moments) = 16 bytes per parameter.

Gradients are reduced in buckets: contiguous ranges of the flat gradient buffer, formed from the last unit backwards
(the order backward finishes them). During the last micro-batch's backward, a bucket's non-blocking all-reduce starts
as soon as all its units are done, and pending requests are tested after every unit so that MPI makes progress while
the remaining layers compute. `finish()` waits for the rest before the optimizer step.
"""
from __future__ import annotations

from functools import partial

from mpitrain.state.frozen import frozen_nbytes, hold_frozen, with_frozen
from mpitrain.state.offload import OnDevice
from mpitrain.state.params import FlatBuffer, initialise, intersect
from mpitrain.state.reduce import GradReducer
from mpitrain.state.strategy import Segment, ShardLayout, StateStrategy, norm_ranges, squared_sum


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


def split_by_group(grads: FlatBuffer, start: int, end: int, main, others: dict) -> list:
    """[start, end) of the flat gradient cut into (a, b, reducer) pieces: the tensors reduced over another group
    (others[spec.reduce_over]) apart, the rest by `main`."""
    cuts = [(a + start, b + start, others[name]) for name in others
            for a, b in intersect(grads.ranges(lambda spec, n=name: spec.reduce_over == n), start, end)]
    pieces, position = [], start
    for a, b, reducer in sorted(cuts, key=lambda cut: cut[0]):
        if a > position:
            pieces.append((position, a, main))
        pieces.append((a, b, reducer))
        position = b
    return pieces + ([(position, end, main)] if position < end else [])


class ReplicatedState(StateStrategy):
    """parallel.zero = 0: full parameters and gradients on every rank; gradients summed by bucketed all-reduce.

    `group` is the data-parallel group (None: a single process, e.g. generation). Frozen tensors in `layouts` are
    held whole beside the trainable ones (state/frozen.py)."""

    sharded = False
    reduces_every_micro_batch = False  # the full gradient accumulates; the last micro-batch all-reduces it

    def __init__(self, layouts, backend, seed: int | None, group=None, bucket_bytes: int = 4 << 20,
                 overlap: bool = True, grad_reduce: str = "float32", placement=None, other_groups=None):
        """seed None: parameters left at zero, for the caller to fill (generation from a checkpoint).
        placement: where a separate master copy lives (mpitrain/state/offload.py; None: the device).
        other_groups: {ParamSpec.reduce_over: group} for tensors not reduced over `group` (experts: expert_dp)."""
        xp, dtype = backend.xp, backend.dtype
        self.group, self.overlap = group, overlap
        # experts on their own mesh can be reduced over expert_dp while dp is one rank (tp 2 with whole experts)
        self.reduces = group is not None and max([group.size, *(g.size for g in (other_groups or {}).values())]) > 1
        layouts, self.frozen = hold_frozen(layouts, backend, seed)
        off_device = placement is not None and backend.mixed  # parameters that are their own master stay
        self.placement = placement if off_device else OnDevice(xp)
        self.master = FlatBuffer.allocate(layouts, xp, backend.optimizer_dtype,
                                          zeros=partial(placement.zeros, "master") if off_device else None)
        if seed is not None:
            initialise(self.master, seed, backend)
        self.params = self.master  # one copy when the compute dtype is the optimizer's
        if backend.mixed:
            self.params = FlatBuffer.allocate(layouts, xp, dtype)
            if seed is not None:  # else zero like the master until a checkpoint fills both
                self.after_restore()
        self.unit_views = with_frozen(self.params.views, self.frozen)
        self.grads = FlatBuffer.allocate(layouts, xp, dtype)
        self.reducer = GradReducer(group, dtype, grad_reduce) if group is not None else None
        self.buckets = make_buckets(self.grads, bucket_bytes)
        self.bucket_of_unit = {u: b for b, (_, _, units) in enumerate(self.buckets) for u in units}
        others = {name: GradReducer(g, dtype, grad_reduce) for name, g in (other_groups or {}).items()}
        self.bucket_pieces = [split_by_group(self.grads, start, end, self.reducer, others)
                              for start, end, _ in self.buckets]
        self._remaining: list[int] = []
        self._pending: list = []
        self._syncing = False

    # -- what the model calls
    def acquire(self, unit: int, phase: str) -> dict:
        return self.unit_views[unit]

    def release(self, unit: int, phase: str) -> None:
        pass

    def frozen_changed(self, unit: int) -> None:
        pass  # the views are the frozen tensors themselves

    def grad_views(self, unit: int) -> dict:
        return self.grads.views[unit]

    def unit_done(self, unit: int) -> None:
        if not self._syncing:
            return
        bucket = self.bucket_of_unit[unit]
        self._remaining[bucket] -= 1
        if self._remaining[bucket] == 0 and self.overlap:
            self._pending += [reducer.all_reduce(self.grads.data[a:b]) for a, b, reducer in self.bucket_pieces[bucket]]
        for pending in self._pending:  # drive progress of the reductions already in flight
            pending.test()

    # -- what the trainer calls
    def zero_grads(self) -> None:
        self.grads.data.fill(0)

    def begin_micro_batch(self, last: bool) -> None:
        """Only the last micro-batch of a step reduces: earlier ones just accumulate into the same buffer."""
        self._syncing = last and self.reduces
        self._remaining = [len(units) for _, _, units in self.buckets]

    def finish(self) -> None:
        if not self._syncing:
            return
        if not self.overlap:
            for pieces in self.bucket_pieces:
                for a, b, reducer in pieces:
                    reducer.all_reduce(self.grads.data[a:b]).wait()
        for pending in self._pending:
            pending.wait()
        self._pending = []
        self._syncing = False

    def grad_sq_sums(self) -> dict:
        """Every dp rank holds all reduced gradients: the sums are local."""
        return {key: squared_sum(self.grads.data, ranges) for key, ranges in norm_ranges(self.grads).items()}

    def reduced_grad_window(self, unit: int):
        start, end = self.grads.unit_range(unit)
        return self.grads, (start, end), self.grads.data[start:end]

    def optimizer_segments(self) -> list[Segment]:
        return [Segment(self.master.data, self.grads.data, self.master.ranges(lambda spec: spec.decay))]

    def after_step(self) -> None:
        if self.params is not self.master:
            self.params.data[...] = self.master.data  # rounded to the compute dtype

    def checkpoint_layout(self) -> ShardLayout:
        return ShardLayout(self.master, [(0, self.master.size)], [(0, self.master.size, self.master.data, 0)],
                           frozen=self.frozen)

    def after_restore(self) -> None:
        self.after_step()

    def memory(self) -> dict:
        master = 0 if self.params is self.master else self.placement.resident_nbytes(self.master.data)  # off device: 0
        params = int(self.params.data.nbytes) + frozen_nbytes(self.frozen)
        return {"params": params, "grads": int(self.grads.data.nbytes), "master": master}
