"""Delayed scaling's amax histories in checkpoints: the extra state beside the tensors (checkpoint/manager.py),
named by unit, linear, weight and global expert index so that any layout restores them. Each `gemms` entry is a
mpitrain/layers/fp8.py Fp8Gemms."""
from __future__ import annotations


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
