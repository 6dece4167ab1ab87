"""Fault injection for tests and demos: `MPITRAIN_FAULT="kill:rank=1:step=7;slow:rank=0:factor=3"`.

Each fault names a kind and where it strikes:
    kill   the rank kills itself (SIGKILL) at the start of step `step`
    hang   the rank stops (SIGSTOP, as `kill -STOP` would) at the start of step `step`
    nan    the rank's gradients become NaN in step `step`
    slow   every step of the rank takes `factor` times as long (from step `step`, default 1)
    flip   one bit of one parameter of the rank is flipped after step `step` (silent data corruption)
`rank` defaults to every rank. Steps count from 1, as the console and the checkpoints do.

A fault strikes in the first attempt of a job only (MPITRAIN_ATTEMPT, set by `mpitrain launch --max-restarts` and
slurm/train.sbatch, or SLURM_RESTART_COUNT after a requeue, is 0), so that a restarted job can show that it recovers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from mpitrain.errors import ConfigError

KINDS = ("kill", "hang", "nan", "slow", "flip")
ENV_VAR = "MPITRAIN_FAULT"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None  # None: every rank
    step: int | None = None  # None: every step (slow), else the step (from 1) it strikes at
    factor: float = 1.0      # slow only

    def strikes(self, rank: int, step: int) -> bool:
        """Does this fault strike `rank` at `step` (counted from 1)?"""
        if self.rank is not None and self.rank != rank:
            return False
        if self.kind == "slow":
            return step >= (self.step or 1)
        return self.step == step


def parse_faults(text: str) -> list[Fault]:
    """Faults separated by ';' (or ','), each KIND[:key=value...]; a mistake names the faulty piece."""
    faults = []
    for piece in text.replace(",", ";").split(";"):
        piece = piece.strip()
        if not piece:
            continue
        kind, *fields = piece.split(":")
        if kind not in KINDS:
            raise ConfigError(f"{ENV_VAR}: unknown fault {kind!r} in {piece!r}; choose one of {', '.join(KINDS)}")
        values = {}
        for field in fields:
            key, sep, value = field.partition("=")
            if not sep or key not in ("rank", "step", "factor"):
                raise ConfigError(f"{ENV_VAR}: {field!r} in {piece!r} is not rank=N, step=N or factor=X")
            try:
                values[key] = float(value) if key == "factor" else int(value)
            except ValueError:
                raise ConfigError(f"{ENV_VAR}: {key} in {piece!r} must be a number, not {value!r}") from None
        if kind != "slow" and "step" not in values:
            raise ConfigError(f"{ENV_VAR}: {piece!r} needs step=N (the step it strikes at, from 1)")
        if kind == "slow" and values.get("factor", 1.0) < 1.0:
            raise ConfigError(f"{ENV_VAR}: factor in {piece!r} must be at least 1")
        faults.append(Fault(kind, values.get("rank"), values.get("step"), values.get("factor", 1.0)))
    return faults


def current_attempt(environ=os.environ) -> int:
    """0 for a job's first run; the restart count after `launch --max-restarts`, sbatch's loop or a requeue."""
    return int(environ.get("MPITRAIN_ATTEMPT") or environ.get("SLURM_RESTART_COUNT") or 0)


class FaultPlan:
    """The faults that strike this rank. Empty (and free) unless MPITRAIN_FAULT is set in the first attempt."""

    def __init__(self, faults: list[Fault], rank: int):
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]
        self.rank = rank

    @classmethod
    def from_environment(cls, rank: int, environ=os.environ) -> FaultPlan:
        text = environ.get(ENV_VAR, "")
        if not text or current_attempt(environ) > 0:
            return cls([], rank)
        return cls(parse_faults(text), rank)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def due(self, kind: str, step: int) -> Fault | None:
        """The fault of this kind that strikes this rank at `step` (from 1), if any."""
        for fault in self.faults:
            if fault.kind == kind and fault.strikes(self.rank, step):
                return fault
        return None
