"""Frozen tensors (`ParamSpec.trainable = False`, e.g. LoRA's base weights), held by every state strategy beside its
trainable tensors.

A strategy keeps them whole on every rank in the compute dtype and hands them to the model with the unit's trainable
tensors; they get no gradient buffer, no master copy, no optimizer state and no reduction: the rest of the strategy
only ever sees the trainable tensors. Checkpoints save them once (`ShardLayout.frozen`).
"""
from __future__ import annotations

from mpitrain.state.params import FlatBuffer, UnitLayout, initialise


def split_frozen(layouts: list[UnitLayout]) -> tuple[list[UnitLayout], list[UnitLayout] | None]:
    """(trainable layouts, frozen layouts); the layouts themselves and None when nothing is frozen."""
    if all(spec.trainable for layout in layouts for spec in layout.specs):
        return layouts, None
    return ([UnitLayout(layout.name, [s for s in layout.specs if s.trainable]) for layout in layouts],
            [UnitLayout(layout.name, [s for s in layout.specs if not s.trainable]) for layout in layouts])


def hold_frozen(layouts: list[UnitLayout], backend, seed: int | None) -> tuple[list[UnitLayout], FlatBuffer | None]:
    """(the trainable layouts, the frozen tensors in one buffer of the compute dtype or None when nothing is frozen).
    seed None: the frozen tensors are left at zero for the caller to fill (generation from a checkpoint)."""
    trainable, frozen_layouts = split_frozen(layouts)
    if frozen_layouts is None:
        return trainable, None
    frozen = FlatBuffer.allocate(frozen_layouts, backend.xp, backend.dtype)
    if seed is not None:
        initialise(frozen, seed, backend)
    return trainable, frozen


def with_frozen(unit_views: list[dict], frozen: FlatBuffer | None) -> list[dict]:
    """Each unit's trainable views with its frozen ones beside them: what the model asks for."""
    return unit_views if frozen is None else [{**mine, **held} for mine, held in zip(unit_views, frozen.views)]


def frozen_nbytes(frozen: FlatBuffer | None) -> int:
    return 0 if frozen is None else int(frozen.data.nbytes)
