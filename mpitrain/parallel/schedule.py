"""Pipeline schedules as pure functions: per-rank instruction lists and their textbook bubble. Validation, the timing
simulator and the other measures of a schedule are in parallel/schedule_analysis.py.

A schedule for p pipeline ranks and m micro-batches is `list[list[Instruction]]`: for each pipeline rank, the
instructions it executes in order (DeepSpeed's idea: a schedule can be printed and tested with no communication; an
executor runs it). Nothing here talks to MPI.

The instructions, placement and communication contract are in parallel/instructions.py; the V-shaped schedules (zbv,
dualpipev) in parallel/schedule_v.py.

Schedules ("kind"):
  gpipe        all forwards, then all backwards                       bubble (p-1)/(m+p-1), m activations in flight
  1f1b         warm-up p-r-1 forwards, steady one-forward-one-backward, cool-down (PipeDream-Flush, Megatron's
               non-interleaved)                                       bubble (p-1)/(m+p-1), at most p-r in flight
  interleaved  Megatron's interleaved 1F1B with v chunks per rank     bubble (p-1)/(v*m+p-1), needs m % p == 0
  zb1p         Zero Bubble ZB-H1 (Qi et al. 2024): backward split into B and W, W deferred into the cool-down
               bubble, same peak activations as 1f1b                 bubble (p-1)/(3m+p-1) if F = B = W and m >= p
  zbv          Zero Bubble ZB-V: two chunks per rank in a V (rank r holds stages r and 2p-1-r), B and W split,
               2p chunks of saved activations (1f1b's p micro-batches)   bubble (p-1)/(6m+p-1) for m >= 2p, F = B = W
  dualpipev    DeepSeek's DualPipeV: the V with overlapped forward-backward pairs, needs m >= 2p; 2p+1 chunks of
               activations                                           bubble (p-1)/(3m+p-1) when a pair costs F + B

Placement: "loop" (gpipe, 1f1b, interleaved, zb1p) puts stage s on rank s % p as chunk s // p; "v" (zbv, dualpipev)
runs the stages down the ranks and back up, so the last rank holds stages p-1 and p and hands the activation (and its
gradient) from one chunk to the other in memory: no message, no send or receive instruction.
"""
from __future__ import annotations

from fractions import Fraction

from mpitrain.config_rules import SCHEDULE_KINDS
from mpitrain.parallel.instructions import (
    COMM_OPS,
    COMPUTE_OPS,
    OPS,
    STEP_OPS,
    V_KINDS,
    Event,
    Instruction,
    PerRankEvents,
    Schedule,
    ScheduleArgumentError,
    ScheduleError,
    backward_steps,
    check_schedule_args,
    finish_steps,
    forward_only_program,
    forward_steps,
    message_peer,
    placement_of,
    rank_and_chunk,
    stage_of,
)
from mpitrain.parallel.schedule_v import dualpipev, dualpipev_pairs, zbv, zbv_makespan

__all__ = ["COMM_OPS", "COMPUTE_OPS", "OPS", "SCHEDULE_KINDS", "STEP_OPS", "V_KINDS", "Event", "Instruction",
           "PerRankEvents", "Schedule", "ScheduleArgumentError", "ScheduleError", "bubble_formula", "dualpipev",
           "dualpipev_pairs",
           "forward_only_program", "gpipe", "interleaved", "make_schedule", "message_peer", "one_f_one_b",
           "placement_of", "rank_and_chunk", "stage_of", "theoretical_bubble", "zb1p", "zbv", "zbv_makespan"]


# ------------------------------------------------------------------------------------------------ the schedules

def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs all m forwards, then all m backwards (in micro-batch order)."""
    check_schedule_args("gpipe", p, m, 1)
    schedule = []
    for rank in range(p):
        steps = []
        for micro in range(m):
            steps += forward_steps(rank, micro, p)
        for micro in range(m):
            steps += backward_steps(rank, micro, p)
        schedule.append(steps + finish_steps())
    return schedule


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): rank r runs p-r-1 warm-up forwards, then alternates one forward with one backward,
    then runs the backwards left. At most p-r micro-batches are in flight on rank r (GPipe: m)."""
    check_schedule_args("1f1b", p, m, 1)
    schedule = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        steady = m - warmup
        steps = []
        for micro in range(warmup):
            steps += forward_steps(rank, micro, p)
        for i in range(steady):
            steps += forward_steps(rank, warmup + i, p)
            steps += backward_steps(rank, i, p)
        for micro in range(steady, m):
            steps += backward_steps(rank, micro, p)
        schedule.append(steps + finish_steps())
    return schedule


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B: v model chunks per rank (chunk c on rank r is virtual stage c*p + r).

    Every rank walks the same sequence of (micro, chunk) forwards: micro-batches in groups of p, each group through
    chunk 0, then chunk 1, ...; backwards walk it with the chunks reversed. Rank r warms up with 2(p-r-1) + (v-1)p
    forwards, then alternates forward k+warmup with backward k, then drains. v = 1 is plain 1F1B. (Megatron also
    makes everything warm-up when m == p; the formula is kept there too: validate() shows it deadlock-free.)"""
    check_schedule_args("interleaved", p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    total = m * v

    def forward_item(k: int) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        return group * p + within % p, within // p  # (micro, chunk)

    def backward_item(k: int) -> tuple[int, int]:
        micro, chunk = forward_item(k)
        return micro, v - 1 - chunk

    schedule = []
    for rank in range(p):
        warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
        steady = total - warmup
        steps = []
        for k in range(warmup):
            micro, chunk = forward_item(k)
            steps += forward_steps(rank, micro, p, v, chunk)
        for k in range(steady):
            micro, chunk = forward_item(warmup + k)
            steps += forward_steps(rank, micro, p, v, chunk)
            micro, chunk = backward_item(k)
            steps += backward_steps(rank, micro, p, v, chunk)
        for k in range(steady, total):
            micro, chunk = backward_item(k)
            steps += backward_steps(rank, micro, p, v, chunk)
        schedule.append(steps + finish_steps())
    return schedule


def zb1p(p: int, m: int) -> Schedule:
    """Zero Bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

    The backward is split into B (input gradient, on the critical path: sent upstream at once) and W (weight
    gradients, needed by nobody but the optimizer). Step x of rank r runs, when they exist,

        F(x),  B(x - (p-1-r)),  W(x - (p-1))          for x = 0 .. m+p-2

    which reads as five phases: p-1-r lone F (the 1F1B warm-up), r steps F+B, the steady F+B+W, p-1-r steps B+W,
    and r lone W that fill the cool-down bubble. Forwards minus B's never exceed p-r, as in 1F1B (the same peak
    activation memory: W holds far less than B frees), and every rank starts its W's p-1 steps after its F's."""
    check_schedule_args("zb1p", p, m, 1)
    schedule = []
    for rank in range(p):
        steps = []
        for x in range(m + p - 1):
            if x < m:
                steps += forward_steps(rank, x, p)
            b = x - (p - 1 - rank)
            if 0 <= b < m:
                steps += backward_steps(rank, b, p, op="backward_input")
            w = x - (p - 1)
            if 0 <= w < m:
                steps.append(Instruction("backward_weight", w))
        schedule.append(steps + finish_steps())
    return schedule


def make_schedule(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule `kind` (one of SCHEDULE_KINDS) for p pipeline ranks, m micro-batches and v chunks per rank."""
    check_schedule_args(kind, p, m, v)
    if kind == "gpipe":
        return gpipe(p, m)
    if kind == "1f1b":
        return one_f_one_b(p, m)
    if kind == "interleaved":
        return interleaved(p, m, v)
    if kind == "zbv":
        return zbv(p, m)
    if kind == "dualpipev":
        return dualpipev(p, m)
    return zb1p(p, m)


def theoretical_bubble(kind: str, p: int, m: int, v: int = 1) -> float:
    """bubble_formula as a float."""
    return float(bubble_formula(kind, p, m, v))


def bubble_formula(kind: str, p: int, m: int, v: int = 1) -> Fraction:
    """The bubble fraction (idle / (ranks x makespan)) of the schedule as built, exactly, with unit costs: F 1 and a
    full backward 2 (gpipe, 1f1b, interleaved: per chunk); zb1p, zbv, dualpipev F = B = W = 1 (per chunk).

        gpipe, 1f1b   (p-1)/(m+p-1)       the p-1 fill and drain slots of F+B around m slots of work
        interleaved   (p-1)/(v*m+p-1)     the fill and drain shrink v times with stages v times shorter
        zb1p          (p-1)/(3m+p-1)      for m >= p. ZB-H1's bubble is (p-1)(T_F + T_B - T_W) [Qi et al. 2024]
                                          around m(T_F + T_B + T_W) of work: every rank waits p-1 slots (rank r idles
                                          from its first F's until B(0) comes back), a third of 1F1B's 3(p-1); about
                                          (p-1)/(3m) for m >> p.
                      (2p-m-1)/(2m+2p-1)  for m < p the round trip of the last micro-batch is longer than the work:
                                          the last stage runs F,B,F,B,... (its W's wait p-1 steps), so B(m-1) leaves
                                          it at p-1+2m, reaches rank 0 after p-1 more B's, and rank 0's W(m-1) ends
                                          at 2(m+p)-1. In general: makespan max(3m+p-1, 2(m+p)-1), busy 3m.
        zbv           (p-1)/(6m+p-1)      for m >= 2p: ZB-V's published bound, half of zb1p's. A stage's F+B+W is 6
                                          per micro-batch; the last rank's first input arrives after p-1 steps, so
                                          the makespan is at least 6m+p-1, and the list scheduling reaches it (every
                                          rank idles exactly its p-1 steps of fill). For m < 2p it loses a few steps
                                          more: the bubble is then (T-6m)/T with T = schedule_v.zbv_makespan.
        dualpipev     (p-1)/(3m+p-1)      DualPipe's bubble (PP/2-1)(F&B + B - 3W) [DeepSeek-V3 report; B a full
                                          backward] with PP/2 = p ranks, around m(2F + 2B) of work per rank. Here F&B,
                                          an overlapped pair, costs F + B: on one CPU core the two halves do not run at
                                          once, only their messages hide; so the idle is (p-1)(1+2+2-3) = 2(p-1) per
                                          rank around 6m: zb1p's fraction. With a real overlap (F&B < F+B) it is less.
    """
    check_schedule_args(kind, p, m, v)
    if kind == "interleaved":
        return Fraction(p - 1, v * m + p - 1)
    if kind == "zbv":
        makespan = 6 * m + p - 1 if m >= 2 * p else zbv_makespan(p, m)
        return Fraction(makespan - 6 * m, makespan)
    if kind == "dualpipev":
        return Fraction(2 * (p - 1), 6 * m + 2 * (p - 1))
    if kind == "zb1p":
        makespan = max(3 * m + p - 1, 2 * (m + p) - 1)
        return Fraction(makespan - 3 * m, makespan)
    return Fraction(p - 1, m + p - 1)
