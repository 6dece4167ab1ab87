"""Data parallelism: every rank holds the whole model and sums gradients over the data-parallel group.

Gradients are reduced in buckets: contiguous ranges of the flat gradient buffer, formed from the last unit backwards
(the order backward finishes them). During the last micro-batch's backward, a bucket's non-blocking all-reduce starts
as soon as all its units are done, and pending requests are tested after every unit so that MPI makes progress while
the remaining layers compute. `finish()` waits for the rest before the optimizer step.

ZeRO (a later issue) plugs in here with the same four calls, reducing with reduce-scatter instead.
"""
from __future__ import annotations


class BucketedAllReduce:
    def __init__(self, grads, group, bucket_bytes: int, overlap: bool = True):
        self.grads, self.group, self.overlap = grads, group, overlap
        self.buckets: list[tuple[int, int, set[int]]] = []  # (flat start, flat end, unit indices)
        itemsize = grads.data.itemsize
        units: list[int] = []
        for unit in reversed(range(len(grads.layouts))):
            units.append(unit)
            start, end = grads.unit_range(min(units))[0], grads.unit_range(max(units))[1]
            if (end - start) * itemsize >= bucket_bytes or unit == 0:
                self.buckets.append((start, end, set(units)))
                units = []
        self.bucket_of_unit = {u: b for b, (_, _, us) in enumerate(self.buckets) for u in us}
        self._remaining: list[int] = []
        self._handles: list = []
        self._syncing = False

    def begin_micro_batch(self, last: bool) -> None:
        """Only the last micro-batch of a step reduces: earlier ones just accumulate into the same buffer."""
        self._syncing = last and self.group.size > 1
        self._remaining = [len(units) for _, _, units in self.buckets]

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
