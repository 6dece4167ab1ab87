"""The interface every parameter/gradient state offers (replicated.py, zero.py), and what they share.

A state decides where a rank's parameters (compute dtype), gradients (compute dtype), master weights (fp32 when the
compute dtype is lower, else the parameters themselves) live, and how gradients are reduced. The model calls the
first four methods during forward/backward; the trainer, the pipeline and the checkpoints call the rest.

Everything a state does per tensor comes from the tensor's `ParamSpec` (state/params.py): the gradient norm's split
(`norm_groups`), the decayed ranges, tied copies (`tied_to`: counted once, by the owner).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np

from mpitrain.state.params import FlatBuffer


@dataclass
class Segment:
    """A piece of the master weights the optimizer updates: a 1-D parameter view, its gradient view and the ranges
    inside it that get weight decay. Plain data parallelism hands the optimizer one (the whole flat buffer), ZeRO one
    per part (this rank's shard of it)."""
    params: object  # 1-D view, updated in place
    grads: object  # 1-D view of the same length
    decay_ranges: list[tuple[int, int]]  # [start, end) within this segment


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's master weights and optimizer state sit in the flat geometry of the trainable tensors: what
    checkpoints save and restore (checkpoint/pieces.py), what the lean optimizers cut into quantization blocks
    (optim/blocks.py) and what the replica check compares (resilience/sdc.py). The optimizer's code needs only the
    geometry and the segment windows."""
    geometry: FlatBuffer  # padding included (ZeRO: one part per unit and reduction group)
    segment_windows: list[tuple[int, int]]  # [start, end) in `geometry` of each optimizer segment, in their order
    # (start, end, array, offset in array) of the master weights this rank holds, in geometry coordinates
    param_windows: list[tuple[int, int, object, int]] = field(default_factory=list)
    params_dp_replicated: bool = True  # every rank of the reduction group holds the same param windows...
    moments_dp_replicated: bool = True  # ... and the same optimizer state
    segment_groups: list | None = None  # the group that shards each segment (ZeRO); None: none is sharded
    frozen: FlatBuffer | None = None  # the trainable = False tensors' geometry (whole on every rank: saved once)...
    frozen_windows: list | None = None  # ... or (start, end, array, offset) of this rank's shards (ZeRO-3)

    @property
    def shard_copies(self) -> tuple[int, int]:
        """(how many ranks hold the same shards, which of them this rank is): one copy per node under
        parallel.zero_shard = 'node' (comm/two_level.py NodeShardGroup), else (1, 0). A checkpoint writes one."""
        return getattr((self.segment_groups or [None])[0], "copies", (1, 0))


class StateStrategy(abc.ABC):
    group: object  # the data-parallel group gradients are reduced over (None: a single process)
    sharded: bool  # gradients (and optimizer state) are split over `group`: scalar sums must be added up over it
    # True: every micro-batch's gradients are reduced (and freed) as its backward finishes them, so `unit_done` must
    # be called after each; False: they accumulate locally and only the last micro-batch's `unit_done` reduces
    reduces_every_micro_batch: bool
    # the trainable = False tensors when whole on every rank (state/frozen.py); None: none, or sharded (ZeRO-3)
    frozen: FlatBuffer | None

    # -- what the model calls
    @abc.abstractmethod
    def acquire(self, unit: int, phase: str) -> dict:
        """Parameter views of `unit` (compute dtype) for `phase` ("forward" | "backward")."""

    @abc.abstractmethod
    def release(self, unit: int, phase: str) -> None:
        """The unit's last reader in `phase` is done with its parameters."""

    @abc.abstractmethod
    def frozen_changed(self, unit: int) -> None:
        """The caller changed `unit`'s frozen tensors in place, in the views `acquire` gave, alike on every rank (the
        routing biases): make the change stick."""

    @abc.abstractmethod
    def grad_views(self, unit: int) -> dict:
        """Gradient views of `unit` (compute dtype) that backward adds into."""

    @abc.abstractmethod
    def unit_done(self, unit: int) -> None:
        """`unit`'s gradients for this micro-batch are complete: a reduction may start."""

    # -- what the trainer calls, in step order
    @abc.abstractmethod
    def zero_grads(self) -> None: ...

    @abc.abstractmethod
    def begin_micro_batch(self, last: bool) -> None: ...

    @abc.abstractmethod
    def finish(self) -> None:
        """Wait for every reduction: the reduced gradients are ready for the norm and the optimizer."""

    @abc.abstractmethod
    def grad_sq_sums(self) -> dict[tuple[str, ...], float]:
        """Sums of squared reduced gradients by `ParamSpec.norm_groups` (the mesh groups the caller still sums
        each over), already summed over this state's group when sharded; tied copies left out."""

    @abc.abstractmethod
    def reduced_grad_window(self, unit: int):
        """(geometry, (start, end) in it, values): the reduced gradient of `unit` this rank holds after finish()."""

    @abc.abstractmethod
    def optimizer_segments(self) -> list[Segment]:
        """Segments over the master weights this rank updates, with their reduced gradients."""

    @abc.abstractmethod
    def after_step(self) -> None:
        """The master weights were updated: refresh the compute-dtype parameters (and gather them where sharded)."""

    @abc.abstractmethod
    def checkpoint_layout(self) -> ShardLayout:
        """Where this rank's master weights and optimizer state sit in the flat geometry."""

    @abc.abstractmethod
    def after_restore(self) -> None:
        """A checkpoint was loaded into the master weights and moments: derive everything else from them."""

    @abc.abstractmethod
    def memory(self) -> dict:
        """Bytes of the arrays kept between steps: params, grads, master (0 when the params are the master)."""


def squared_sum(flat, ranges: list[tuple[int, int]]) -> float:
    """Sum of squares over the ranges; low-precision values are widened to fp32 first (bf16 has no BLAS)."""
    total = 0.0
    for a, b in ranges:
        piece = flat[a:b]
        if piece.dtype.itemsize < 4:
            piece = piece.astype(np.float32)
        total += piece @ piece
    return float(total)


def norm_ranges(geometry) -> dict[tuple[str, ...], list[tuple[int, int]]]:
    """Flat ranges of `geometry` by norm_groups, for the trainable tensors that are no tied copy."""
    keys = sorted({spec.norm_groups for layout in geometry.layouts for spec in layout.specs})
    return {key: geometry.ranges(lambda spec, k=key: spec.norm_groups == k and spec.trainable and not spec.tied_to)
            for key in keys}


def add_up(sums: list[dict]) -> dict:
    total: dict = {}
    for part in sums:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total


def reduction_group(layouts, mesh):
    """The mesh group that sums the gradients, named by the tensors' `reduce_over`. Experts under expert
    parallelism ("expert_dp") are reduced (and ZeRO-sharded) beside it over their own group
    (`other_reduction_groups`); any other mix is refused."""
    names = sorted({spec.reduce_over for layout in layouts for spec in layout.specs} - {"expert_dp"} or {"dp"})
    if len(names) > 1:
        raise NotImplementedError(f"tensors reduce their gradients over several groups {names}; one is supported")
    return getattr(mesh, names[0])


def other_reduction_groups(layouts, mesh) -> dict:
    """{reduce_over name: group} of the tensors reduced apart from the main group (experts: "expert_dp")."""
    names = {spec.reduce_over for layout in layouts for spec in layout.specs} & {"expert_dp"}
    return {name: getattr(mesh, name) for name in names}
