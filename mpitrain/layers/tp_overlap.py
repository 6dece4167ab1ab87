"""Collective matmul (parallel.tp_overlap): sequence parallelism's all-gather and reduce-scatter cut into the tp
ranks' sequence chunks and pipelined with the matmul of each chunk, as Megatron's tp-comm-overlap and torchtitan's
async tensor parallelism do.

Under sequence parallelism a column-parallel linear all-gathers its input along the sequence before its matmul, and
a row-parallel linear reduce-scatters its output after it: both transfers sit on the critical path. Here they run as
a ring over the t ranks of the tp group, one step per sequence chunk (chunk r = rank r's T/t positions):

    gather_and_apply      (column forward, row backward) step s: rank r applies the matmul to the chunk it holds
                          (its own at s = 0, then rank r-s's) while passing that chunk on to rank r+1 and receiving
                          rank r-s-1's from rank r-1. Only the first chunk's wait can be exposed.
    start_ring_reduce     (row forward, column backward) step s: rank r computes its partial sum of chunk r+s+1,
                          adds the running sum received from rank r+1, and sends it on to rank r-1; at the last step
                          it computes chunk r's own partial, which the transfer of the previous step hides; the last
                          receive is waited on by the caller (a column-parallel backward takes its weight gradients
                          first).

Communication stays here and the math with the caller: the linears hand in `apply(chunk)` / `partial(positions)`.

Exactness. A gather moves bits: the chunks are the unchunked all-gather's bytes. Sums: with t = 2 each chunk is one
addition a + b, which is the same number in either order, so the ring's reduction equals MPI's reduce-scatter bit for
bit (float32 accumulation for bfloat16/float16 too, rounded once at the end as the unchunked path does). With t > 2
the ring adds in its own fixed order ((P[j-1] + P[j-2]) + ...) + P[j], MPI in an order of its own: equal to ~1e-16
relative in float64 (the tests hold it to 1e-12). The matmuls are row-wise, so a chunk's rows are the unchunked
product's rows up to BLAS: numpy's OpenBLAS computes the rows past the last multiple of its kernel's row unroll
with a different kernel (in float32 a few ulp apart), so the chunked products equal the unchunked ones bit for bit
only where the row counts line up with that unroll, and otherwise to rounding (float64: 1e-12 relative).

Bytes: every step sends one chunk to one neighbour, (t-1) chunks in all: the same bytes as the ring all-gather /
reduce-scatter (counted under the tp group's "send"). `exposed_seconds` models the time the overlap hides.
"""
from __future__ import annotations

import time

import numpy as np

from mpitrain.backend import array_module
from mpitrain.comm.operations import Handle
from mpitrain.layers.precision import LOW_PRECISION

RING_TAG = 61  # the tp ring's messages; both neighbours post them in the same order, so one tag suffices


def _words(x):
    """16-bit floats travel as their bits (MPI has no bfloat16 type); other arrays as they are."""
    return x.view(np.uint16) if x.dtype in LOW_PRECISION else x


def _widened(x):
    """float32 for bfloat16/float16 partial sums (summed in fp32, as the unchunked reduce-scatter does)."""
    return x.astype(np.float32) if x.dtype in LOW_PRECISION else x


def chunk_positions(chunk: int, length: int) -> slice:
    """Sequence positions of chunk `chunk` (rank `chunk`'s share) when each chunk has `length` positions."""
    return slice(chunk * length, (chunk + 1) * length)


def _charged_wait(tp, kind: str, handle) -> None:
    start = time.perf_counter()
    handle.wait()
    tp.seconds[kind] += time.perf_counter() - start


def gather_and_apply(tp, x, apply):
    """x: this rank's (B, T/t, ...) chunk. Returns (the gathered (B, T, ...) input, outputs): `apply(chunk)` returns
    a list of (B, T/t, ...) arrays for one chunk; each output is assembled over the whole sequence."""
    xp, t, rank = array_module(x), tp.size, tp.rank
    length = x.shape[1]
    gathered = xp.empty((x.shape[0], t * length) + x.shape[2:], dtype=x.dtype)
    outputs = None
    chunk = xp.ascontiguousarray(x)
    for step in range(t):
        origin = (rank - step) % t  # whose chunk this rank holds at this step
        if step < t - 1:  # pass it on while the matmul runs
            incoming = xp.empty_like(chunk)
            receiving = tp.group.irecv(_words(incoming), (rank - 1) % t, RING_TAG)
            sending = tp.group.isend(_words(chunk), (rank + 1) % t, RING_TAG)
        results = apply(chunk)
        if outputs is None:
            outputs = [xp.empty((y.shape[0], t * length) + y.shape[2:], dtype=y.dtype) for y in results]
        where = chunk_positions(origin, length)
        for output, y in zip(outputs, results):
            output[:, where] = y
        gathered[:, where] = chunk
        if step < t - 1:
            _charged_wait(tp, "all_gather", receiving)
            _charged_wait(tp, "all_gather", sending)
            chunk = incoming
    return gathered, outputs


def start_ring_reduce(tp, partial, length: int) -> Handle:
    """This rank's (B, T/t, ...) chunk of the sum over tp of partial sums, started; wait() returns it (in the
    partial sums' dtype).
    `partial(positions)` returns a FRESH array (it is summed into in place): this rank's partial sum over those
    sequence positions (a slice of `length`). The last receive is left in flight for the caller to wait on."""
    t, rank = tp.size, tp.rank
    sends, receiving, incoming, dtype = [], None, None, None
    for step in range(t - 1):
        computed = partial(chunk_positions((rank + step + 1) % t, length))
        dtype = computed.dtype
        running = array_module(computed).ascontiguousarray(_widened(computed))
        if receiving is not None:
            _charged_wait(tp, "reduce_scatter", receiving)
            running += incoming  # a + b: the same in either order (see the module docstring)
        incoming = array_module(running).empty_like(running)
        sends.append(tp.group.isend(running, (rank - 1) % t, RING_TAG))
        receiving = tp.group.irecv(incoming, (rank + 1) % t, RING_TAG)
    own = _widened(partial(chunk_positions(rank, length)))  # computed while the last transfer is in flight

    def finish():
        own[...] += incoming
        for sending in sends:
            sending.wait()
        return own.astype(dtype, copy=False)

    def charge(seconds: float) -> None:
        tp.seconds["reduce_scatter"] += seconds
    return Handle.after(receiving).timed(charge).then(finish)


# ------------------------------------------------------------------------------------- formulas for the planner
def ring_bytes_sent(nbytes: float, tp: int) -> float:
    """Bytes one rank sends for one linear's gather (or reduce-scatter) of an `nbytes` (B, T, C) tensor (its
    partial sums' bytes for a reduce-scatter): t-1 chunks of nbytes/t, as the unchunked ring collective."""
    return (tp - 1) * nbytes / tp


def exposed_seconds(nbytes: float, tp: int, bandwidth: float, matmul_s: float, overlap: bool,
                    latency_s: float = 0.0) -> float:
    """Communication time one linear leaves on the critical path for its sequence-parallel all-gather or
    reduce-scatter on `tp` ranks: nbytes as in ring_bytes_sent, bandwidth in bytes/s per link, matmul_s the time of
    the linear's matmul over the whole sequence, latency_s per message.

    Each of the ring's t-1 steps moves one chunk: step = latency_s + nbytes / (t bandwidth). Without overlap every
    step waits: (t-1) step. With overlap each step runs under the matmul of one chunk (matmul_s / t), so only what
    that matmul does not cover is exposed: (t-1) max(0, step - matmul_s / t)."""
    if tp <= 1:
        return 0.0
    step = latency_s + nbytes / (tp * bandwidth)
    hidden = matmul_s / tp if overlap else 0.0
    return (tp - 1) * max(0.0, step - hidden)
