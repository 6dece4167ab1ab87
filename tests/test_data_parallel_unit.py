"""Bucketing and overlap of the data-parallel gradient all-reduce, with a fake group (no MPI)."""
from __future__ import annotations

from mpitrain.backend import make_backend
from mpitrain.state.params import ParamSpec, UnitLayout
from mpitrain.state.replicated import ReplicatedState


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


def make_state(unit_sizes, bucket_elements, log):
    layouts = [UnitLayout(f"u{i}", [ParamSpec("w", (n,), "zeros")]) for i, n in enumerate(unit_sizes)]
    return ReplicatedState(layouts, make_backend("cpu", "float64"), 0, RecordingGroup(log), bucket_elements * 8)


def test_buckets_cover_the_buffer_in_backward_order():
    state = make_state([10, 20, 20, 20, 5], 30, [])
    ranges = [(start, end) for start, end, _ in state.buckets]
    assert ranges == [(30, 75), (0, 30)]  # last units first; every element in exactly one bucket
    assert sorted(u for _, _, units in state.buckets for u in units) == [0, 1, 2, 3, 4]


def test_reduction_starts_during_backward_only_on_the_last_micro_batch():
    log = []
    state = make_state([10, 20, 20, 20, 5], 20, log)
    state.begin_micro_batch(last=False)
    for unit in reversed(range(5)):
        state.unit_done(unit)
    assert log == []  # accumulation micro-batch: nothing is reduced
    state.begin_micro_batch(last=True)
    for unit in reversed(range(5)):
        state.unit_done(unit)
        log.append(("unit done", unit))
    first_start = log.index(("start", 25))
    assert first_start < log.index(("unit done", 2))  # communication began while earlier units still computed
    assert ("test",) in log[first_start:]  # and was driven forward between units
    state.finish()
    assert log.count(("wait",)) == len(state.buckets)
