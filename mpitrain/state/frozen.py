"""Frozen tensors (`ParamSpec.trainable = False`, e.g. LoRA's base weights) beside any state strategy.

They are held whole on every rank in the compute dtype and handed to the model with the unit's trainable tensors;
they get no gradient buffer, no master copy, no optimizer state and no reduction: the wrapped strategy only ever sees
the trainable tensors. Checkpoints save them once (`ShardLayout.frozen`).
"""
from __future__ import annotations

from dataclasses import replace

from mpitrain.state.params import FlatBuffer, UnitLayout
from mpitrain.state.replicated import initialise
from mpitrain.state.strategy import ShardLayout, StateStrategy


def split_frozen(layouts: list[UnitLayout]) -> tuple[list[UnitLayout], list[UnitLayout] | None]:
    """(trainable layouts, frozen layouts); the layouts themselves and None when nothing is frozen."""
    if all(spec.trainable for layout in layouts for spec in layout.specs):
        return layouts, None
    return ([UnitLayout(layout.name, [s for s in layout.specs if s.trainable]) for layout in layouts],
            [UnitLayout(layout.name, [s for s in layout.specs if not s.trainable]) for layout in layouts])


class WithFrozen(StateStrategy):
    def __init__(self, inner: StateStrategy, frozen_layouts: list[UnitLayout], backend, seed: int | None):
        self.inner, self.group, self.sharded = inner, inner.group, inner.sharded
        self.reduces_every_micro_batch = inner.reduces_every_micro_batch
        self.frozen = FlatBuffer.allocate(frozen_layouts, backend.xp, backend.dtype)
        if seed is not None:
            initialise(self.frozen, seed, backend)

    def acquire(self, unit: int, phase: str) -> dict:
        return {**self.inner.acquire(unit, phase), **self.frozen.views[unit]}

    def release(self, unit: int, phase: str) -> None:
        self.inner.release(unit, phase)

    def grad_views(self, unit: int) -> dict:
        return self.inner.grad_views(unit)

    def unit_done(self, unit: int) -> None:
        self.inner.unit_done(unit)

    def zero_grads(self) -> None:
        self.inner.zero_grads()

    def begin_micro_batch(self, last: bool) -> None:
        self.inner.begin_micro_batch(last)

    def finish(self) -> None:
        self.inner.finish()

    def grad_sq_sums(self) -> dict:
        return self.inner.grad_sq_sums()

    def reduced_grad_window(self, unit: int):
        return self.inner.reduced_grad_window(unit)

    def optimizer_segments(self) -> list:
        return self.inner.optimizer_segments()

    def after_step(self) -> None:
        self.inner.after_step()

    def checkpoint_layout(self) -> ShardLayout:
        return replace(self.inner.checkpoint_layout(), frozen=self.frozen)

    def after_restore(self) -> None:
        self.inner.after_restore()

    def memory(self) -> dict:
        held = self.inner.memory()
        return {**held, "params": held["params"] + int(self.frozen.data.nbytes)}
