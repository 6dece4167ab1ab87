"""Stragglers: a rank whose compute is persistently slower than the median rank's, named by rank and host.

In a synchronous step every rank waits for the slowest, so wall step times are equal and say nothing about who is
slow. What differs is each rank's compute time: the forward/backward events of its pipeline timeline (waiting on
peers is recorded apart). On each logged step the ranks' compute times are gathered to the logging rank (one small
gather on the logging cadence, not every step); a rank slower than the median by `fault.straggler_factor` on
`fault.straggler_steps` logged steps in a row is reported once, until it recovers.

Limit: under tensor parallelism or ZeRO-3, the forward/backward events include the tp collectives and parameter
all-gathers, so a slow rank slows its group's measured compute too; the detector then sees the group, not the rank.

`slow:rank=R:factor=F` (MPITRAIN_FAULT) makes rank R's step F times as long: after its forward/backward it sleeps
(F - 1) x its measured compute time, and that time counts as its compute, as a slower chip's would.
"""
from __future__ import annotations

import statistics
import time

from mpitrain.parallel.schedule import COMPUTE_OPS
from mpitrain.resilience.faulty_hosts import this_host


def compute_seconds(events: list[dict]) -> float:
    """Seconds of forward/backward compute in one step's timeline events (waits on peers excluded)."""
    return sum(event["end"] - event["start"] for event in events if event["kind"] in COMPUTE_OPS)


def inject_slowdown(faults, step: int, measured: float) -> float:
    """The `slow` fault, if due at `step` (from 1): sleep (factor - 1) x the measured compute; returns the sleep."""
    fault = faults.due("slow", step) if faults else None
    if fault is None or fault.factor <= 1.0:
        return 0.0
    delay = (fault.factor - 1.0) * measured
    time.sleep(delay)
    return delay


class StragglerDetector:
    """Counts, per rank, the logged steps in a row on which its compute time exceeded factor x the median."""

    def __init__(self, factor: float, steps: int):
        self.factor, self.steps = factor, max(1, steps)
        self.streaks: dict[int, int] = {}

    def observe(self, seconds: list[float]) -> list[int]:
        """One logged step's compute time per rank; returns the ranks whose streak has just reached `steps`."""
        median = statistics.median(seconds)
        reached = []
        for rank, value in enumerate(seconds):
            if median > 0 and value > self.factor * median:
                self.streaks[rank] = self.streaks.get(rank, 0) + 1
                if self.streaks[rank] == self.steps:
                    reached.append(rank)
            else:
                self.streaks.pop(rank, None)
        return reached


class StragglerWatch:
    """The collective part: every rank calls `check` on the logged steps (the same steps on every rank); the
    logging rank gets the reports, one dict per straggler, for the console and metrics.jsonl."""

    def __init__(self, world, factor: float, steps: int):
        self.world = world
        self.detector = StragglerDetector(factor, steps) if factor > 0 and world.size > 1 else None
        self.host = this_host()

    def check(self, step: int, seconds: float) -> list[dict]:
        if self.detector is None:
            return []
        gathered = self.world.gather_object((seconds, self.host))
        if gathered is None:
            return []
        times = [value for value, _ in gathered]
        median = statistics.median(times)
        return [{"rank": rank, "host": gathered[rank][1], "compute_s": times[rank], "median_s": median,
                 "slowdown": times[rank] / median, "logged_steps": self.detector.steps, "step": step}
                for rank in self.detector.observe(times)]


def format_report(report: dict, factor: float) -> str:
    return (f"straggler: rank {report['rank']} on {report['host']} computed {report['slowdown']:.1f}x the median "
            f"rank's time ({report['compute_s']:.3f} s vs {report['median_s']:.3f} s) on {report['logged_steps']} "
            f"logged steps in a row (fault.straggler_factor = {factor:g}), at step {report['step']}")
