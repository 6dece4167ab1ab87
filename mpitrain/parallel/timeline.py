"""Pipeline timelines: draw them (text or PNG) and record them in real runs.

A timeline is, per pipeline rank, a list of Event(start, end, instruction) (see mpitrain.parallel.schedule): what
`simulate` returns for a schedule, and what `merge_events` rebuilds from the events ranks recorded during a real step,
so both are drawn and measured (`bubble_fraction`) the same way.

Recording in a real run (no communication here; the executor gathers the dicts, e.g. with comm.gather):

    timeline = Timeline(rank=pp_rank)
    timeline.reset()                                  # right after a barrier: the ranks' common time origin
    with timeline.record("recv_forward", micro, chunk):   # waiting on a peer
        ...
    with timeline.record("forward", micro, chunk):        # compute
        ...
    gathered = comm.gather(timeline.to_dicts(), root=0)   # list of lists of plain dicts
    merged = merge_events(gathered); print(render_text(merged)); bubble_fraction(merged)

Times are relative to each rank's `reset()`; ranks on one node share perf_counter's clock, and after a barrier the
origins agree to within the barrier's skew (microseconds), far below a forward's time.

Measured times depend on the machine's load; the ORDER in which a rank recorded its events does not. `replay` turns
the recorded order back into a schedule and times it with the simulator's unit costs (F 1, B 2; a split backward's B
and W 1 each), which gives the bubble the executor's real instruction order implies, the same on an idle or a busy
machine: what tests check. The measured bubble is for benchmarks (benchmarks/bench_pipeline.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager

from mpitrain.errors import MpitrainError
from mpitrain.parallel.schedule import (
    COMPUTE_OPS,
    OPS,
    Event,
    Instruction,
    PerRankEvents,
    Schedule,
    rank_and_chunk,
    stage_of,
)
from mpitrain.parallel.schedule_analysis import bubble_fraction, simulate

__all__ = ["Timeline", "bubble_fraction", "merge_events", "recorded_program", "render_png", "render_text", "replay"]

LETTERS = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W"}
LEGEND = ("F forward, B backward (input gradient only where W appears), W weight gradient, each followed by its "
          "micro-batch;\nlowercase: odd model chunk (interleaved, zbv, dualpipev); '.' idle or waiting on a peer")
COLORS = {"forward": "#4c72b0", "backward": "#55a868", "backward_input": "#55a868", "backward_weight": "#c44e52"}


class Timeline:
    """The events one rank records during a real step: (kind, micro, chunk, start, end), kind an instruction op
    (compute: forward, backward, backward_input, backward_weight; waiting on a peer: recv_*/send_*)."""

    def __init__(self, rank: int, clock: Callable[[], float] = time.perf_counter, breakdown=None):
        self.rank = rank
        self.clock = clock
        self.origin = clock()
        self.events: list[dict] = []
        self.breakdown = breakdown  # profile/breakdown.py's Breakdown: the same events charged to the step

    def reset(self) -> None:
        """Forget the events and start the clock at 0 now (call it right after a barrier)."""
        self.origin = self.clock()
        self.events = []

    def add(self, kind: str, micro: int | None, chunk: int, t_start: float, t_end: float) -> None:
        """Record an event given its clock() readings at start and end."""
        if kind not in OPS:
            raise ValueError(f"unknown timeline event kind {kind!r}; one of {', '.join(OPS)}")
        self.events.append({"rank": self.rank, "kind": kind, "micro": micro, "chunk": chunk,
                            "start": t_start - self.origin, "end": t_end - self.origin})

    @contextmanager
    def record(self, kind: str, micro: int | None = None, chunk: int = 0):
        """Time the body of the with-block as one event."""
        start = self.clock()
        try:
            if self.breakdown is None:
                yield
            else:
                with self.breakdown.event(kind):
                    yield
        finally:
            self.add(kind, micro, chunk, start, self.clock())

    def to_dicts(self) -> list[dict]:
        """The events as plain dicts (picklable, JSON-able) for gathering across ranks."""
        return [dict(event) for event in self.events]


def merge_events(event_lists: Iterable[Iterable[dict]]) -> PerRankEvents:
    """Rebuild a per-rank timeline (lists of Event, by start time) from the dicts of every rank, in any grouping."""
    by_rank: dict[int, list[Event]] = {}
    for events in event_lists:
        for event in events:
            instruction = Instruction(event["kind"], event.get("micro"), event.get("chunk", 0) or 0)
            by_rank.setdefault(int(event["rank"]), []).append(Event(event["start"], event["end"], instruction))
    n_ranks = max(by_rank, default=-1) + 1
    return [sorted(by_rank.get(rank, []), key=lambda e: (e.start, e.end)) for rank in range(n_ranks)]


# The neighbouring stage each kind of transfer talks to: the one before (-1) or after (+1) the instruction's own.
_STAGE_STEP = {"recv_forward": -1, "send_backward": -1, "send_forward": +1, "recv_backward": +1}


def recorded_program(event_lists: Iterable[Iterable[dict]], p: int, placement: str = "loop") -> Schedule:
    """Per pipeline rank, the instructions it recorded, in the order it recorded them (not sorted by time): the
    schedule the executor really ran. Peers follow from the rank, the chunk and the placement (schedule.placement_of:
    "v" for zbv and dualpipev); the optimizer step, which runs in the trainer after the executor returns, is appended
    after a recorded reduce_grads."""
    program: Schedule = [[] for _ in range(p)]
    for events in event_lists:
        for event in events:
            rank, kind, chunk = int(event["rank"]), event["kind"], event.get("chunk", 0) or 0
            step = _STAGE_STEP.get(kind)
            peer = None if step is None else \
                rank_and_chunk(stage_of(rank, chunk, p, placement) + step, p, placement)[0]
            program[rank].append(Instruction(kind, event.get("micro"), chunk, peer))
    for steps in program:
        if steps and steps[-1].op == "reduce_grads":
            steps.append(Instruction("optimizer_step"))
    return program


def replay(event_lists: Iterable[Iterable[dict]], p: int, placement: str = "loop",
           **unit_costs: float) -> PerRankEvents:
    """The recorded instruction order of every rank, timed by the simulator (unit costs by default; keyword
    arguments as for schedule.simulate): a timeline that does not depend on how busy the machine was."""
    return simulate(recorded_program(event_lists, p, placement), placement=placement, **unit_costs)


def _compute_span(timeline: PerRankEvents) -> tuple[float, float]:
    compute = [e for events in timeline for e in events if e.instruction.op in COMPUTE_OPS]
    if not compute:
        return 0.0, 0.0
    return min(e.start for e in compute), max(e.end for e in compute)


def _label(instruction: Instruction) -> str:
    letter = LETTERS[instruction.op]
    return letter.lower() if instruction.chunk % 2 else letter


def _columns(timeline: PerRankEvents, start: float, makespan: float, width: int) -> tuple[float, int]:
    """(columns per unit of time, row length). When every compute event starts and ends on a multiple of the
    shortest one (simulated timelines), that quantum gets a whole number of columns so equal events look equal."""
    if makespan <= 0:
        return 0.0, width
    durations = [e.end - e.start for events in timeline for e in events
                 if e.instruction.op in COMPUTE_OPS and e.end > e.start]
    quantum = min(durations)
    on_grid = all(abs(t / quantum - round(t / quantum)) < 1e-9 for events in timeline for e in events
                  if e.instruction.op in COMPUTE_OPS for t in (e.start - start, e.end - start))
    if not on_grid:
        return width / makespan, width
    units = round(makespan / quantum)
    per_quantum = max(1, width // units)
    return per_quantum / quantum, units * per_quantum


def render_text(timeline: PerRankEvents, width: int = 100) -> str:
    """One row per rank, about `width` characters for the makespan: each compute event is its letter and
    micro-batch number (just the letter where it is too narrow), padded with blanks; '.' is idle time."""
    start, end = _compute_span(timeline)
    makespan = end - start
    scale, width = _columns(timeline, start, makespan, width)
    label_width = len(f"rank {len(timeline) - 1}")
    rows = []
    for rank, events in enumerate(timeline):
        row = ["."] * width
        for event in events:
            if event.instruction.op not in COMPUTE_OPS:
                continue
            first = min(width - 1, round((event.start - start) * scale))
            last = max(first + 1, min(width, round((event.end - start) * scale)))
            letter = _label(event.instruction)
            text = f"{letter}{event.instruction.micro}" if event.instruction.micro is not None else letter
            if len(text) > last - first:
                text = letter
            row[first:last] = list(text.ljust(last - first))
        rows.append(f"{f'rank {rank}':<{label_width}} |{''.join(row)}|")
    rows.append(LEGEND)
    rows.append(f"makespan {makespan:.4g}, bubble fraction {bubble_fraction(timeline):.4f} "
                f"(idle / (ranks x makespan))")
    return "\n".join(rows)


def render_png(timeline: PerRankEvents, path, title: str = "") -> None:
    """Draw the timeline as a Gantt chart into `path` (needs matplotlib: pip install 'mpitrain[plot]')."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise MpitrainError("drawing a PNG needs matplotlib: pip install 'mpitrain[plot]'") from None
    start, end = _compute_span(timeline)
    makespan = max(end - start, 1e-12)
    n_ranks = len(timeline)
    figure = Figure(figsize=(12, 1.0 + 0.45 * n_ranks))
    axes = figure.subplots()
    n_events = max((sum(e.instruction.op in COMPUTE_OPS for e in events) for events in timeline), default=0)
    for rank, events in enumerate(timeline):
        for event in events:
            op = event.instruction.op
            if op not in COMPUTE_OPS:
                continue
            axes.barh(rank, event.end - event.start, left=event.start - start, height=0.8, color=COLORS[op],
                      alpha=0.55 if event.instruction.chunk % 2 else 1.0, edgecolor="black", linewidth=0.4)
            if n_events <= 80 and event.instruction.micro is not None:
                axes.text((event.start + event.end) / 2 - start, rank, str(event.instruction.micro),
                          ha="center", va="center", fontsize=7, color="white")
    axes.set_yticks(range(n_ranks), [f"rank {rank}" for rank in range(n_ranks)])
    axes.invert_yaxis()
    axes.set_xlim(0, makespan)
    axes.set_xlabel("time")
    axes.legend(handles=[Patch(color=COLORS["forward"], label="forward"),
                         Patch(color=COLORS["backward"], label="backward (split: input grad)"),
                         Patch(color=COLORS["backward_weight"], label="weight grad")],
                loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, fontsize=8, frameon=False)
    axes.set_title(f"{title}  bubble {bubble_fraction(timeline):.3f}".strip(), loc="left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
