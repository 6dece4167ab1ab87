"""Pipeline schedules as pure functions: per-rank instruction lists and their textbook bubble. Validation, the timing
simulator and the other measures of a schedule are in parallel/schedule_analysis.py.

A schedule for p pipeline ranks and m micro-batches is `list[list[Instruction]]`: for each pipeline rank, the
instructions it executes in order (DeepSpeed's idea: a schedule can be printed and tested with no communication; an
executor runs it). Nothing here talks to MPI.

Virtual stages. With v model chunks per rank (interleaved 1F1B), chunk c on rank r holds virtual stage s = c*p + r,
so a micro-batch visits ranks 0, 1, ..., p-1, 0, 1, ... v times. Without interleaving v = 1, chunk = 0, s = r.

What an executor does with each instruction (stage s = chunk*p + rank, last = v*p - 1):

    recv_forward(micro, chunk, peer)   receive the activation that stage s-1 (on pipeline rank `peer`) sent for this
                                       micro-batch; it is the input of the next forward(micro, chunk)
    forward(micro, chunk)              stage 0 loads micro-batch `micro` itself; the last stage also computes the loss
                                       (scaled by 1/m) and keeps its gradient for the backward
    send_forward(micro, chunk, peer)   send forward's output to stage s+1 on rank `peer`; free it once the send is done
    recv_backward(micro, chunk, peer)  receive d(loss)/d(output) of this stage from stage s+1 on rank `peer`
    backward(micro, chunk)             full backward: input gradient and weight gradients (accumulated in place)
    backward_input(micro, chunk)       zb1p only: the input gradient alone ("B"), keeping what backward_weight needs
    backward_weight(micro, chunk)      zb1p only: the weight gradients ("W") of a micro-batch whose B is done; frees it
    send_backward(micro, chunk, peer)  send the input gradient to stage s-1 on rank `peer`
    reduce_grads                       gradient sync over data parallelism (and, for a tied embedding, the sum of the
                                       embedding gradients of the first and last stage)
    optimizer_step                     the update

Communication contract (what schedule_analysis.validate proves, so that an executor may rely on it):
  * sends are non-blocking (`Isend`): the executor keeps each send buffer alive until its request completes and
    waits for all of them before `reduce_grads`; a receive blocks until its data is there. Under these semantics every
    schedule here completes on every rank (no deadlock), whatever the timing.
  * per (sender, receiver, direction) the k-th send carries the k-th receive's micro-batch (FIFO). So one MPI tag per
    direction (e.g. 0 = forward activations, 1 = gradients) and MPI's non-overtaking rule match every message;
    an executor may also post a receive early (`Irecv`) as long as it keeps that per-channel order.
  * with p = 1 and v > 1 a rank sends to itself (peer == own rank): MPI allows it; a local queue does as well.

Schedules ("kind"):
  gpipe        all forwards, then all backwards                       bubble (p-1)/(m+p-1), m activations in flight
  1f1b         warm-up p-r-1 forwards, steady one-forward-one-backward, cool-down (PipeDream-Flush, Megatron's
               non-interleaved)                                       bubble (p-1)/(m+p-1), at most p-r in flight
  interleaved  Megatron's interleaved 1F1B with v chunks per rank     bubble (p-1)/(v*m+p-1), needs m % p == 0
  zb1p         Zero Bubble ZB-H1 (Qi et al. 2024): backward split into B and W, W deferred into the cool-down
               bubble, same peak activations as 1f1b                 bubble (p-1)/(3m+p-1) if F = B = W and m >= p
  zbv          Zero Bubble ZB-V: two chunks per rank in a V (rank r holds stages r and 2p-1-r), B and W split,
               at most 2p chunks held from F to W (1f1b's p micro-batches)  bubble >= (p-1)/(6m+p-1), F = B = W

Placement: "loop" (every kind but zbv) puts stage s on rank s % p as chunk s // p; "v" (zbv) runs the stages down the
ranks and back up, so the last rank holds stages p-1 and p and hands the activation (and its gradient) from one chunk
to the other in memory: no message, no send or receive instruction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from mpitrain.config_rules import SCHEDULE_KINDS, positive_degree
from mpitrain.errors import ConfigError

COMPUTE_OPS = ("forward", "backward", "backward_input", "backward_weight")
COMM_OPS = ("recv_forward", "send_forward", "recv_backward", "send_backward")
STEP_OPS = ("reduce_grads", "optimizer_step")
OPS = COMPUTE_OPS + COMM_OPS + STEP_OPS


class ScheduleArgumentError(ConfigError, ValueError):
    """A schedule was asked for with impossible arguments (kind, p, m, v); the message names the config key."""


class ScheduleError(ValueError):
    """A schedule breaks a rule: a missing or misordered instruction, unmatched messages, or a deadlock."""


@dataclass(frozen=True)
class Instruction:
    """One step of one pipeline rank. `micro` is None only for reduce_grads/optimizer_step; `peer` (the other
    pipeline rank) is set only for sends and receives."""
    op: str
    micro: int | None = None
    chunk: int = 0
    peer: int | None = None

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown pipeline instruction {self.op!r}; one of {', '.join(OPS)}")

    def __str__(self) -> str:
        if self.micro is None:
            return self.op
        text = f"{self.op}(micro={self.micro}, chunk={self.chunk}"
        if self.peer is not None:
            text += f", {'to' if self.op.startswith('send') else 'from'} rank {self.peer}"
        return text + ")"


class Event(NamedTuple):
    """One instruction of a timeline, simulated or recorded: (start, end, instruction)."""
    start: float
    end: float
    instruction: Instruction


Schedule = list[list[Instruction]]
PerRankEvents = list[list[Event]]  # a timeline: per rank, its events in time order


# ------------------------------------------------------------------------------------------------ placement

def placement_of(kind: str) -> str:
    """How schedule `kind` places virtual stages on ranks: "v" for zbv, "loop" (round-robin) for the others."""
    return "v" if kind == "zbv" else "loop"


def stage_of(rank: int, chunk: int, p: int, placement: str = "loop") -> int:
    """The virtual stage that chunk `chunk` of pipeline rank `rank` holds."""
    if placement == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def rank_and_chunk(stage: int, p: int, placement: str = "loop") -> tuple[int, int]:
    """The (pipeline rank, chunk) holding virtual stage `stage`: the inverse of stage_of."""
    if placement == "v":
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def message_peer(rank: int, neighbour: int, p: int, v: int, placement: str = "loop") -> int | None:
    """The rank a message to or from stage `neighbour` goes through, or None when there is none: no such stage, or
    (V placement) the neighbour is this rank's other chunk, handed over in memory. The loop placement with p = 1
    keeps its messages to itself."""
    if not 0 <= neighbour < v * p:
        return None
    peer = rank_and_chunk(neighbour, p, placement)[0]
    return None if placement == "v" and peer == rank else peer


# ------------------------------------------------------------------------------------------------ instruction groups
# One compute instruction with the receive before it and the send after it, from the neighbouring stages' ranks
# (loop placement: rank-1 and rank+1 mod p, interleaving wraps around).

def _forward(rank: int, micro: int, p: int, v: int = 1, chunk: int = 0, placement: str = "loop") -> list[Instruction]:
    stage = stage_of(rank, chunk, p, placement)
    before, after = (message_peer(rank, stage + step, p, v, placement) for step in (-1, 1))
    steps = []
    if before is not None:
        steps.append(Instruction("recv_forward", micro, chunk, peer=before))
    steps.append(Instruction("forward", micro, chunk))
    if after is not None:
        steps.append(Instruction("send_forward", micro, chunk, peer=after))
    return steps


def forward_only_program(rank: int, p: int, v: int, m: int, placement: str = "loop") -> list[Instruction]:
    """Validation: every micro-batch through each chunk in turn, no backward. Sends never block, so this cannot
    deadlock, and each channel carries its micro-batches in order."""
    return [step for chunk in range(v) for micro in range(m)
            for step in _forward(rank, micro, p, v, chunk, placement)]


def _backward(rank: int, micro: int, p: int, v: int = 1, chunk: int = 0, op: str = "backward",
              placement: str = "loop") -> list[Instruction]:
    """Full backward, or with op="backward_input" the B of zb1p: both receive dy and send dx."""
    stage = stage_of(rank, chunk, p, placement)
    before, after = (message_peer(rank, stage + step, p, v, placement) for step in (-1, 1))
    steps = []
    if after is not None:
        steps.append(Instruction("recv_backward", micro, chunk, peer=after))
    steps.append(Instruction(op, micro, chunk))
    if before is not None:
        steps.append(Instruction("send_backward", micro, chunk, peer=before))
    return steps


def _finish() -> list[Instruction]:
    return [Instruction("reduce_grads"), Instruction("optimizer_step")]


# ------------------------------------------------------------------------------------------------ the schedules

def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs all m forwards, then all m backwards (in micro-batch order)."""
    _check_args("gpipe", p, m, 1)
    schedule = []
    for rank in range(p):
        steps = []
        for micro in range(m):
            steps += _forward(rank, micro, p)
        for micro in range(m):
            steps += _backward(rank, micro, p)
        schedule.append(steps + _finish())
    return schedule


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): rank r runs p-r-1 warm-up forwards, then alternates one forward with one backward,
    then runs the backwards left. At most p-r micro-batches are in flight on rank r (GPipe: m)."""
    _check_args("1f1b", p, m, 1)
    schedule = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        steady = m - warmup
        steps = []
        for micro in range(warmup):
            steps += _forward(rank, micro, p)
        for i in range(steady):
            steps += _forward(rank, warmup + i, p)
            steps += _backward(rank, i, p)
        for micro in range(steady, m):
            steps += _backward(rank, micro, p)
        schedule.append(steps + _finish())
    return schedule


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B: v model chunks per rank (chunk c on rank r is virtual stage c*p + r).

    Every rank walks the same sequence of (micro, chunk) forwards: micro-batches in groups of p, each group through
    chunk 0, then chunk 1, ...; backwards walk it with the chunks reversed. Rank r warms up with 2(p-r-1) + (v-1)p
    forwards, then alternates forward k+warmup with backward k, then drains. v = 1 is plain 1F1B. (Megatron also
    makes everything warm-up when m == p; the formula is kept there too: validate() shows it deadlock-free.)"""
    _check_args("interleaved", p, m, v)
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
            steps += _forward(rank, micro, p, v, chunk)
        for k in range(steady):
            micro, chunk = forward_item(warmup + k)
            steps += _forward(rank, micro, p, v, chunk)
            micro, chunk = backward_item(k)
            steps += _backward(rank, micro, p, v, chunk)
        for k in range(steady, total):
            micro, chunk = backward_item(k)
            steps += _backward(rank, micro, p, v, chunk)
        schedule.append(steps + _finish())
    return schedule


def zb1p(p: int, m: int) -> Schedule:
    """Zero Bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

    The backward is split into B (input gradient, on the critical path: sent upstream at once) and W (weight
    gradients, needed by nobody but the optimizer). Step x of rank r runs, when they exist,

        F(x),  B(x - (p-1-r)),  W(x - (p-1))          for x = 0 .. m+p-2

    which reads as five phases: p-1-r lone F (the 1F1B warm-up), r steps F+B, the steady F+B+W, p-1-r steps B+W,
    and r lone W that fill the cool-down bubble. Forwards minus B's never exceed p-r, as in 1F1B (the same peak
    activation memory: W holds far less than B frees), and every rank starts its W's p-1 steps after its F's."""
    _check_args("zb1p", p, m, 1)
    schedule = []
    for rank in range(p):
        steps = []
        for x in range(m + p - 1):
            if x < m:
                steps += _forward(rank, x, p)
            b = x - (p - 1 - rank)
            if 0 <= b < m:
                steps += _backward(rank, b, p, op="backward_input")
            w = x - (p - 1)
            if 0 <= w < m:
                steps.append(Instruction("backward_weight", w))
        schedule.append(steps + _finish())
    return schedule


def zbv(p: int, m: int) -> Schedule:
    """Zero Bubble ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): two chunks per rank in a V
    (chunk 0 of rank r is stage r, chunk 1 is stage 2p-1-r), backward split into B and W as in zb1p.

    The order comes from list scheduling with unit costs (F = B = W = 1 per chunk): at every time step each rank
    runs a B whose dy is there (chunk 0 first), else a F whose input is there (chunk 1 first: it brings a micro-batch
    closer to its loss) unless 2p chunks are held, from their F to their W (saved activations, then deferred W work:
    1f1b's memory, p whole micro-batches), else its oldest pending W. The cap counts until W, not B: else B's and F's
    would push every W to the end of the step and the deferred work would grow with m. Per chunk, F's, B's and W's
    go in micro-batch order, so every channel stays FIFO. For p <= 4 (and p = 8) and m a multiple of p every rank
    idles only p-1 steps: bubble (p-1)/(6m+p-1), the bound; other (p, m) lose a few steps, below zb1p for m >= p."""
    _check_args("zbv", p, m, 2)
    schedule = []
    for rank, order in enumerate(_zbv_order(p, m)):
        steps = []
        for op, micro, chunk in order:
            if op == "forward":
                steps += _forward(rank, micro, p, 2, chunk, placement="v")
            elif op == "backward_input":
                steps += _backward(rank, micro, p, 2, chunk, op, placement="v")
            else:
                steps.append(Instruction(op, micro, chunk))
        schedule.append(steps + _finish())
    return schedule


def _zbv_order(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, its (op, micro, chunk) computations in order, from the unit-cost list scheduling zbv describes."""
    last = 2 * p - 1
    done: dict[tuple[str, int, int], int] = {}  # (F or B, micro, stage) -> the step it finished at
    next_micro = {(rank, op, chunk): 0 for rank in range(p) for op in "FB" for chunk in (0, 1)}
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    in_flight, orders = [0] * p, [[] for _ in range(p)]

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
            if choice is None and in_flight[rank] < 2 * p:
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
        now += 1
    return orders


def make_schedule(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule `kind` (one of SCHEDULE_KINDS) for p pipeline ranks, m micro-batches and v chunks per rank."""
    _check_args(kind, p, m, v)
    if kind == "gpipe":
        return gpipe(p, m)
    if kind == "1f1b":
        return one_f_one_b(p, m)
    if kind == "interleaved":
        return interleaved(p, m, v)
    if kind == "zbv":
        return zbv(p, m)
    return zb1p(p, m)


def _check_args(kind: str, p: int, m: int, v: int) -> None:
    if kind not in SCHEDULE_KINDS:
        raise ScheduleArgumentError(f"parallel.schedule must be one of {', '.join(SCHEDULE_KINDS)}; got {kind!r}")
    for key, value in (("parallel.pp", p), ("parallel.microbatches", m), ("parallel.virtual_stages", v)):
        positive_degree(key, value, ScheduleArgumentError)
    if kind == "zbv" and v != 2:
        raise ScheduleArgumentError(f"parallel.schedule = 'zbv' runs two model chunks per rank in a V; set "
                                    f"parallel.virtual_stages = 2 (got {v})")
    if v > 1 and kind not in ("interleaved", "zbv"):
        raise ScheduleArgumentError(f"parallel.virtual_stages = {v} needs parallel.schedule = 'interleaved' "
                                    f"(got {kind!r}); set parallel.virtual_stages = 1 or change the schedule")
    if kind == "interleaved" and v > 1 and m % p:
        raise ScheduleArgumentError(
            f"interleaved schedule needs parallel.microbatches ({m}) divisible by parallel.pp ({p}); "
            f"use a multiple of {p}, e.g. {m + (-m) % p}")


def theoretical_bubble(kind: str, p: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction with t_backward = 2 t_forward (zb1p: F = B = W, so B + W = 2 F as well):

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
        zbv           (p-1)/(6m+p-1)      per-chunk F = B = W = 1 (a stage's F+B+W is 6 per micro-batch): the last
                                          rank's first input arrives after p-1 steps, so the makespan is at least
                                          6m+p-1 (and 4p+2m-1, the last micro-batch's trip down and up the V after
                                          the m-1 before it): the bound max of both, with busy 6m. Half of zb1p's.
                                          zbv's list scheduling reaches it when m is a multiple of p for p <= 4 and
                                          p = 8; other (p, m) lose a few steps (schedule_analysis.simulate says).
    """
    _check_args(kind, p, m, v)
    if kind == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if kind == "zbv":
        makespan = max(6 * m + p - 1, 4 * p + 2 * m - 1)
        return (makespan - 6 * m) / makespan
    if kind == "zb1p":
        makespan = max(3 * m + p - 1, 2 * (m + p) - 1)
        return (makespan - 3 * m) / makespan
    return (p - 1) / (m + p - 1)
