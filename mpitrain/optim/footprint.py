"""Bytes of the lean optimizers' state on one rank, from the layout alone (what `mpitrain memory` prints for
optim.name = adafactor | adam8bit | sgd). Counted over the same segments the trainer hands the optimizer: the whole
flat buffer at ZeRO-0, rank 0's shard of every unit (padded to multiples of N) from ZeRO-1 on; Adafactor keeps the
whole row and column vectors of every matrix the shard holds a piece of (tests/test_optimizers.py checks a run).
"""
from __future__ import annotations

import numpy as np

from mpitrain.backend import COMPUTE_DTYPES
from mpitrain.optim import quant4
from mpitrain.optim.adam8bit import BLOCK
from mpitrain.optim.blocks import block_count, segment_runs
from mpitrain.optim.exchange import factored, segment_pieces
from mpitrain.state.params import FlatBuffer
from mpitrain.state.strategy import ShardLayout


def segment_windows(layouts, zero: int, dp: int) -> tuple[FlatBuffer, list[tuple[int, int]]]:
    """The geometry and rank 0's optimizer segments, as ReplicatedState / ZeroState cut them."""
    if zero == 0:
        geometry = FlatBuffer.geometry(layouts)
        return geometry, [(0, geometry.size)]
    geometry = FlatBuffer.geometry(layouts, align=dp)
    return geometry, [(geometry.offsets[u], geometry.offsets[u] + (geometry.offsets[u + 1] - geometry.offsets[u]) // dp)
                      for u in range(len(layouts))]


def lean_state_bytes(name: str, layouts, zero: int, dp: int, itemsize: int, momentum: float = 0.9,
                     adafactor_beta1: float = 0.9, adafactor_momentum: str = "int4") -> int:
    """Bytes of optimizer state (no master weights) for optim.name = name; itemsize: the state dtype's."""
    geometry, windows = segment_windows(layouts, zero, dp)
    sizes = [b - a for a, b in windows]
    if name == "sgd":
        return itemsize * sum(sizes) if momentum else 0
    if name == "adam8bit":  # codes for every element (padding too), scales for each tensor's blocks it overlaps
        runs = segment_runs(ShardLayout(geometry, windows))
        return 2 * sum(sizes) + 2 * itemsize * sum(block_count(held, BLOCK) for held in runs)
    if name == "adafactor":
        pieces = [p for held in segment_pieces(ShardLayout(geometry, windows)) for p in held]
        matrices = {p.tensor: p.shape for p in pieces if factored(p.shape)}
        elementwise = sum(p.size for p in pieces if not factored(p.shape))
        second_moment = itemsize * (sum(sum(shape) for shape in matrices.values()) + elementwise)
        if not adafactor_beta1:
            return second_moment
        if adafactor_momentum == "int4":  # packed codes per segment, scales for each tensor's blocks
            runs = segment_runs(ShardLayout(geometry, windows))
            return second_moment + sum(quant4.packed_size(n) + itemsize * block_count(held, quant4.BLOCK)
                                       for n, held in zip(sizes, runs))
        return second_moment + itemsize * sum(sizes)
    raise ValueError(f"no lean state for optim.name = {name!r}")


FORMULAS = {"sgd": "momentum: s*Psi", "adam8bit": "moments 1 + 1 byte + 2 scales per 2048 of each tensor: ~2*Psi",
            "adafactor": "row + column statistics of matrices, s per element elsewhere, + first moment "
                         "(optim.adafactor_beta1 > 0): 0.5*Psi + s per 128 (int4) or s*Psi (full)"}


def optimizer_row(cfg, layouts) -> tuple[int, str] | None:
    """(bytes, formula) of the optimizer row of `mpitrain memory` for a lean optimizer (None for adamw): master
    weights (fp32, when the compute dtype is lower) + the optimizer's state, on rank 0."""
    name = cfg.optim.name
    if name == "adamw":
        return None
    p, e = cfg.parallel, np.dtype(COMPUTE_DTYPES[cfg.precision.compute]).itemsize
    itemsize = 4 if e < 4 else e  # the state's dtype: the master weights' (fp32 under bf16/fp16)
    state = lean_state_bytes(name, layouts, p.zero, p.dp, itemsize, cfg.optim.momentum, cfg.optim.adafactor_beta1,
                             cfg.optim.adafactor_momentum)
    _, windows = segment_windows(layouts, p.zero, p.dp)
    master = 4 * sum(b - a for a, b in windows) if e < 4 else 0
    n = sum(b - a for a, b in windows)  # the parameters this rank's optimizer updates
    formula = f"{name}: {FORMULAS[name]}, {state / max(n, 1):.3f} bytes per parameter"
    return master + state, formula + (" + fp32 master 4" if master else "") + (", sharded /N" if p.zero else "")
