"""How often to checkpoint: the Young/Daly interval from the measured save time and the machines' MTBF.

Saving every tau seconds costs save_time / tau of the run; a failure, arriving on average every MTBF seconds, throws
away on average half an interval of work, tau / (2 MTBF). The sum is smallest at tau = sqrt(2 x save_time x MTBF)
(Young 1974; Daly 2006 adds higher-order terms that matter only when save_time is a sizeable part of the MTBF), where
the fraction of time lost is sqrt(2 x save_time / MTBF). Restart time (start-up, loading) adds restart / MTBF on top,
whatever the interval, so it is left out of the choice.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from mpitrain.checkpoint.store import INDEX, committed_checkpoints


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Seconds of training between checkpoints that lose the least time: sqrt(2 x save time x MTBF)."""
    if save_seconds < 0 or mtbf_seconds <= 0:
        raise ValueError(f"need save time >= 0 and MTBF > 0, got {save_seconds} and {mtbf_seconds}")
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def fraction_lost(interval_seconds: float, save_seconds: float, mtbf_seconds: float) -> float:
    """Expected fraction of wall time lost to saving (save / interval) and to redone work (interval / (2 MTBF))."""
    if interval_seconds <= 0:
        raise ValueError(f"the checkpoint interval must be > 0 seconds, got {interval_seconds}")
    return save_seconds / interval_seconds + interval_seconds / (2.0 * mtbf_seconds)


@dataclass(frozen=True)
class Advice:
    interval_seconds: float   # the Young/Daly interval
    interval_steps: int       # the same in whole steps (at least 1)
    fraction_lost: float      # expected, at that interval
    current_fraction_lost: float | None  # expected at checkpoint.every (None: no periodic checkpoints)

    def line(self, save_seconds: float, mtbf_hours: float, every: int) -> str:
        text = (f"checkpoint advice: saving takes {save_seconds:.2f} s and fault.mtbf_hours = {mtbf_hours:g}: "
                f"save every {self.interval_steps} steps ({self.interval_seconds:,.0f} s, Young/Daly "
                f"sqrt(2 x save x MTBF)) to lose {100 * self.fraction_lost:.2f}% of the time")
        if self.current_fraction_lost is not None:
            text += f"; checkpoint.every = {every} loses {100 * self.current_fraction_lost:.2f}%"
        else:
            text += "; checkpoint.every = 0 saves only at the end and on a stop request"
        return text


def advise(save_seconds: float, step_seconds: float, mtbf_hours: float, every: int) -> Advice:
    """The advice for a run whose save takes save_seconds and step takes step_seconds; every = checkpoint.every."""
    mtbf = mtbf_hours * 3600.0
    interval = young_daly_interval(save_seconds, mtbf)
    steps = max(1, round(interval / step_seconds)) if step_seconds > 0 else 1
    current = fraction_lost(every * step_seconds, save_seconds, mtbf) if every > 0 and step_seconds > 0 else None
    return Advice(interval, steps, fraction_lost(interval, save_seconds, mtbf) if interval > 0 else 0.0, current)


class AdviceReporter:
    """Prints the advice once (logging rank), as soon as a save time and a step time are known: at the first step
    of a resumed run (the save time recorded in the checkpoint it resumed from), else after the first save."""

    def __init__(self, mtbf_hours: float, every: int, echo):
        self.mtbf_hours, self.every, self.echo = mtbf_hours, every, echo
        self.done = mtbf_hours <= 0

    def observe(self, step_seconds: float, checkpoint_dir: Path) -> None:
        if self.done:
            return
        save_seconds = newest_save_seconds(checkpoint_dir)
        if save_seconds is None:
            return
        self.done = True
        self.echo(advise(save_seconds, step_seconds, self.mtbf_hours, self.every)
                  .line(save_seconds, self.mtbf_hours, self.every))


def newest_save_seconds(checkpoint_dir: Path) -> float | None:
    """The save duration recorded in the newest committed checkpoint's index (None: none, or none recorded)."""
    for path in reversed(committed_checkpoints(checkpoint_dir)):
        try:
            seconds = json.loads((path / INDEX).read_text()).get("save_seconds")
        except (OSError, ValueError):
            continue
        if seconds is not None:
            return float(seconds)
    return None
