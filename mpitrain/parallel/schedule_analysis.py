"""Checking and measuring pipeline schedules (built in parallel/schedule.py): validation against the communication
contract, a timing simulator, the bubble of a timeline, peak activations per rank, and a printable listing.

Nothing here talks to MPI: `_execute` runs every rank's program in one process with buffered sends and blocking
receives, which is both the deadlock check of `validate` and the clock of `simulate`.
"""
from __future__ import annotations

from collections import defaultdict, deque
from fractions import Fraction

from mpitrain.parallel.schedule import (
    COMM_OPS,
    COMPUTE_OPS,
    STEP_OPS,
    Event,
    Instruction,
    PerRankEvents,
    Schedule,
    ScheduleError,
    message_peer,
    stage_of,
)

# ------------------------------------------------------------------------------------------------ validation

def validate(schedule: Schedule, p: int, m: int, v: int = 1, placement: str = "loop") -> None:
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

    placement: schedule.placement_of(kind), which rank and chunk hold each stage ("v" for zbv).
    """
    if len(schedule) != p:
        raise ScheduleError(f"schedule has {len(schedule)} ranks, expected p = {p}")
    for rank, program in enumerate(schedule):
        _check_rank(rank, program, p, m, v, placement)
    _check_channels(schedule, p, placement)
    _, stuck = _execute(schedule, _zero_durations, t_comm=0.0, placement=placement)
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(f"rank {rank} waits at step {pc} {schedule[rank][pc]}"
                                                      for rank, pc in stuck))


def _check_rank(rank: int, program: list[Instruction], p: int, m: int, v: int, placement: str) -> None:
    where = f"rank {rank}"

    def peers(chunk: int) -> dict[str, int | None]:  # per message op, the rank it goes through (None: no message)
        stage = stage_of(rank, chunk, p, placement)
        before, after = (message_peer(rank, stage + step, p, v, placement) for step in (-1, 1))
        return {"recv_forward": before, "send_backward": before, "send_forward": after, "recv_backward": after}

    if [ins.op for ins in program[-2:]] != list(STEP_OPS) or \
            sum(ins.op in STEP_OPS for ins in program) != 2:
        raise ScheduleError(f"{where}: must end with reduce_grads, optimizer_step (once each)")
    positions: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    for index, ins in enumerate(program[:-2]):
        if not isinstance(ins.micro, int) or not 0 <= ins.micro < m:
            raise ScheduleError(f"{where} step {index}: {ins} has micro-batch {ins.micro!r} outside 0..{m - 1}")
        if not isinstance(ins.chunk, int) or not 0 <= ins.chunk < v:
            raise ScheduleError(f"{where} step {index}: {ins} has chunk {ins.chunk!r} outside 0..{v - 1}")
        if ins.op in COMM_OPS and ins.peer != peers(ins.chunk)[ins.op]:
            raise ScheduleError(f"{where} step {index}: {ins} should name peer rank {peers(ins.chunk)[ins.op]}")
        if ins.op in COMPUTE_OPS and ins.peer is not None:
            raise ScheduleError(f"{where} step {index}: {ins} is a computation and names a peer")
        positions[ins.op, ins.micro, ins.chunk].append(index)

    def count(op: str, micro: int, chunk: int, expected: int, why: str) -> None:
        found = len(positions.get((op, micro, chunk), ()))
        if found != expected:
            raise ScheduleError(f"{where}: virtual stage {stage_of(rank, chunk, p, placement)} has {found} "
                                f"{op}(micro={micro}, chunk={chunk}), expected {expected} ({why})")

    def first(op: str, micro: int, chunk: int) -> int:
        return positions[op, micro, chunk][0]

    def before(op_a: str, op_b: str, micro: int, chunk: int) -> None:
        if first(op_a, micro, chunk) > first(op_b, micro, chunk):
            raise ScheduleError(f"{where}: {op_b}(micro={micro}, chunk={chunk}) at step {first(op_b, micro, chunk)} "
                                f"comes before its {op_a} at step {first(op_a, micro, chunk)}")

    # counts first: every micro-batch forwarded and backwarded once on each of this rank's virtual stages
    for chunk in range(v):
        messages = {op: int(peer is not None) for op, peer in peers(chunk).items()}
        for micro in range(m):
            count("forward", micro, chunk, 1, "each micro-batch is forwarded once per stage")
            split = (("backward_input", micro, chunk) in positions or ("backward_weight", micro, chunk) in positions)
            if split:
                count("backward", micro, chunk, 0, "a split backward has no full backward")
                count("backward_input", micro, chunk, 1, "B once")
                count("backward_weight", micro, chunk, 1, "W once")
            else:
                count("backward", micro, chunk, 1, "each micro-batch is backwarded once per stage")
            count("recv_forward", micro, chunk, messages["recv_forward"], "its input comes from another rank")
            count("send_forward", micro, chunk, messages["send_forward"], "a stage sends its output to another rank")
            count("recv_backward", micro, chunk, messages["recv_backward"], "a stage receives dy from another rank")
            count("send_backward", micro, chunk, messages["send_backward"], "a stage sends dx to another rank")
    # then the order of each micro-batch's instructions on this rank
    for chunk in range(v):
        messages = peers(chunk)
        for micro in range(m):
            gradient = "backward_input" if ("backward_input", micro, chunk) in positions else "backward"
            before("forward", gradient, micro, chunk)
            if gradient == "backward_input":
                before("backward_input", "backward_weight", micro, chunk)
            if messages["recv_forward"] is not None:
                before("recv_forward", "forward", micro, chunk)
                before(gradient, "send_backward", micro, chunk)
            if messages["send_forward"] is not None:
                before("forward", "send_forward", micro, chunk)
                before("recv_backward", gradient, micro, chunk)
    if placement == "v":
        _check_turn(rank, positions, p, m)


def _check_turn(rank: int, positions: dict, p: int, m: int) -> None:
    """The V's turn on the last rank passes through memory: chunk 0's forward (stage p-1) must come before chunk 1's
    (stage p), and chunk 1's input gradient before chunk 0's backward."""
    if rank != p - 1:
        return
    def gradient(micro: int, chunk: int) -> int:  # where the input gradient is computed: B, or a full backward
        op = "backward_input" if ("backward_input", micro, chunk) in positions else "backward"
        return positions[op, micro, chunk][0]

    for micro in range(m):
        if positions["forward", micro, 0][0] > positions["forward", micro, 1][0] or \
                gradient(micro, 1) > gradient(micro, 0):
            raise ScheduleError(f"rank {rank}: micro-batch {micro} turns the V out of order (forward chunk 0 before "
                                f"chunk 1, input gradient chunk 1 before chunk 0)")


def _channel(rank: int, ins: Instruction, p: int, placement: str) -> tuple[tuple[int, int, str], tuple[int, int]]:
    """(sender, receiver, direction) of a send or receive, and what the message is: (micro, receiving stage)."""
    stage = stage_of(rank, ins.chunk, p, placement)
    if ins.op == "send_forward":
        return (rank, ins.peer, "forward"), (ins.micro, stage + 1)
    if ins.op == "recv_forward":
        return (ins.peer, rank, "forward"), (ins.micro, stage)
    if ins.op == "send_backward":
        return (rank, ins.peer, "backward"), (ins.micro, stage - 1)
    return (ins.peer, rank, "backward"), (ins.micro, stage)  # recv_backward


def _check_channels(schedule: Schedule, p: int, placement: str) -> None:
    sent: dict[tuple, list] = defaultdict(list)
    received: dict[tuple, list] = defaultdict(list)
    for rank, program in enumerate(schedule):
        for ins in program:
            if ins.op in COMM_OPS:
                channel, message = _channel(rank, ins, p, placement)
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


def _execute(schedule: Schedule, duration, t_comm: float,
             placement: str = "loop") -> tuple[PerRankEvents, list[tuple[int, int]]]:
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
                    channel, message = _channel(rank, ins, p, placement)
                    mailbox[channel].append((message, start + t_comm))
                    end = start
                elif ins.op in ("recv_forward", "recv_backward"):
                    channel, expected = _channel(rank, ins, p, placement)
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
             t_backward_weight: float = 1.0, t_comm: float = 0.0, placement: str = "loop") -> PerRankEvents:
    """Per rank, the list of Event(start, end, instruction) when each instruction runs as soon as its rank is free
    and its input has arrived. Sends, reduce_grads and optimizer_step take no time; a receive lasts from when its
    rank reaches it to when the message arrives (t_comm after the send), i.e. it is the time spent waiting on a peer."""
    durations = {"forward": t_forward, "backward": t_backward, "backward_input": t_backward_input,
                 "backward_weight": t_backward_weight}
    timeline, stuck = _execute(schedule, lambda ins: durations.get(ins.op, 0.0), t_comm, placement)
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


def exact_bubble(timeline: PerRankEvents) -> Fraction:
    """bubble_fraction as an exact fraction, for timelines whose times are whole numbers (unit costs)."""
    compute = [event for events in timeline for event in events if event.instruction.op in COMPUTE_OPS]
    makespan = Fraction(max(e.end for e in compute)) - Fraction(min(e.start for e in compute))
    busy = sum(Fraction(e.end) - Fraction(e.start) for e in compute)
    return 1 - busy / (len(timeline) * makespan)


def overlap_violations(program: list[Instruction], pairs) -> list[str]:
    """What keeps `program` (one rank's instructions, built or recorded) from running each overlapped pair
    ((forward, micro, chunk), (backward op, micro, chunk)) of schedule.dualpipev_pairs as one: the two computations
    next to each other, the backward's receive before the forward and the forward's send before the backward, so
    that each half's messages travel while the other half computes. Empty when every pair is kept."""
    index = {(ins.op, ins.micro, ins.chunk): i for i, ins in enumerate(program)}
    problems = []
    for forward, backward in pairs:
        f_at, b_at = index.get(forward), index.get(backward)
        if f_at is None or b_at is None:
            problems.append(f"pair {forward} + {backward}: a half is missing")
            continue
        between = [ins for ins in program[f_at + 1:b_at] if ins.op in COMPUTE_OPS]
        receive = index.get(("recv_backward", backward[1], backward[2]))
        send = index.get(("send_forward", forward[1], forward[2]))
        if b_at < f_at or between:
            problems.append(f"pair {forward} + {backward}: not one after the other")
        elif receive is not None and receive > f_at:
            problems.append(f"pair {forward} + {backward}: the backward's receive waits until after the forward")
        elif send is not None and send > b_at:
            problems.append(f"pair {forward} + {backward}: the forward's send waits until after the backward")
    return problems


def peak_activations(schedule: Schedule) -> list[int]:
    """Per rank, the most (micro-batch, chunk) pairs whose forward is done and whose backward (B when split) is not:
    the activations the rank holds at its worst moment. GPipe: m; 1F1B and zb1p: p - rank; zbv 2p, dualpipev 2p+1
    (m >= 2p). For interleaved and the V's, each pair holds one chunk's activations, 1/v of what a micro-batch holds on
    a non-interleaved stage (schedule_costs.peak_activation_chunks gives them without building the schedule)."""
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
