"""Where a step's time goes, per rank: every moment of the step is charged to exactly one part.

    forward, backward_input, backward_weight   compute (the pipeline executor's events; backward_weight is the
                                               linears' dW matmuls, timed apart also when they run inside backward)
    comm.<op>.<group>                          exposed communication: the time this rank WAITED on an operation of
                                               that kind (a blocking call, or Handle.wait); a transfer that finished
                                               behind compute costs nothing here
    pipeline_bubble                            waiting on a neighbouring stage (every send and receive of the pp
                                               group, gpt2's small tied-embedding exchange included: on one host the
                                               transfer is short, the wait is the peer's compute)
    optimizer, data, checkpoint                the update (with the gradient norm), fetching micro-batches, and the
                                               checkpoint writes the loop made between steps (they stall the NEXT step)
    other                                      the rest of the step (remainder: Python between the parts)

The accounting is a stack: entering a part charges the time since the last change to the part below it, so nested
parts (a tensor-parallel wait inside a forward) are exclusive and the parts add up to the step exactly. The trainer
opens and closes each step (`start_step` / `finish_step`); between steps only explicitly named parts (checkpoint)
are kept, carried into the next step.

On a GPU the host only queues work: its clock alone would charge each part's kernels wherever the host next blocks.
So with a device backend the breakdown synchronizes the compute stream at every boundary (`synchronize`, handed in
from the backend: `device_synchronize`) and each part is charged the device work queued inside it; numpy runs call
nothing. A wait on a device collective (the compute stream waiting on its event) is then charged to that
collective. The price: at each boundary the device idles while the host queues the next part's first kernel.

A test hook injects a deterministic delay into the waits of one kind, e.g. MPITRAIN_COMM_DELAY="all_reduce.dp=0.05"
(seconds per wait; several kinds separated by commas): the delay is slept inside the wait, so it shows up as that
kind's exposed time.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import numpy as np

from mpitrain.backend import Backend
from mpitrain.comm.latency import parse_seconds

COMPUTE_PARTS = ("forward", "backward_input", "backward_weight")
FIXED_PARTS = COMPUTE_PARTS + ("pipeline_bubble", "optimizer", "data", "checkpoint", "other")
COMM_PREFIX = "comm."
DELAY_ENV = "MPITRAIN_COMM_DELAY"
# Timeline events (mpitrain/parallel/timeline.py) and the part each is charged to; reduce_grads is left to its waits.
EVENT_PARTS = {"forward": "forward", "backward": "backward_input", "backward_input": "backward_input",
               "backward_weight": "backward_weight", "recv_forward": "pipeline_bubble",
               "recv_backward": "pipeline_bubble", "send_forward": "pipeline_bubble",
               "send_backward": "pipeline_bubble"}
# Small control-plane operations (loss, norms, flags, pickled objects) share one kind.
_CONTROL = {"all_reduce_scalar", "all_reduce_bits", "gather_object", "broadcast_object"}
_BETWEEN = "(between steps)"
_POINT_TO_POINT = {"send", "recv", "isend", "irecv"}


def comm_kind(operation) -> str:
    """'all_reduce.dp', 'recv.pp', 'control.world', ...: the operation without its non-blocking 'i', and its group."""
    name = operation.name
    if name in _CONTROL:
        name = "control"
    elif name.startswith("i") and name not in ("isend", "irecv"):
        name = name[1:]  # iall_reduce -> all_reduce
    elif name in ("isend", "irecv"):
        name = name[1:]
    return f"{name}.{operation.group}"


def parse_delays(text: str) -> dict[str, float]:
    """'all_reduce.dp=0.05,all_gather.tp=0.01' -> {kind: seconds}; a malformed entry is one clear line."""
    return parse_seconds(text, DELAY_ENV, "KIND=SECONDS (e.g. all_reduce.dp=0.05)")


def device_synchronize(backend: Backend) -> Callable[[], None] | None:
    """What the breakdown calls at part boundaries: the backend's wait for queued device work, None on numpy."""
    return None if backend.xp is np else backend.synchronize


class Breakdown:
    """One rank's step breakdown. Listens to the rank's ProgressRecord (its waits) and its pipeline Timeline.
    synchronize: called before every clock reading at a boundary (device backends; see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, delays: dict[str, float] | None = None,
                 synchronize: Callable[[], None] | None = None):
        self.clock = clock
        self.synchronize = synchronize
        self.delays = parse_delays(os.environ.get(DELAY_ENV, "")) if delays is None else delays
        self._thread = threading.get_ident()  # waits of other threads (a checkpoint writer) are not this step's
        self._stack = [_BETWEEN]
        self._since = clock()
        self._parts: dict[str, float] = {}
        self._carried: dict[str, float] = {}
        self._origin = self._since
        self._carried_s = self._excluded_s = 0.0
        self.waits: dict[str, int] = {}  # per kind, waits in the current step (tests: delay x waits)
        self.in_step = False

    # -- the stack
    def _charge(self) -> None:
        if self.synchronize is not None:
            self.synchronize()  # the part's queued device work is its own, not the next part's
        now = self.clock()
        part = self._stack[-1]
        if part == _BETWEEN:
            pass
        elif self.in_step:
            self._parts[part] = self._parts.get(part, 0.0) + now - self._since
        else:
            self._carried[part] = self._carried.get(part, 0.0) + now - self._since
        self._since = now

    def _elsewhere(self) -> bool:
        """Called from another thread than the step's: its work (a thread replica's dW, a checkpoint writer's wait)
        runs beside the step's own, which the clock already charges."""
        return threading.get_ident() != self._thread

    def push(self, part: str) -> None:
        if self._elsewhere():
            return
        self._charge()
        self._stack.append(part)

    def pop(self) -> None:
        if self._elsewhere():
            return
        self._charge()
        self._stack.pop()

    def current_part(self) -> str:
        """What the step's thread is doing now: the innermost part that is not a wait on communication (read from
        another thread by the flight recorder, comm/flight.py)."""
        for part in reversed(list(self._stack)):
            if not part.startswith(COMM_PREFIX):
                return part
        return _BETWEEN

    @contextmanager
    def part(self, name: str):
        """Charge the body of the with-block (less any nested part) to `name`."""
        self.push(name)
        try:
            yield
        finally:
            self.pop()

    @contextmanager
    def event(self, kind: str):
        """A pipeline Timeline event of `kind` (compute or a wait on a neighbour), charged as EVENT_PARTS says."""
        part = EVENT_PARTS.get(kind)
        if part is None:
            yield
            return
        with self.part(part):
            yield

    # -- the ProgressRecord's listener interface
    def begin_wait(self, operation) -> None:
        if self._elsewhere():
            return
        top = self._stack[-1]
        if top == "pipeline_bubble" or not self.in_step:
            self._stack.append(top)  # charged to what surrounds it: the bubble, a checkpoint, or no step at all
        elif operation.group == "pp" and operation.name in _POINT_TO_POINT:
            self.push("pipeline_bubble")  # e.g. the executor waiting for its last sends: the peer is still busy
        else:
            kind = comm_kind(operation)
            self.waits[kind] = self.waits.get(kind, 0) + 1
            self.push(COMM_PREFIX + kind)
        delay = self.delays.get(comm_kind(operation), 0.0)
        if delay:
            time.sleep(delay)  # the injected delay (tests): inside the wait, as a slow transfer would be

    def end_wait(self) -> None:
        self.pop()  # nothing from another thread (pop checks, as begin_wait did)

    # -- steps
    def start_step(self) -> float:
        """Open a step now; returns its origin (a clock reading). Checkpoint time since the last step is carried."""
        self._charge()
        self.in_step = True
        self._parts = dict(self._carried)
        self._carried_s = sum(self._carried.values())
        self._excluded_s = 0.0
        self._carried = {}
        self.waits = {}
        self._origin = self._since
        self._stack = ["other"]
        return self._origin

    def finish_step(self) -> dict[str, float]:
        """Close the step; returns {part: seconds} (every FIXED_PARTS key, plus the comm kinds this rank waited on)
        and 'step_s', the step's measured time (carried checkpoint time included)."""
        self._charge()
        self.in_step = False
        self._stack = [_BETWEEN]
        parts = dict.fromkeys(FIXED_PARTS, 0.0)
        parts.update(self._parts)
        parts["step_s"] = self._since - self._origin - self._excluded_s + self._carried_s
        return parts

    @contextmanager
    def excluded(self):
        """Time that belongs to no step (validation): nothing in the block is charged."""
        saved_stack, in_step = self._stack, self.in_step
        self._charge()
        start = self._since
        self._stack, self.in_step = [_BETWEEN], False
        try:
            yield
        finally:
            self._charge()
            self._stack, self.in_step = saved_stack, in_step
            if in_step:
                self._excluded_s += self._since - start


def parts_total(parts: dict) -> float:
    """The sum of the parts (what must equal parts['step_s'])."""
    return sum(v for k, v in parts.items() if k != "step_s")


class RunSummary:
    """One rank's sum of its steps' breakdowns, for the end-of-run summary."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.steps = 0

    def add(self, parts: dict) -> None:
        self.steps += 1
        for key, value in parts.items():
            self.sums[key] = self.sums.get(key, 0.0) + value

    def means(self) -> dict[str, float]:
        return {key: value / self.steps for key, value in self.sums.items()} if self.steps else {}


def exposed_of_group(parts: dict, group: str) -> float:
    """The seconds of a breakdown charged to waits on operations of `group` (every comm.<op>.<group> part), e.g.
    a tp group's gathers and reduce-scatters and, under parallel.tp_overlap, its ring's sends and receives."""
    return sum(value for key, value in parts.items() if key.startswith(COMM_PREFIX) and key.endswith("." + group))


def max_over_ranks(per_rank: Iterable[dict]) -> dict[str, float]:
    """Per part, the largest value over the ranks' dicts (a part missing on a rank counts 0)."""
    result: dict[str, float] = {}
    for parts in per_rank:
        for key, value in parts.items():
            result[key] = max(result.get(key, 0.0), value)
    return result


def ordered_parts(parts: dict) -> list[str]:
    """Display order: compute, communication kinds (sorted), the rest, other last; step_s left out."""
    comm = sorted(k for k in parts if k.startswith(COMM_PREFIX))
    rest = [k for k in FIXED_PARTS if k not in COMPUTE_PARTS and k != "other"]
    return [*COMPUTE_PARTS, *comm, *rest, "other"]


def format_summary(per_rank_means: list[dict], steps: int) -> str:
    """A table: part, mean seconds per step (max over ranks) and its share of the step (max over ranks)."""
    worst = max_over_ranks(per_rank_means)
    step = worst.get("step_s", 0.0) or 1e-30
    lines = [(f"time breakdown: mean over {steps} steps, max over {len(per_rank_means)} rank(s); "
             f"step {1e3 * worst.get('step_s', 0.0):.1f} ms")]
    for key in ordered_parts(worst):
        if key in worst and (worst[key] > 0 or key in COMPUTE_PARTS or key == "other"):
            lines.append(f"  {key:<28} {1e3 * worst[key]:9.2f} ms  {100 * worst[key] / step:5.1f}%")
    return "\n".join(lines)


def gather_step(group, parts: dict, events: list[dict], timeline_path, step: int) -> list[dict] | None:
    """Every rank's breakdown of this step, in rank order, on the group's rank 0 (None elsewhere), which also
    writes the step's pipeline events (Timeline.to_dicts, "rank" made the group rank) to `timeline_path`, replaced
    whole (`mpitrain report` may read it while the run goes on). Collective."""
    gathered = group.gather_object(({k: round(v, 7) for k, v in parts.items()}, events))
    if gathered is None:
        return None
    every = [dict(event, rank=rank) for rank, (_, rank_events) in enumerate(gathered) for event in rank_events]
    partial = f"{timeline_path}.partial"
    with open(partial, "w") as out:
        json.dump({"step": step, "ranks": len(gathered), "events": every}, out)
    os.replace(partial, timeline_path)
    return [rank_parts for rank_parts, _ in gathered]


def gather_summary(group, summary: RunSummary) -> dict | None:
    """The summary's per-part means, max over the group's ranks, on its rank 0 (None elsewhere). Collective."""
    per_rank = group.gather_object(summary.means())
    return max_over_ranks(per_rank) if per_rank is not None else None


def write_run_summary(group, summary: RunSummary, path, say) -> dict | None:
    """Gather every rank's mean breakdown to rank 0, which writes `path` (JSON: mean over steps per rank, and the
    max over ranks) and prints the table. Collective; returns the max over ranks on rank 0."""
    per_rank = group.gather_object(summary.means())
    if per_rank is None or not summary.steps:
        return None
    worst = max_over_ranks(per_rank)
    with open(path, "w") as out:
        json.dump({"steps": summary.steps, "max_over_ranks": worst, "per_rank": per_rank}, out, indent=1)
    say(format_summary(per_rank, summary.steps))
    return worst
