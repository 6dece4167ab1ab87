"""Byte counters (`group.bytes_sent[kind]`) hold what THIS rank sends under the bandwidth-optimal (ring) algorithm of
each operation, whatever algorithm MPI really picks, so that tests and reports can be checked against theory:

    kind            bytes this rank sends for a B-byte buffer on N ranks
    all_reduce      2(N-1)/N * B
    reduce_scatter  (N-1)/N * B     B = the whole input (N blocks)
    all_gather      (N-1)/N * B     B = the whole output (N blocks)
    broadcast       B on the root, 0 elsewhere (the root sends the whole buffer once; relays are not counted)
    send            B               (recv counts nothing: bytes are counted by the sender)
    all_to_all      (N-1)/N * B     B = the send buffer; all_to_allv counts exactly what goes to other ranks
    control         B               small control messages (all_reduce_scalar, _bits), kept apart so that the gradient
                                    traffic counters above stay exact
    cp_ring         B               isend(..., kind="cp_ring"): context parallelism's K/V ring (parallel/context.py)

Trainer.train_step resets every group's counters at its start, so after a step they hold that step's bytes alone,
whatever ran before it (an evaluation, a forward): read them after the step; a snapshot taken before it is no
baseline (subtracting it would take the earlier calls' bytes off the step's).
Totals are kept as exact fractions and rounded to the nearest integer when read. A group of size 1 sends nothing
(every counter stays 0) and makes no MPI call: collectives become local copies or no-ops. Non-blocking operations
are counted when issued.
"""
from __future__ import annotations

from fractions import Fraction

COUNTER_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "all_to_all", "control",
                 "cp_ring")


def ring_bytes(kind: str, nbytes: int, size: int, is_root: bool = False) -> Fraction:
    """Bytes one rank sends for operation `kind` on an `nbytes` buffer across `size` ranks (see the module table)."""
    if size == 1:
        return Fraction(0)
    share = Fraction(size - 1, size) * nbytes
    if kind == "all_reduce":
        return 2 * share
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return share
    if kind == "broadcast":
        return Fraction(nbytes if is_root else 0)
    if kind in ("send", "control", "cp_ring"):
        return Fraction(nbytes)
    raise ValueError(f"unknown communication kind {kind!r}; expected one of {', '.join(COUNTER_KINDS)}")


def merge_counters(groups) -> dict[str, int]:
    """Sum the byte counters of several groups per kind (exactly, rounded once at the end)."""
    total = {kind: Fraction(0) for kind in COUNTER_KINDS}
    for group in groups:
        for kind, value in group.counters(exact=True).items():
            total[kind] += value
    return {kind: round(value) for kind, value in total.items()}
