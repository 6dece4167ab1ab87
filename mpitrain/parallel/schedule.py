"""Pipeline schedules as pure functions: per-rank instruction lists, their validation, and a timing simulator.

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

Communication contract (what `validate` proves, so that an executor may rely on it):
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
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import NamedTuple

from mpitrain.errors import ConfigError

SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved", "zb1p")

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


# ------------------------------------------------------------------------------------------------ instruction groups
# One compute instruction with the receive before it and the send after it. Stage s = chunk*p + rank; the stage
# before it lives on rank (rank-1) mod p and the one after it on (rank+1) mod p (interleaving wraps around).

def _forward(rank: int, micro: int, p: int, v: int = 1, chunk: int = 0) -> list[Instruction]:
    stage = chunk * p + rank
    steps = []
    if stage > 0:
        steps.append(Instruction("recv_forward", micro, chunk, peer=(rank - 1) % p))
    steps.append(Instruction("forward", micro, chunk))
    if stage < v * p - 1:
        steps.append(Instruction("send_forward", micro, chunk, peer=(rank + 1) % p))
    return steps


def forward_only_program(rank: int, p: int, v: int, m: int) -> list[Instruction]:
    """Validation: every micro-batch through each chunk in turn, no backward. Sends never block, so this cannot
    deadlock, and each channel carries its micro-batches in order."""
    return [step for chunk in range(v) for micro in range(m) for step in _forward(rank, micro, p, v, chunk)]


def _backward(rank: int, micro: int, p: int, v: int = 1, chunk: int = 0, op: str = "backward") -> list[Instruction]:
    """Full backward, or with op="backward_input" the B of zb1p: both receive dy and send dx."""
    stage = chunk * p + rank
    steps = []
    if stage < v * p - 1:
        steps.append(Instruction("recv_backward", micro, chunk, peer=(rank + 1) % p))
    steps.append(Instruction(op, micro, chunk))
    if stage > 0:
        steps.append(Instruction("send_backward", micro, chunk, peer=(rank - 1) % p))
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


def make_schedule(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule `kind` (one of SCHEDULE_KINDS) for p pipeline ranks, m micro-batches and v chunks per rank."""
    _check_args(kind, p, m, v)
    if kind == "gpipe":
        return gpipe(p, m)
    if kind == "1f1b":
        return one_f_one_b(p, m)
    if kind == "interleaved":
        return interleaved(p, m, v)
    return zb1p(p, m)


def _check_args(kind: str, p: int, m: int, v: int) -> None:
    if kind not in SCHEDULE_KINDS:
        raise ScheduleArgumentError(f"parallel.schedule must be one of {', '.join(SCHEDULE_KINDS)}; got {kind!r}")
    for key, value in (("parallel.pp", p), ("parallel.microbatches", m), ("parallel.virtual_stages", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleArgumentError(f"{key} must be a positive integer, got {value!r}")
    if v > 1 and kind != "interleaved":
        raise ScheduleArgumentError(f"parallel.virtual_stages = {v} needs parallel.schedule = 'interleaved' "
                                    f"(got {kind!r}); set parallel.virtual_stages = 1 or change the schedule")
    if kind == "interleaved" and v > 1 and m % p:
        raise ScheduleArgumentError(
            f"interleaved schedule needs parallel.microbatches ({m}) divisible by parallel.pp ({p}); "
            f"use a multiple of {p}, e.g. {m + (-m) % p}")


# ------------------------------------------------------------------------------------------------ validation

def _stage(rank: int, chunk: int, p: int) -> int:
    return chunk * p + rank


def validate(schedule: Schedule, p: int, m: int, v: int = 1) -> None:
    """Raise ScheduleError unless `schedule` is a correct pipeline program for p ranks, m micro-batches, v chunks:

    1. each rank ends with reduce_grads then optimizer_step, and every instruction names a valid micro-batch, chunk
       and peer (the neighbouring stage's rank);
    2. on every virtual stage every micro-batch is forwarded once and backwarded once (a full backward, or one
       backward_input and one backward_weight), forward before backward before weight gradient;
    3. a stage receives its input before its forward and its output gradient before its backward, and sends the
       forward's output (the backward's input gradient) after computing it, exactly when a neighbouring stage needs
       it;
    4. per (sender, receiver, direction) the sends and receives carry the same micro-batches in the same order;
    5. run with blocking receives and buffered sends, every rank gets to its end (no deadlock).
    """
    if len(schedule) != p:
        raise ScheduleError(f"schedule has {len(schedule)} ranks, expected p = {p}")
    for rank, program in enumerate(schedule):
        _check_rank(rank, program, p, m, v)
    _check_channels(schedule, p)
    _, stuck = _execute(schedule, _zero_durations, t_comm=0.0)
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(f"rank {rank} waits at step {pc} {schedule[rank][pc]}"
                                                      for rank, pc in stuck))


def _check_rank(rank: int, program: list[Instruction], p: int, m: int, v: int) -> None:
    where = f"rank {rank}"
    last = v * p - 1
    if [ins.op for ins in program[-2:]] != list(STEP_OPS) or \
            sum(ins.op in STEP_OPS for ins in program) != 2:
        raise ScheduleError(f"{where}: must end with reduce_grads, optimizer_step (once each)")
    expected_peer = {"recv_forward": (rank - 1) % p, "send_backward": (rank - 1) % p,
                     "send_forward": (rank + 1) % p, "recv_backward": (rank + 1) % p}
    positions: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    for index, ins in enumerate(program[:-2]):
        if not isinstance(ins.micro, int) or not 0 <= ins.micro < m:
            raise ScheduleError(f"{where} step {index}: {ins} has micro-batch {ins.micro!r} outside 0..{m - 1}")
        if not isinstance(ins.chunk, int) or not 0 <= ins.chunk < v:
            raise ScheduleError(f"{where} step {index}: {ins} has chunk {ins.chunk!r} outside 0..{v - 1}")
        if ins.op in COMM_OPS and ins.peer != expected_peer[ins.op]:
            raise ScheduleError(f"{where} step {index}: {ins} should name peer rank {expected_peer[ins.op]}")
        if ins.op in COMPUTE_OPS and ins.peer is not None:
            raise ScheduleError(f"{where} step {index}: {ins} is a computation and names a peer")
        positions[ins.op, ins.micro, ins.chunk].append(index)

    def count(op: str, micro: int, chunk: int, expected: int, why: str) -> None:
        found = len(positions.get((op, micro, chunk), ()))
        if found != expected:
            raise ScheduleError(f"{where}: virtual stage {_stage(rank, chunk, p)} has {found} {op}(micro={micro}, "
                                f"chunk={chunk}), expected {expected} ({why})")

    def first(op: str, micro: int, chunk: int) -> int:
        return positions[op, micro, chunk][0]

    def before(op_a: str, op_b: str, micro: int, chunk: int) -> None:
        if first(op_a, micro, chunk) > first(op_b, micro, chunk):
            raise ScheduleError(f"{where}: {op_b}(micro={micro}, chunk={chunk}) at step {first(op_b, micro, chunk)} "
                                f"comes before its {op_a} at step {first(op_a, micro, chunk)}")

    # counts first: every micro-batch forwarded and backwarded once on each of this rank's virtual stages
    for chunk in range(v):
        stage = _stage(rank, chunk, p)
        for micro in range(m):
            count("forward", micro, chunk, 1, "each micro-batch is forwarded once per stage")
            split = (("backward_input", micro, chunk) in positions or ("backward_weight", micro, chunk) in positions)
            if split:
                count("backward", micro, chunk, 0, "a split backward has no full backward")
                count("backward_input", micro, chunk, 1, "B once")
                count("backward_weight", micro, chunk, 1, "W once")
            else:
                count("backward", micro, chunk, 1, "each micro-batch is backwarded once per stage")
            count("recv_forward", micro, chunk, int(stage > 0), "every stage but the first receives its input")
            count("send_forward", micro, chunk, int(stage < last), "every stage but the last sends its output")
            count("recv_backward", micro, chunk, int(stage < last), "every stage but the last receives dy")
            count("send_backward", micro, chunk, int(stage > 0), "every stage but the first sends dx")
    # then the order of each micro-batch's instructions on this rank
    for chunk in range(v):
        stage = _stage(rank, chunk, p)
        for micro in range(m):
            gradient = "backward_input" if ("backward_input", micro, chunk) in positions else "backward"
            before("forward", gradient, micro, chunk)
            if gradient == "backward_input":
                before("backward_input", "backward_weight", micro, chunk)
            if stage > 0:
                before("recv_forward", "forward", micro, chunk)
                before(gradient, "send_backward", micro, chunk)
            if stage < last:
                before("forward", "send_forward", micro, chunk)
                before("recv_backward", gradient, micro, chunk)


def _channel(rank: int, ins: Instruction, p: int) -> tuple[tuple[int, int, str], tuple[int, int]]:
    """(sender, receiver, direction) of a send or receive, and what the message is: (micro, receiving stage)."""
    stage = _stage(rank, ins.chunk, p)
    if ins.op == "send_forward":
        return (rank, ins.peer, "forward"), (ins.micro, stage + 1)
    if ins.op == "recv_forward":
        return (ins.peer, rank, "forward"), (ins.micro, stage)
    if ins.op == "send_backward":
        return (rank, ins.peer, "backward"), (ins.micro, stage - 1)
    return (ins.peer, rank, "backward"), (ins.micro, stage)  # recv_backward


def _check_channels(schedule: Schedule, p: int) -> None:
    sent: dict[tuple, list] = defaultdict(list)
    received: dict[tuple, list] = defaultdict(list)
    for rank, program in enumerate(schedule):
        for ins in program:
            if ins.op in COMM_OPS:
                channel, message = _channel(rank, ins, p)
                (sent if ins.op.startswith("send") else received)[channel].append(message)
    for channel in sorted(set(sent) | set(received)):
        sends, recvs = sent.get(channel, []), received.get(channel, [])
        src, dst, direction = channel
        name = f"{direction} messages from rank {src} to rank {dst}"
        if len(sends) != len(recvs):
            raise ScheduleError(f"{name}: {len(sends)} sends but {len(recvs)} receives")
        for k, (message, expected) in enumerate(zip(sends, recvs, strict=True)):
            if message != expected:
                raise ScheduleError(
                    f"{name} are out of order: send #{k} carries micro-batch {message[0]} for stage {message[1]}, "
                    f"receive #{k} expects micro-batch {expected[0]} for stage {expected[1]}")


# ------------------------------------------------------------------------------------------------ execution

def _zero_durations(ins: Instruction) -> float:
    return 0.0


def _execute(schedule: Schedule, duration, t_comm: float) -> tuple[PerRankEvents, list[tuple[int, int]]]:
    """Run all ranks with buffered sends and blocking receives. Returns the timeline and, for ranks that could not
    finish, (rank, index of the receive they wait at). Compute takes duration(instruction); a message arrives t_comm
    after its send. The times do not depend on the order ranks are visited in, only on the dependencies."""
    p = len(schedule)
    clock = [0.0] * p
    pc = [0] * p
    timeline: PerRankEvents = [[] for _ in range(p)]
    mailbox: dict[tuple, deque] = defaultdict(deque)  # channel -> (message, arrival time), FIFO
    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(schedule):
            while pc[rank] < len(program):
                ins = program[pc[rank]]
                start = clock[rank]
                if ins.op in ("send_forward", "send_backward"):
                    channel, message = _channel(rank, ins, p)
                    mailbox[channel].append((message, start + t_comm))
                    end = start
                elif ins.op in ("recv_forward", "recv_backward"):
                    channel, expected = _channel(rank, ins, p)
                    if not mailbox[channel]:
                        break  # blocked: the matching send has not been issued yet
                    message, arrival = mailbox[channel].popleft()
                    if message != expected:
                        raise ScheduleError(f"rank {rank}: {ins} received micro-batch {message[0]} for stage "
                                            f"{message[1]} (messages out of order)")
                    end = max(start, arrival)
                else:
                    end = start + duration(ins)
                timeline[rank].append(Event(start, end, ins))
                clock[rank] = end
                pc[rank] += 1
                progress = True
    stuck = [(rank, pc[rank]) for rank in range(p) if pc[rank] < len(schedule[rank])]
    return timeline, stuck


def simulate(schedule: Schedule, t_forward: float = 1.0, t_backward: float = 2.0, t_backward_input: float = 1.0,
             t_backward_weight: float = 1.0, t_comm: float = 0.0) -> PerRankEvents:
    """Per rank, the list of Event(start, end, instruction) when each instruction runs as soon as its rank is free
    and its input has arrived. Sends, reduce_grads and optimizer_step take no time; a receive lasts from when its
    rank reaches it to when the message arrives (t_comm after the send), i.e. it is the time spent waiting on a peer."""
    durations = {"forward": t_forward, "backward": t_backward, "backward_input": t_backward_input,
                 "backward_weight": t_backward_weight}
    timeline, stuck = _execute(schedule, lambda ins: durations.get(ins.op, 0.0), t_comm)
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(f"rank {rank} waits at step {pc} {schedule[rank][pc]}"
                                                      for rank, pc in stuck))
    return timeline


def bubble_fraction(timeline: PerRankEvents) -> float:
    """Idle time / (ranks x makespan), counting only compute (forward, backward, backward_input, backward_weight)
    as busy; the makespan runs from the first compute start to the last compute end over all ranks."""
    compute = [event for events in timeline for event in events if event.instruction.op in COMPUTE_OPS]
    if not compute:
        return 0.0
    makespan = max(e.end for e in compute) - min(e.start for e in compute)
    if makespan <= 0:
        return 0.0
    busy = sum(e.end - e.start for e in compute)
    return 1.0 - busy / (len(timeline) * makespan)


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
    """
    _check_args(kind, p, m, v)
    if kind == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if kind == "zb1p":
        makespan = max(3 * m + p - 1, 2 * (m + p) - 1)
        return (makespan - 3 * m) / makespan
    return (p - 1) / (m + p - 1)


def peak_activations(schedule: Schedule) -> list[int]:
    """Per rank, the most (micro-batch, chunk) pairs whose forward is done and whose backward (B for zb1p) is not:
    the activations the rank holds at its worst moment. GPipe: m; 1F1B and zb1p: p - rank. For interleaved, each
    pair holds one chunk's activations, 1/v of what a micro-batch holds on a non-interleaved stage."""
    peaks = []
    for program in schedule:
        in_flight = peak = 0
        for ins in program:
            if ins.op == "forward":
                in_flight += 1
                peak = max(peak, in_flight)
            elif ins.op in ("backward", "backward_input"):
                in_flight -= 1
        peaks.append(peak)
    return peaks


def format_schedule(schedule: Schedule) -> str:
    """The instruction lists, one rank per block: what each rank will execute, in order."""
    blocks = []
    for rank, program in enumerate(schedule):
        blocks.append(f"rank {rank}:\n" + "\n".join(f"  {index:>4}  {ins}" for index, ins in enumerate(program)))
    return "\n".join(blocks)
