"""Pipeline instructions, the pieces every schedule is built of (the schedules are in parallel/schedule.py and
parallel/schedule_v.py): the `Instruction`, where each virtual stage lives (placement), and the receive-compute-send
groups of one forward or backward. Nothing here talks to MPI.

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
    backward_input(micro, chunk)       split backward (zb1p, zbv, dualpipev): the input gradient alone ("B"),
                                       keeping what backward_weight needs
    backward_weight(micro, chunk)      the weight gradients ("W") of a micro-batch whose B is done; frees it
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
V_KINDS = ("zbv", "dualpipev")  # the schedules that place two chunks per rank in a V


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
    """How schedule `kind` places virtual stages on ranks: "v" for zbv and dualpipev, "loop" (round-robin) for the
    others."""
    return "v" if kind in V_KINDS else "loop"


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

def forward_steps(rank: int, micro: int, p: int, v: int = 1, chunk: int = 0,
                  placement: str = "loop") -> list[Instruction]:
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
            for step in forward_steps(rank, micro, p, v, chunk, placement)]


def backward_steps(rank: int, micro: int, p: int, v: int = 1, chunk: int = 0, op: str = "backward",
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


def finish_steps() -> list[Instruction]:
    return [Instruction("reduce_grads"), Instruction("optimizer_step")]


def check_schedule_args(kind: str, p: int, m: int, v: int) -> None:
    """Refuse a schedule that cannot be built, naming the config key to change."""
    if kind not in SCHEDULE_KINDS:
        raise ScheduleArgumentError(f"parallel.schedule must be one of {', '.join(SCHEDULE_KINDS)}; got {kind!r}")
    for key, value in (("parallel.pp", p), ("parallel.microbatches", m), ("parallel.virtual_stages", v)):
        positive_degree(key, value, ScheduleArgumentError)
    if kind in V_KINDS and v != 2:
        raise ScheduleArgumentError(f"parallel.schedule = {kind!r} runs two model chunks per rank in a V; set "
                                    f"parallel.virtual_stages = 2 (got {v})")
    if v > 1 and kind not in ("interleaved",) + V_KINDS:
        raise ScheduleArgumentError(f"parallel.virtual_stages = {v} needs parallel.schedule = 'interleaved', "
                                    f"'zbv' or 'dualpipev' (got {kind!r}); set parallel.virtual_stages = 1 or "
                                    f"change the schedule")
    if kind == "interleaved" and v > 1 and m % p:
        raise ScheduleArgumentError(
            f"interleaved schedule needs parallel.microbatches ({m}) divisible by parallel.pp ({p}); "
            f"use a multiple of {p}, e.g. {m + (-m) % p}")
    if kind == "dualpipev" and m < 2 * p:
        raise ScheduleArgumentError(
            f"parallel.schedule = 'dualpipev' needs at least 2 * parallel.pp = {2 * p} micro-batches per step (got "
            f"{m}): raise train.global_batch or lower train.micro_batch")
