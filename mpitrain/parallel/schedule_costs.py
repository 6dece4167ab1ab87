"""What a pipeline schedule costs, as closed formulas of (kind, p, m, v) that need no schedule built: the bubble, the
activations each rank holds at its peak and the messages a micro-batch sends. The planner (mpitrain/plan/) calls
these; tests/test_dualpipev.py checks each against the schedule itself (schedule_analysis: simulate, peak_activations,
the send instructions), for every kind over a grid of (p, m).
"""
from __future__ import annotations

from fractions import Fraction

from mpitrain.parallel.schedule import V_KINDS, bubble_formula, check_schedule_args


def bubble(kind: str, p: int, m: int, v: int = 1) -> Fraction:
    """Idle / (ranks x makespan) with unit costs (schedule.bubble_formula, where each formula is derived)."""
    return bubble_formula(kind, p, m, v)


def peak_activation_chunks(kind: str, p: int, m: int, v: int = 1) -> list[int]:
    """Per pipeline rank, the most (micro-batch, chunk) pairs holding saved activations at once, from a forward to
    its backward (its B when split). A chunk is 1/v of a rank's layers (v = 2 for zbv and dualpipev), so p - r
    whole-stage micro-batches of 1f1b weigh as much as 2(p - r) chunks of a V.

        gpipe          m                            every forward before the first backward
        1f1b, zb1p     min(p - r, m)                the warm-up's p-r-1 forwards and one more
        interleaved    min(2(p-r-1) + (v-1)p + 1, vm)   Megatron's longer warm-up
        zbv            min(2p, m + r + 1, 2m)       2p for m >= 2p - 1: 1f1b's p micro-batches on every rank
        dualpipev      2p + 1                       DualPipe's PP + 1 with PP = 2p stages, on every rank
    """
    check_schedule_args(kind, p, m, v)
    if kind == "gpipe":
        return [m] * p
    if kind in ("1f1b", "zb1p"):
        return [min(p - rank, m) for rank in range(p)]
    if kind == "interleaved":
        return [min(2 * (p - rank - 1) + (v - 1) * p + 1, v * m) if v > 1 else min(p - rank, m) for rank in range(p)]
    if kind == "zbv":
        return [min(2 * p, m + rank + 1, 2 * m) for rank in range(p)]
    return [2 * p + 1] * p


def messages_per_micro_batch(kind: str, p: int, v: int = 1) -> int:
    """Point-to-point messages one micro-batch sends over the whole pipeline, activations forward and gradients
    back, each of (micro_batch, T, d_model) values: one each way per boundary between stages on different ranks.

        loop placement (gpipe, 1f1b, zb1p: v = 1; interleaved)   2(vp - 1)   p = 1 with v > 1: to itself
        V placement (zbv, dualpipev)                              4(p - 1)    the turn on the last rank is in memory

    So a V sends twice 1f1b's 2(p-1) per micro-batch (as interleaved with v = 2 does, less its two turn messages)."""
    check_schedule_args(kind, p, 2 * p, v)  # the count does not depend on m: 2p micro-batches suit every kind
    if kind in V_KINDS:
        return 4 * (p - 1)
    return 2 * (v * p - 1)
