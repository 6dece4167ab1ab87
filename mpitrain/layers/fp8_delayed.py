"""Delayed scaling (precision.fp8 = "delayed"): an operand's amax history, the end of a step that reduces and rolls
the histories, and the histories in checkpoints, the extra state beside the tensors (checkpoint/manager.py), named by
unit, linear, weight and global expert index so that any layout restores them. Each `gemms` entry is a
mpitrain/layers/fp8.py Fp8Gemms."""
from __future__ import annotations

import numpy as np


class DelayedScaling:
    """Transformer Engine's delayed scaling of one tensor role: the scale of a step comes from the max of the amaxes
    of the previous `history` steps (amax_compute_algo "max", margin 0); this step's amax (the max over its calls,
    reduced over the ranks by the caller) is recorded and enters the window when the step ends (`roll`).
    An empty history (the first step) uses the current amax instead of TE's initial scale 1, so a first step with
    |x| > 448 is not clipped."""

    def __init__(self, history: int):
        self.history = np.zeros(history, dtype=np.float32)  # newest first, like TE's amax_history rows
        self.filled = 0
        self.current = 0.0  # this step's amax so far

    def amax_for(self, x_amax: float, record: bool = True) -> float:
        """The amax whose scale quantizes a tensor of amax x_amax in this step (recording x_amax unless `record` is
        False: a forward outside training reads the scales and leaves the history alone)."""
        if record:
            self.current = max(self.current, x_amax)
        return float(self.history[:self.filled].max()) if self.filled else x_amax

    def roll(self, step_amax: float | None = None) -> None:
        """End of step: the step's amax (default: `current`; the caller passes it reduced over the data ranks)
        becomes the newest history entry, the oldest drops out."""
        self.history = np.roll(self.history, 1)
        self.history[0] = self.current if step_amax is None else step_amax
        self.filled = min(self.filled + 1, self.history.size)
        self.current = 0.0


def end_delayed_step(gemms: list, groups: dict) -> None:
    """End of a training step under delayed scaling: each operand's step amax, the max over the ranks holding the
    same weights (`groups[g.data_group]`: data and context parallel, for experts the expert data-parallel group; tp
    was reduced call by call), enters its history. One all-reduce per group kind, in a fixed order."""
    for kind in ("dp_cp", "expert_dp"):
        histories = [g.delayed[key] for g in gemms if g.data_group == kind for key in sorted(g.delayed)]
        if not histories:
            continue
        amaxes = np.array([h.current for h in histories], dtype=np.float64)
        group = groups.get(kind)
        if group is not None and group.size > 1:
            group.all_reduce(amaxes, "max")
        for history, amax in zip(histories, amaxes):
            history.roll(float(amax))


def delayed_state(gemms: list, recipe: str, pp_group=None) -> dict:
    """{"fp8_amax_history": {operand: [amax, newest first]}} of this stage, gathered over `pp_group` (collective on
    every pipeline rank when the recipe is "delayed") so that the index rank 0 writes holds every stage's. Names are
    global (unit, linear, weight, expert index), so any layout restores them; {} for the other recipes."""
    if recipe != "delayed":
        return {}
    own = {f"{g.name}.{key}": [float(a) for a in h.history[:h.filled]] for g in gemms for key, h in g.delayed.items()}
    if pp_group is not None and pp_group.size > 1:
        stages = pp_group.gather_object(own)
        if stages is not None:
            own = {name: values for stage in stages for name, values in stage.items()}
    return {"fp8_amax_history": own}


def load_delayed_state(gemms: list, extra: dict) -> None:
    """Restore this stage's histories from a checkpoint's extra state (a window of another length keeps its newest
    entries); operands the checkpoint lacks start empty."""
    saved = extra.get("fp8_amax_history", {})
    for g in gemms:
        prefix = g.name + "."
        for name, values in saved.items():
            if name.startswith(prefix):
                history = g._history(name[len(prefix):])
                kept = values[:history.history.size]
                history.history[:] = 0.0
                history.history[:len(kept)] = kept
                history.filled, history.current = len(kept), 0.0
