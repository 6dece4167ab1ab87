"""Bucketing and overlap of the data-parallel gradient all-reduce, with a fake group (no MPI)."""
from __future__ import annotations

import numpy as np

from mpitrain.model.params import FlatBuffer, ParamSpec, UnitLayout
from mpitrain.parallel.data import BucketedAllReduce


class RecordingGroup:
    size = 2

    def __init__(self, log):
        self.log = log

    def iall_reduce(self, buf):
        self.log.append(("start", buf.size))
        log = self.log

        class Handle:
            def test(self):
                log.append(("test",))
                return False

            def wait(self):
                log.append(("wait",))
        return Handle()


def make_grads(unit_sizes):
    layouts = [UnitLayout(f"u{i}", [ParamSpec("w", (n,), "zeros")]) for i, n in enumerate(unit_sizes)]
    return FlatBuffer.allocate(layouts, np, np.float64)


def test_buckets_cover_the_buffer_in_backward_order():
    grads = make_grads([10, 20, 20, 20, 5])
    sync = BucketedAllReduce(grads, RecordingGroup([]), bucket_bytes=30 * 8)
    ranges = [(start, end) for start, end, _ in sync.buckets]
    assert ranges == [(30, 75), (0, 30)]  # last units first; every element in exactly one bucket
    assert sorted(u for _, _, units in sync.buckets for u in units) == [0, 1, 2, 3, 4]


def test_reduction_starts_during_backward_only_on_the_last_micro_batch():
    log = []
    grads = make_grads([10, 20, 20, 20, 5])
    sync = BucketedAllReduce(grads, RecordingGroup(log), bucket_bytes=20 * 8)
    sync.begin_micro_batch(last=False)
    for unit in reversed(range(5)):
        sync.unit_done(unit)
    assert log == []  # accumulation micro-batch: nothing is reduced
    sync.begin_micro_batch(last=True)
    for unit in reversed(range(5)):
        sync.unit_done(unit)
        log.append(("unit done", unit))
    first_start = log.index(("start", 25))
    assert first_start < log.index(("unit done", 2))  # communication began while earlier units still computed
    assert ("test",) in log[first_start:]  # and was driven forward between units
    sync.finish()
    assert log.count(("wait",)) == len(sync.buckets)
