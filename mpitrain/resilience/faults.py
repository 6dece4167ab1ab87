"""Fault injection for tests and demos: `MPITRAIN_FAULT="kill:rank=1:step=7;slow:rank=0:factor=3"`.

Each fault names a kind and where it strikes:
    kill   the rank kills itself (SIGKILL) at the start of step `step`
    hang   the rank stops (SIGSTOP, as `kill -STOP` would) at the start of step `step`
    nan    the rank's gradients become NaN in step `step`
    slow   every step of the rank takes `factor` times as long (from step `step`, default 1, to step `until`,
           default the last)
    flip   one bit of one parameter of the rank is flipped after step `step` (silent data corruption)
    gradflip
           the top exponent bit of the rank's largest gradient element flips in step `step`, after the gradient's
           reduction (a miscomputing core): the gradient norm overflows and the step is bad on that rank only
    lossnan
           the rank's own loss sum becomes NaN in step `step`, before the loss is summed over the ranks (a
           miscomputing forward): the step's loss is NaN on every rank
    enospc, edquot, erofs, eio
           the rank's write of the checkpoint of step `step` fails halfway with that error (disk full, quota
           exceeded, read-only filesystem, I/O error), as the storage would make it fail
`rank` defaults to every rank. Steps count from 1, as the console and the checkpoints do. `sticky=1` (nan,
gradflip and lossnan) makes the fault strike again each time the step is computed again in the same attempt, as a
bad node would when a bad step is replayed (resilience/attribution.py); without it a replay is spared, as a
transient fault would.

A fault strikes once per run: kill, hang, nan and flip append themselves to RUN_DIR/injected_faults.jsonl just
before they strike, and a restarted job (`mpitrain launch --max-restarts`, slurm/train.sbatch's loop, a requeue)
skips the faults it finds there, so that it can show that it recovers. Counting attempts instead would spare a
restart whose first attempt died of something else before reaching the fault (an MPI start-up failure, say).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mpitrain.errors import ConfigError
from mpitrain.profile.jsonl import append_record, read_records

STORAGE_KINDS = ("enospc", "edquot", "erofs", "eio")  # checkpoint writes that fail (resilience/inject.py)
KINDS = ("kill", "hang", "nan", "slow", "flip", "gradflip", "lossnan", *STORAGE_KINDS)
# strike once and are recorded; slow lasts
ONE_SHOT = ("kill", "hang", "nan", "flip", "gradflip", "lossnan", *STORAGE_KINDS)
STICKY_KINDS = ("nan", "gradflip", "lossnan")  # faults inside a step's computation, which a replay computes again
ENV_VAR = "MPITRAIN_FAULT"
RECORD_FILE = "injected_faults.jsonl"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None  # None: every rank
    step: int | None = None  # None: every step (slow), else the step (from 1) it strikes at
    factor: float = 1.0      # slow only
    sticky: bool = False     # nan, gradflip: strikes every computation of the step in this attempt (a bad node)
    until: int | None = None  # slow only: the last step it slows (None: the run's last)

    def strikes(self, rank: int, step: int) -> bool:
        """Does this fault strike `rank` at `step` (counted from 1)?"""
        if self.rank is not None and self.rank != rank:
            return False
        if self.kind == "slow":
            return (self.step or 1) <= step <= (self.until or step)
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
            if not sep or key not in ("rank", "step", "factor", "sticky", "until"):
                raise ConfigError(f"{ENV_VAR}: {field!r} in {piece!r} is not rank=N, step=N, factor=X, until=N or "
                                  f"sticky=1")
            try:
                values[key] = float(value) if key == "factor" else int(value)
            except ValueError:
                raise ConfigError(f"{ENV_VAR}: {key} in {piece!r} must be a number, not {value!r}") from None
        if kind != "slow" and "step" not in values:
            raise ConfigError(f"{ENV_VAR}: {piece!r} needs step=N (the step it strikes at, from 1)")
        if kind == "slow" and values.get("factor", 1.0) < 1.0:
            raise ConfigError(f"{ENV_VAR}: factor in {piece!r} must be at least 1")
        if values.get("sticky") and kind not in STICKY_KINDS:
            raise ConfigError(f"{ENV_VAR}: sticky in {piece!r} is for {', '.join(STICKY_KINDS)} only")
        if "until" in values and kind != "slow":
            raise ConfigError(f"{ENV_VAR}: until in {piece!r} is for slow only")
        faults.append(Fault(kind, values.get("rank"), values.get("step"), values.get("factor", 1.0),
                            bool(values.get("sticky", 0)), values.get("until")))
    return faults


class FaultPlan:
    """The faults that strike this rank. Empty (and free) unless MPITRAIN_FAULT is set. `record`: the file where
    struck faults are kept (RUN_DIR/injected_faults.jsonl), or None to keep them in memory only."""

    def __init__(self, faults: list[Fault], rank: int, record: Path | None = None):
        struck = _struck_before(record, rank)
        self.faults = [f for f in faults if (f.rank is None or f.rank == rank) and (f.kind, f.step) not in struck]
        self.rank = rank
        self.record = record
        self._sticky_struck: set[Fault] = set()

    @classmethod
    def from_environment(cls, rank: int, run_dir: Path | None = None, environ=os.environ) -> FaultPlan:
        text = environ.get(ENV_VAR, "")
        record = Path(run_dir) / RECORD_FILE if run_dir is not None else None
        return cls(parse_faults(text) if text else [], rank, record)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def due(self, kind: str, step: int) -> Fault | None:
        """The fault of this kind that strikes this rank at `step` (from 1), if any. A one-shot fault is used up
        (and recorded) by the call that returns it: call this right before striking. A sticky one is recorded once
        and stays, for the step's replays."""
        for fault in self.faults:
            if fault.kind == kind and fault.strikes(self.rank, step):
                if kind in ONE_SHOT and fault not in self._sticky_struck:
                    self._write_record(fault)
                if fault.sticky:
                    self._sticky_struck.add(fault)
                elif kind in ONE_SHOT:
                    self.faults.remove(fault)
                return fault
        return None

    def _write_record(self, fault: Fault) -> None:
        if self.record is not None:  # durable: on disk before a kill or a stop strikes
            append_record(self.record, {"kind": fault.kind, "rank": self.rank, "step": fault.step}, durable=True)


def _struck_before(record: Path | None, rank: int) -> set[tuple[str, int]]:
    """(kind, step) of the faults this rank recorded in an earlier attempt of the run."""
    if record is None:
        return set()
    return {(entry.get("kind"), entry.get("step")) for entry in read_records(record) if entry.get("rank") == rank}
