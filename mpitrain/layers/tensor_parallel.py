"""Tensor parallelism (Megatron style): the communication that splits every layer over the ranks of the tp group.

Layers stay plain math; they receive a `TensorParallel` (the tp group and its mode) and call the operators below at
the two places where a tensor-parallel region begins and ends. With one rank every operator is a no-op (no copy, no
MPI call), so ONE code path serves every degree.

The conjugate pairs (forward / backward), Megatron's f and g, and their sequence-parallel forms:

    operator          forward                                backward
    copy_to_tp        identity                               all-reduce
    reduce_from_tp    all-reduce                             identity
    gather_from_sp    all-gather along the sequence          reduce-scatter along the sequence
    scatter_to_sp     reduce-scatter along the sequence      all-gather along the sequence

A block enters its tensor-parallel region before the column-parallel linears (Q/K/V, MLP up/gate) and leaves it
after the row-parallel ones (attention output, MLP down): `enter` is copy_to_tp, or gather_from_sp with sequence
parallelism; `exit` is reduce_from_tp, or scatter_to_sp. Between a block's exit and the next block's entry (norms,
residual adds, biases of row-parallel linears) activations are replicated, or with sequence parallelism split along
the sequence: 1/t of them per rank, for the same bytes moved (an all-reduce is a reduce-scatter plus an all-gather).

Activations are (batch, sequence, ...) and the sequence is axis 1, but MPI's all-gather and reduce-scatter work on
contiguous LEADING blocks. So the sequence operators move the sequence to the front ((T, B, ...) contiguous: a copy,
free when B = 1), communicate, and move it back.

Also here: the vocabulary-parallel embedding and cross-entropy (each rank holds ceil(V/t) rows of the vocabulary;
the full logits are never gathered), gradients of replicated tensors that each rank only partly computes, and the
description of a rank's piece of a split tensor. The linears that use these operators are mpitrain/layers/linear.py.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from mpitrain.backend import array_module
from mpitrain.comm.operations import Handle
from mpitrain.layers import ops, tp_overlap
from mpitrain.layers.precision import LOW_PRECISION, computes_in_float32
from mpitrain.state.params import ParamSpec

TIMED_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


class TensorParallel:
    """The tensor-parallel group and mode that layers receive explicitly (never a global).

    `group`: a comm Group (None: one rank). `sequence_parallel`: split norm/residual regions along the sequence.
    `seconds[kind]` accumulates the wall time this rank spends in tp collectives (issue + wait; the part of a
    non-blocking reduction hidden behind compute is not counted), for the step breakdown and benchmarks.
    """

    def __init__(self, group=None, sequence_parallel: bool = False, breakdown=None, overlap: bool = False):
        self.group = group
        self.size = group.size if group is not None else 1
        self.rank = group.rank if group is not None else 0
        self.sequence_parallel = sequence_parallel
        # parallel.tp_overlap: the sequence gathers / reduce-scatters pipelined with the linears' matmuls, chunk by
        # chunk (mpitrain/layers/tp_overlap.py); only meaningful with sequence parallelism over several ranks
        self.overlap = overlap and sequence_parallel and self.size > 1
        self.seconds = dict.fromkeys(TIMED_KINDS, 0.0)
        self.breakdown = breakdown  # profile/breakdown.py's Breakdown: the linears time their dW matmuls apart

    def phase(self, name: str):
        """A with-block charged to part `name` of the step breakdown (nothing without one)."""
        return nullcontext() if self.breakdown is None else self.breakdown.part(name)

    def reset_timers(self) -> None:
        self.seconds = dict.fromkeys(TIMED_KINDS, 0.0)

    def __repr__(self) -> str:
        return f"TensorParallel(rank {self.rank} of {self.size}, sequence_parallel={self.sequence_parallel})"

    # -- raw collectives, timed
    def _timed(self, kind: str, start: float) -> None:
        self.seconds[kind] += time.perf_counter() - start

    def _pending(self, kind: str, handle, result) -> Handle:
        """The group's `handle` as a reduction in flight: its wait is charged to `kind`, wait() returns `result()`."""
        def charge(seconds: float) -> None:
            self.seconds[kind] += seconds
        return Handle.after(handle).timed(charge).then(result)

    # bfloat16/float16 arrays are summed in float32 (MPI has no 16-bit float sum, and fp32 accumulation is the rule)
    # and moved as raw 16-bit words where nothing is summed (all-gather).
    def all_reduce(self, buf, op: str = "sum"):
        """In place; returns buf."""
        if self.size > 1:
            start = time.perf_counter()
            wide = _widened(buf)
            self.group.all_reduce(wide, op)
            if wide is not buf:
                buf[...] = wide
            self._timed("all_reduce", start)
        return buf

    def start_all_reduce(self, buf) -> Handle:
        if self.size == 1:
            return Handle.completed(buf)
        start = time.perf_counter()
        wide = _widened(buf)
        handle = self.group.iall_reduce(wide)
        self._timed("all_reduce", start)
        return self._pending("all_reduce", handle, lambda: buf if wide is buf else wide.astype(buf.dtype))

    def gather_sequence(self, x):
        """(B, T/t, ...) chunks of every rank -> (B, T, ...); rank r's chunk goes to positions [r T/t, (r+1) T/t)."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        send = _sequence_first(x)
        recv = array_module(x).empty((self.size * send.shape[0],) + send.shape[1:], dtype=x.dtype)
        words = np.uint16 if x.dtype in LOW_PRECISION else x.dtype  # 16-bit floats travel as their bits
        self.group.all_gather(send.view(words), recv.view(words))
        self._timed("all_gather", start)
        return _sequence_second(recv)

    def start_reduce_scatter_sequence(self, x) -> Handle:
        """(B, T, ...) partial sums -> this rank's (B, T/t, ...) chunk of their sum; non-blocking."""
        if self.size == 1:
            return Handle.completed(x)
        if x.shape[1] % self.size:
            raise ValueError(f"sequence parallelism: sequence length {x.shape[1]} is not divisible by tp = "
                             f"{self.size}")
        start = time.perf_counter()
        send = _sequence_first(_widened(x))
        recv = array_module(x).empty((send.shape[0] // self.size,) + send.shape[1:], dtype=send.dtype)
        handle = self.group.ireduce_scatter(send, recv)
        self._timed("reduce_scatter", start)
        return self._pending("reduce_scatter", handle,
                             lambda: _sequence_second(recv).astype(x.dtype, copy=False))

    def reduce_scatter_sequence(self, x):
        return self.start_reduce_scatter_sequence(x).wait()

    def sequence_chunk(self, seq_len: int) -> slice:
        """Positions of this rank's chunk of a sequence in sequence-parallel regions (all of it without SP)."""
        if not self.sequence_parallel or self.size == 1:
            return slice(0, seq_len)
        chunk = seq_len // self.size
        return slice(self.rank * chunk, (self.rank + 1) * chunk)

    # -- entering and leaving a tensor-parallel region: the mode picks the operator pair
    def enter(self, x):
        """Before column-parallel linears: replicated input (copy_to_tp) or the all-gathered sequence."""
        return gather_from_sp_forward(self, x) if self.sequence_parallel else copy_to_tp_forward(self, x)

    def start_enter_backward(self, dx) -> Handle:
        """Gradient of `enter`, started without waiting (copy_to_tp's or gather_from_sp's backward in the table
        above): all-reduce, or reduce-scatter to this rank's sequence chunk."""
        if self.sequence_parallel:
            return self.start_reduce_scatter_sequence(dx)
        return self.start_all_reduce(dx)

    def exit(self, y):
        """After row-parallel linears: sum the partial outputs (all-reduce, or reduce-scatter along the sequence)."""
        return scatter_to_sp_forward(self, y) if self.sequence_parallel else reduce_from_tp_forward(self, y)

    def exit_backward(self, dy):
        return scatter_to_sp_backward(self, dy) if self.sequence_parallel else reduce_from_tp_backward(self, dy)

    # -- the same four operators with the linear's matmul handed in, so that with `overlap` the transfer of one
    # sequence chunk runs under the matmul of another (tp_overlap.py); without it, the plain operators above.
    # `apply(rows)` maps an entered array (or chunk of one) to a list of outputs; `partial(positions)` returns a
    # fresh partial sum over a slice of sequence positions (None: all of them).
    def enter_and_apply(self, x, apply):
        """(enter(x), apply(enter(x))): a column-parallel linear's forward."""
        if self.overlap:
            return tp_overlap.gather_and_apply(self, x, apply)
        h = self.enter(x)
        return h, apply(h)

    def exit_backward_and_apply(self, dy, apply):
        """(exit_backward(dy), apply(exit_backward(dy))): a row-parallel linear's input gradient."""
        if self.overlap:
            return tp_overlap.gather_and_apply(self, dy, apply)
        dy = self.exit_backward(dy)
        return dy, apply(dy)

    def exit_of(self, partial, seq_len: int):
        """exit(partial(all positions)): a row-parallel linear's forward, over a sequence of seq_len positions."""
        if self.overlap:
            return tp_overlap.start_ring_reduce(self, partial, self._chunk_length(seq_len)).wait()
        return self.exit(partial(None))

    def start_enter_backward_of(self, partial, seq_len: int) -> Handle:
        """start_enter_backward(partial(all positions)): a column-parallel linear's input gradient, in flight."""
        if self.overlap:
            return tp_overlap.start_ring_reduce(self, partial, self._chunk_length(seq_len))
        return self.start_enter_backward(partial(None))

    def _chunk_length(self, seq_len: int) -> int:
        if seq_len % self.size:
            raise ValueError(f"sequence parallelism: sequence length {seq_len} is not divisible by tp = {self.size}")
        return seq_len // self.size


def _widened(x):
    """float32 for a bfloat16/float16 array (summed in fp32), else the array itself."""
    return x.astype(np.float32) if x.dtype in LOW_PRECISION else x


def _sequence_first(x):
    """(B, T, ...) -> contiguous (T, B, ...): MPI blocks are leading blocks (no copy when B = 1)."""
    return array_module(x).ascontiguousarray(x.swapaxes(0, 1))


def _sequence_second(x):
    return array_module(x).ascontiguousarray(x.swapaxes(0, 1))


# ------------------------------------------------------------------------------------- the conjugate operator pairs
def copy_to_tp_forward(tp: TensorParallel, x):
    return x


def reduce_from_tp_forward(tp: TensorParallel, y):
    return tp.all_reduce(y)


def reduce_from_tp_backward(tp: TensorParallel, dy):
    return dy


def gather_from_sp_forward(tp: TensorParallel, x):
    return tp.gather_sequence(x)


def scatter_to_sp_forward(tp: TensorParallel, y):
    return tp.reduce_scatter_sequence(y)


def scatter_to_sp_backward(tp: TensorParallel, dx):
    return tp.gather_sequence(dx)


def _rows(x):
    return x.reshape(-1, x.shape[-1])


# ------------------------------------------------------------------------------------- split parameters
def split_spec(name, global_shape, axis, tp: TensorParallel, init="normal", std=0.0, per_rank=None) -> ParamSpec:
    """This tp rank's block of a tensor split along `axis`: per_rank (default: an equal share) consecutive slices.
    A block that hangs over the tensor's end (vocabulary padding) is a VocabShardSpec. One rank: the whole tensor."""
    global_shape = tuple(global_shape)
    if tp.size == 1:
        return ParamSpec(name, global_shape, init, std)
    per_rank = per_rank or global_shape[axis] // tp.size
    shape, offset = list(global_shape), [0] * len(global_shape)
    shape[axis], offset[axis] = per_rank, tp.rank * per_rank
    kind = ParamSpec if per_rank * tp.size == global_shape[axis] else VocabShardSpec
    return kind(name, tuple(shape), init, std, global_shape, tuple(offset), tp_replicated=False,
                tp_axis=axis % len(global_shape))


class PartialGrads:
    """Gradients of tp-REPLICATED tensors that each tp rank computes only part of, summed over tp in backward.

    Two cases (both only when tp > 1):
      - with sequence parallelism, norm weights: each rank saw only its sequence chunk;
      - K/V projections replicated because n_kv_head is not a multiple of tp: each rank back-propagates only the
        query heads it owns.
    The partial gradients go to zeroed temporaries (one flat buffer), are all-reduced once, and are then ADDED to
    the real gradients: reducing the accumulating buffer itself would multiply earlier micro-batches by t.
    """

    def __init__(self, tp: TensorParallel, grads: dict, names):
        self.tp, self.target = tp, grads
        self.names = [name for name in names if name in grads] if tp.size > 1 else []
        self.grads = dict(grads)
        if self.names:
            first = grads[self.names[0]]
            xp = array_module(first)
            self.buffer = xp.zeros(sum(grads[name].size for name in self.names), dtype=first.dtype)
            position = 0
            for name in self.names:
                size = grads[name].size
                self.grads[name] = self.buffer[position:position + size].reshape(grads[name].shape)
                position += size

    def reduce(self) -> None:
        if not self.names:
            return
        self.tp.all_reduce(self.buffer)
        for name in self.names:
            self.target[name] += self.grads[name]


# ------------------------------------------------------------------------------------- vocabulary parallel
@dataclass(frozen=True)
class VocabShardSpec(ParamSpec):
    """A vocabulary shard: ceil(V/t) rows (or columns) per rank, so the last rank's piece may hang over the end of
    the real vocabulary (`global_shape`). The overhang is zero padding: initialised to zero, never looked up,
    masked to -inf in the logits; it gets no gradient and stays zero."""

    def piece(self, full: np.ndarray) -> np.ndarray:
        out = np.zeros(self.shape, dtype=full.dtype)
        inside = super().piece(full)  # numpy slicing stops at the global tensor's end
        out[tuple(slice(0, n) for n in inside.shape)] = inside
        return out


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(first token id, rows per rank = ceil(V/t), real rows on this rank) of this rank's vocabulary shard."""
    rows = -(-vocab_size // tp.size)
    first = tp.rank * rows
    return first, rows, max(0, min(rows, vocab_size - first))


@computes_in_float32()
def vocab_parallel_embedding_forward(tp: TensorParallel, table, ids, first: int):
    """Rows of this rank's table shard for the ids it owns, zeros for the others, summed over tp by the region's
    exit (all-reduce; under SP a reduce-scatter, so the result is this rank's sequence chunk).
    Saves the local row of each id, -1 where another rank owns it."""
    xp = array_module(table)
    local = ids - first
    outside = (local < 0) | (local >= table.shape[0])
    local[outside] = -1
    x = table[xp.maximum(local, 0)]
    x[outside] = 0.0
    return tp.exit(x), local


@computes_in_float32("dtable")
def vocab_parallel_embedding_backward(tp: TensorParallel, local, dx, dtable):
    """Adds into this rank's table shard; returns the full-sequence gradient (for learned positions)."""
    dx = tp.exit_backward(dx)
    mine = local >= 0
    ops.scatter_add_rows(dtable, local[mine], dx[mine])
    return dx


def mask_vocab_padding(logits, real_columns: int):
    """Padded vocabulary columns of the local logits -> -inf: zero probability, so the loss is unchanged."""
    if real_columns < logits.shape[-1]:
        logits[..., real_columns:] = -np.inf
    return logits


@computes_in_float32()
def vocab_parallel_cross_entropy_forward(tp: TensorParallel, logits, targets, first: int):
    """Sum over tokens of -log softmax(logits)[target] from this rank's vocabulary columns of the logits.

    Never gathers the logits: the row max is all-reduced (max), then the sum of exponentials and the target's
    shifted logit (nonzero only on the rank that owns the target) are all-reduced together (sum). Saves the
    probabilities of this rank's columns and each target's local column (-1 where another rank owns it).
    """
    xp = array_module(logits)
    rows = _rows(logits)
    n, columns = rows.shape
    row_max = rows.max(axis=-1)
    tp.all_reduce(row_max, op="max")
    shifted = rows - row_max[:, None]
    exp = xp.exp(shifted)
    local_targets = targets.reshape(-1) - first
    mine = (local_targets >= 0) & (local_targets < columns)
    local_targets[~mine] = -1
    stats = xp.zeros((n, 2), dtype=logits.dtype)  # [sum of exp, shifted target logit]
    stats[:, 0] = exp.sum(axis=-1)
    stats[:, 1] = xp.where(mine, shifted[xp.arange(n), xp.maximum(local_targets, 0)], 0.0)
    tp.all_reduce(stats)
    loss_sum = (xp.log(stats[:, 0]) - stats[:, 1]).sum()
    exp /= stats[:, 0:1]
    return loss_sum, (exp, local_targets, logits.shape)


@computes_in_float32()
def vocab_parallel_cross_entropy_backward(saved, dloss):
    """d(dloss * loss_sum)/d(local logits) = dloss (softmax - onehot(target)), on this rank's columns only."""
    probs, local_targets, shape = saved
    xp = array_module(probs)
    dlogits = probs.copy()
    mine = local_targets >= 0
    dlogits[xp.arange(len(local_targets))[mine], local_targets[mine]] -= 1.0
    dlogits *= dloss
    return dlogits.reshape(shape)
