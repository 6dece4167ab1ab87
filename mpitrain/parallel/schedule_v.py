"""The V-shaped pipeline schedules: two model chunks per rank, chunk 0 of rank r is stage r and chunk 1 is stage
2p-1-r, so rank 0 holds the embedding and the head and the last rank turns the micro-batch around in memory. Both
split backwards into B (input gradient) and W (weight gradients), as zb1p does: zbv all of them, dualpipev those
whose W fills an idle step.

  zbv        Zero Bubble ZB-V (Qi et al. 2024): a list scheduling with unit costs that fills every rank's idle time
             with W's, at most 2p chunks holding saved activations (1F1B's p micro-batches)
  dualpipev  DeepSeek's DualPipe folded onto p ranks (DualPipeV, as torchtitan's ScheduleDualPipeV): eight phases
             whose steady state runs "overlapped pairs", one micro-batch's forward chunk beside another's backward
             chunk, so that one's messages travel while the other computes

An overlapped pair is written as its two halves' receives, the forward, the forward's send, the backward and the
backward's send: both inputs are in before the pair starts, and the forward's output is on its way (Isend) while the
backward runs. `dualpipev_pairs` lists the pairs; schedule_analysis.overlap_violations checks an instruction list
(or the order a real run recorded) keeps them so.
"""
from __future__ import annotations

from mpitrain.parallel.instructions import (
    Instruction,
    ScheduleError,
    backward_steps,
    check_schedule_args,
    finish_steps,
    forward_steps,
    stage_of,
)

Schedule = list[list[Instruction]]
Computation = tuple[str, int, int]  # (op, micro, chunk)


def zbv(p: int, m: int) -> Schedule:
    """Zero Bubble ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): two chunks per rank in a V
    (chunk 0 of rank r is stage r, chunk 1 is stage 2p-1-r), backward split into B and W as in zb1p.

    The order comes from list scheduling with unit costs (F = B = W = 1 per chunk): at every time step each rank
    runs a B whose dy is there (chunk 0 first), else a F whose input is there (chunk 1 first: it brings a micro-batch
    closer to its loss) unless 2p+2 chunks are held from their F to their W, else its oldest pending W. The cap
    counts until W, not B: else B's and F's would push every W to the end of the step and the deferred work would
    grow with m. Saved activations (F to B) still never exceed 2p chunks (1f1b's memory, p whole micro-batches; the
    tests check it): the two chunks above 2p only wait for their W, holding x and dy of each matmul. With a cap of
    2p, ranks of p >= 5 idle a step or more waiting for a W to free a slot. Per chunk, F's, B's and W's go in
    micro-batch order, so every channel stays FIFO. For m >= 2p every rank idles only its p-1 steps of fill: bubble
    (p-1)/(6m+p-1), the bound (bubble_formula; tests check it for p <= 8); smaller m lose a few steps more
    (zbv_makespan says how many)."""
    check_schedule_args("zbv", p, m, 2)
    schedule = []
    for rank, order in enumerate(_zbv_list_schedule(p, m)[0]):
        steps = []
        for op, micro, chunk in order:
            if op == "forward":
                steps += forward_steps(rank, micro, p, 2, chunk, placement="v")
            elif op == "backward_input":
                steps += backward_steps(rank, micro, p, 2, chunk, op, placement="v")
            else:
                steps.append(Instruction(op, micro, chunk))
        schedule.append(steps + finish_steps())
    return schedule


def zbv_makespan(p: int, m: int) -> int:
    """The steps zbv's list scheduling takes with unit costs (F = B = W = 1 per chunk): 6m of work on every rank,
    the rest idle. The exact length of the schedule as built, for any (p, m)."""
    check_schedule_args("zbv", p, m, 2)
    return _zbv_list_schedule(p, m)[1]


def _zbv_list_schedule(p: int, m: int) -> tuple[list[list[Computation]], int]:
    """Per rank, its (op, micro, chunk) computations in order, from the unit-cost list scheduling zbv describes, and
    the step the last of them ends at."""
    last = 2 * p - 1
    done: dict[tuple[str, int, int], int] = {}  # (F or B, micro, stage) -> the step it finished at
    next_micro = {(rank, op, chunk): 0 for rank in range(p) for op in "FB" for chunk in (0, 1)}
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    in_flight, orders, makespan = [0] * p, [[] for _ in range(p)], 0

    def ready(rank: int, op: str, chunk: int, now: int) -> bool:
        micro, stage = next_micro[rank, op, chunk], stage_of(rank, chunk, p, "v")
        if micro >= m:
            return False
        if op == "F":
            return stage == 0 or done.get(("F", micro, stage - 1), now + 1) <= now
        return done.get(("F", micro, stage), now + 1) <= now and \
            (stage == last or done.get(("B", micro, stage + 1), now + 1) <= now)

    now = 0
    while sum(map(len, orders)) < 6 * m * p:
        if now > 6 * m * p + 4 * p:  # more steps than all the work plus the V's round trip: a bug, never a hang
            raise ScheduleError(f"zbv list scheduling is stuck at step {now} (p = {p}, m = {m})")
        for rank in range(p):
            choice = next((("B", c) for c in (0, 1) if ready(rank, "B", c, now)), None)
            if choice is None and in_flight[rank] < 2 * p + 2:
                choice = next((("F", c) for c in (1, 0) if ready(rank, "F", c, now)), None)
            if choice is not None:
                op, chunk = choice
                micro = next_micro[rank, op, chunk]
                next_micro[rank, op, chunk] += 1
                done[op, micro, stage_of(rank, chunk, p, "v")] = now + 1
                in_flight[rank] += op == "F"
                if op == "B":
                    pending_w[rank].append((micro, chunk))
                orders[rank].append(("forward" if op == "F" else "backward_input", micro, chunk))
            elif pending_w[rank]:
                micro, chunk = pending_w[rank].pop(0)
                in_flight[rank] -= 1
                orders[rank].append(("backward_weight", micro, chunk))
            else:
                continue
            makespan = now + 1
        now += 1
    return orders, makespan


# ------------------------------------------------------------------------------------------------ DualPipeV

def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe, "DeepSeek-V3 Technical Report" 2024, with its two pipelines folded onto one
    V of p ranks; torchtitan's ScheduleDualPipeV). Needs m >= 2p. Rank r runs, with F0/F1 a forward of chunk 0/1,
    B a full backward, Bi an input gradient whose W waits in a first-in first-out queue, and (F, B) an overlapped pair:

        1  2(p-r-1) x  F0                       warm-up down the V
        2  r+1 x       F0 F1                    the first micro-batches turn on the last rank
        3  p-r-1 x     Bi1 W F1                 zero-bubble: the W fills the gap before the next F1
        4  m-2p+r+1 x  (F0, B1) (F1, B0)        steady state: two overlapped pairs (the last rank's very first
                                                F0 and B1 run one after the other)
        5  p-r-1 x     B1 (F1, B0)
        6  r+1 x       B1 B0                    the later half of them Bi (from the middle, by the rank's parity)
        7  p-r-1 x     W Bi0
        8  r+1 x       W                        the queued weight gradients

    Per chunk and op the micro-batches go in order (so every channel stays FIFO)."""
    check_schedule_args("dualpipev", p, m, 2)
    schedule = []
    for rank, slots in enumerate(_dualpipev_slots(p, m)):
        steps = []
        for slot in slots:
            steps += _pair_steps(rank, p, *slot) if len(slot) == 2 else _single_steps(rank, p, *slot)
        schedule.append(steps + finish_steps())
    return schedule


def dualpipev_pairs(p: int, m: int) -> list[list[tuple[Computation, Computation]]]:
    """Per rank, its overlapped pairs in order: ((forward, micro, chunk), (backward, micro, chunk))."""
    check_schedule_args("dualpipev", p, m, 2)
    return [[slot for slot in slots if len(slot) == 2] for slots in _dualpipev_slots(p, m)]


def _single_steps(rank: int, p: int, computation: Computation) -> list[Instruction]:
    op, micro, chunk = computation
    if op == "forward":
        return forward_steps(rank, micro, p, 2, chunk, placement="v")
    if op == "backward_weight":
        return [Instruction(op, micro, chunk)]
    return backward_steps(rank, micro, p, 2, chunk, op, placement="v")


def _pair_steps(rank: int, p: int, forward: Computation, backward: Computation) -> list[Instruction]:
    """Both halves' receives, then F, F's send, B, B's send: each half's messages move under the other's compute."""
    f_steps, b_steps = _single_steps(rank, p, forward), _single_steps(rank, p, backward)
    f_at = next(i for i, ins in enumerate(f_steps) if ins.op == "forward")
    b_at = next(i for i, ins in enumerate(b_steps) if ins.op == backward[0])
    return f_steps[:f_at] + b_steps[:b_at] + f_steps[f_at:] + b_steps[b_at:]


def _dualpipev_slots(p: int, m: int) -> list[list[tuple]]:
    """Per rank, its slots in order: (computation,) alone or (forward, backward), an overlapped pair."""
    return [_DualPipeVRank(rank, p, m).slots() for rank in range(p)]


class _DualPipeVRank:
    """One rank's walk through the eight phases. Each chunk counts its F's and B's, so every op takes the next
    micro-batch of its chunk; W's take the oldest B whose weight gradients were deferred."""

    def __init__(self, rank: int, p: int, m: int):
        self.rank, self.p, self.m = rank, p, m
        self.next = {(op, chunk): 0 for op in ("F", "B") for chunk in (0, 1)}
        self.queued: list[tuple[int, int]] = []

    def f(self, chunk: int) -> Computation:
        return "forward", self._take("F", chunk), chunk

    def b(self, chunk: int, split: bool = False) -> Computation:
        micro = self._take("B", chunk)
        if split:
            self.queued.append((micro, chunk))
        return ("backward_input" if split else "backward"), micro, chunk

    def w(self) -> Computation:
        micro, chunk = self.queued.pop(0)
        return "backward_weight", micro, chunk

    def _take(self, op: str, chunk: int) -> int:
        micro = self.next[op, chunk]
        self.next[op, chunk] += 1
        return micro

    def slots(self) -> list[tuple]:
        r, p, m = self.rank, self.p, self.m
        out: list[tuple] = [(self.f(0),) for _ in range(2 * (p - r - 1))]
        for _ in range(r + 1):
            out += [(self.f(0),), (self.f(1),)]
        for _ in range(p - r - 1):
            out += [(self.b(1, split=True),), (self.w(),), (self.f(1),)]
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:  # as DualPipeV: the turn's first F0 and B1 are not overlapped
                out += [(self.f(0),), (self.b(1),)]
            else:
                out.append((self.f(0), self.b(1)))
            out.append((self.f(1), self.b(0)))
        for _ in range(p - r - 1):
            out += [(self.b(1),), (self.f(1), self.b(0))]
        half = (r + 1) // 2
        for i in range(r + 1):  # the later half split, switching between B1 and B0 on even ranks
            out.append((self.b(1, split=i > half or (i == half and r % 2 == 1)),))
            out.append((self.b(0, split=i >= half),))
        for _ in range(p - r - 1):
            out += [(self.w(),), (self.b(0, split=True),)]
        out += [(self.w(),) for _ in range(r + 1)]
        if self.queued or any(count != m for count in self.next.values()):
            raise ScheduleError(f"dualpipev rank {r}: the phases did not cover {m} micro-batches (p = {p})")
        return out
