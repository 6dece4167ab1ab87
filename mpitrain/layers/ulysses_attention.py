"""Ulysses attention (parallel.cp_kind = "ulysses"): context parallelism by an all-to-all of heads for tokens.

Each cp rank holds its two zig-zag chunks of the sequence (mpitrain/parallel/context.py) for all of its heads. An
all-to-all over the cp group hands rank r every rank's tokens of head group r (H/c query heads), so rank r holds the
whole sequence of its heads and runs the one-process attention core on it (ops.attention_forward, causal, or the
packed documents' mask of the whole rows); a second all-to-all hands every rank its own tokens of all heads back.
The gathered tokens arrive rank by rank, each rank's two chunks in its order: `gathered_order` is the permutation
of positions they arrive in, undone before the core and redone after it. Backward is the transpose: dO goes like
the queries, dQ/dK/dV come back like the output.

Grouped-query attention: query head h uses K/V head h // (H / Hkv). With Hkv a multiple of c the K/V heads are split
like the queries (rank r takes K/V heads [r Hkv/c, (r+1) Hkv/c), the ones its query heads use); with c a multiple of
Hkv every rank's query heads share one K/V head and each rank sends every destination that head (`kv_heads_for`):
K/V are then replicated, and backward sums the dK/dV coming back for one head over the ranks that used it.

Q, K and V travel in one buffer, so a block and micro-batch costs two all-to-alls in forward (QKV, O) and two in
backward (dO, dQKV). Each sends (c-1)/c of its local buffer, counted under "all_to_all" on the cp group:

    forward = backward = (c-1)/c (Q + 2 K' + O)     Q = O = B H (T/c) D e, K' = B Hkv' (T/c) D e

with Hkv' = Hkv when split, c when replicated (one head to each rank); `bytes_per_block` computes it. `cp` is the
rank's ContextParallel (size, rank, chunks_of, exchange): this module does the math, it moves the buffers. The two
exchanges are functions of their own (`heads_for_tokens`, `tokens_for_heads` and backward's `queries_for_tokens`,
`grads_for_tokens`): hybrid cp (layers/hybrid_attention.py) runs them over a node's cp ranks around ring attention.
"""
from __future__ import annotations

import numpy as np

from mpitrain.backend import array_module
from mpitrain.layers import attention_core, ops


def gathered_order(cp, seq_len: int) -> np.ndarray:
    """Positions of the tokens as the all-to-all delivers them: rank 0's two chunks, rank 1's, ..."""
    m = seq_len // (2 * cp.size)
    return np.concatenate([np.arange(c * m, (c + 1) * m) for r in range(cp.size) for c in cp.chunks_of(r)])


def kv_heads_for(heads: int, kv_heads: int, cp_size: int) -> list[slice]:
    """The K/V heads each cp rank's query heads (H/c of them) use: Hkv/c of them when Hkv is a multiple of c, else
    the one head they share (c a multiple of Hkv)."""
    if kv_heads % cp_size == 0:
        per = kv_heads // cp_size
        return [slice(r * per, (r + 1) * per) for r in range(cp_size)]
    return [slice(r * kv_heads // cp_size, r * kv_heads // cp_size + 1) for r in range(cp_size)]


def kv_heads_per_rank(kv_heads: int, cp_size: int) -> int:
    """How many K/V heads each cp rank's core uses (kv_heads_for)."""
    return kv_heads // cp_size if kv_heads % cp_size == 0 else 1


def saved_arrays(batch: int, heads: int, kv_heads: int, local_len: int, head_dim: int, cp_size: int, dtype) -> list:
    """(shape, dtype) of what forward keeps: the one-process core's q, k, v, probabilities and output over the whole
    sequence (c local_len tokens) of this rank's H/c query heads and the K/V heads they use. The output is a buffer
    of its own here (the projection reads the exchanged one), kept for backward's rowsum(dO * O)."""
    b, h, kv, t, d = batch, heads // cp_size, kv_heads_per_rank(kv_heads, cp_size), local_len * cp_size, head_dim
    return [((b, h, t, d), dtype), ((b, kv, t, d), dtype), ((b, kv, t, d), dtype), ((b, kv, h // kv * t, t), dtype),
            ((b, h, t, d), dtype)]


def bytes_per_block(local_q_bytes: int, local_kv_bytes: int, kv_heads: int, cp_size: int) -> dict[str, float]:
    """Bytes one rank sends per attention block and micro-batch (module docstring). local_q_bytes: this rank's Q
    (B, H, T/c, D); local_kv_bytes: its K (B, Hkv, T/c, D)."""
    sent_kv = local_kv_bytes if kv_heads % cp_size == 0 else local_kv_bytes * cp_size // kv_heads
    share = (cp_size - 1) / cp_size * (2 * local_q_bytes + 2 * sent_kv)
    return {"forward": share, "backward": share}


def _scatter_heads(cp, parts):
    """[(x (B, h, t, D) local tokens, [head slice per rank])] -> (c, B, sum of slice widths, t, D): block r is what
    rank r gets of each x, side by side on the head axis, exchanged; block s of the result is rank s's tokens."""
    xp = array_module(parts[0][0])
    send = xp.ascontiguousarray(xp.stack([xp.concatenate([x[:, heads[r]] for x, heads in parts], axis=1)
                                          for r in range(cp.size)]))
    return cp.exchange(send)


def _to_sequence(received, order):
    """(c, B, h, 2m, D) rank by rank -> (B, h, T, D) in sequence order."""
    c, b, h, t, d = received.shape
    gathered = received.transpose(1, 2, 0, 3, 4).reshape(b, h, c * t, d)
    return gathered[:, :, array_module(received).asarray(np.argsort(order))]  # a device index for device arrays


def _to_ranks(x, order, cp_size):
    """(B, h, T, D) in sequence order -> (c, B, h, 2m, D): block r holds rank r's tokens, contiguous."""
    b, h, t, d = x.shape
    xp = array_module(x)
    gathered = x[:, :, xp.asarray(order)].reshape(b, h, cp_size, t // cp_size, d)
    return xp.ascontiguousarray(gathered.transpose(2, 0, 1, 3, 4))


def whole_mask(seq_len, dtype, xp, documents):
    """The core's mask over the whole sequence: causal, or the packed documents' of the whole rows."""
    if documents is None:
        return ops.causal_bias(seq_len, seq_len, xp, dtype)
    ids, positions = documents  # the whole rows' (B, T), the same on every cp rank
    return attention_core.document_bias(ids, positions, ids, positions, xp, dtype)


def heads_for_tokens(cp, q, k, v):
    """The first all-to-all: (q, k, v) of this rank's H/c query heads and the K/V heads they use over the whole
    sequence of the group's tokens, in sequence order (B, h, c 2m, D) each, contiguous. q: (B, H, 2m, D) holding
    this rank's two zig-zag chunks; k, v: (B, Hkv, 2m, D) likewise."""
    xp, heads = array_module(q), q.shape[1]
    kv = kv_heads_for(heads, k.shape[1], cp.size)
    whole = _to_sequence(_scatter_heads(cp, [(q, _query_heads(heads, cp.size)), (k, kv), (v, kv)]),
                         gathered_order(cp, q.shape[2] * cp.size))
    hq, hkv = heads // cp.size, kv[0].stop - kv[0].start
    return tuple(xp.ascontiguousarray(whole[:, a:b]) for a, b in ((0, hq), (hq, hq + hkv), (hq + hkv, hq + 2 * hkv)))


def tokens_for_heads(cp, out):
    """The second all-to-all: the output (B, H/c, T, D) of this rank's heads over the whole sequence -> this rank's
    tokens of all heads, (B, H, 2m, D)."""
    back = cp.exchange(_to_ranks(out, gathered_order(cp, out.shape[2]), cp.size))  # block s: head group s
    c, b, h, t, d = back.shape
    return back.transpose(1, 0, 2, 3, 4).reshape(b, c * h, t, d)


def queries_for_tokens(cp, dout):
    """Backward's first all-to-all: dO of this rank's tokens (B, H, 2m, D) -> of its heads over the whole sequence."""
    order = gathered_order(cp, dout.shape[2] * cp.size)
    return _to_sequence(_scatter_heads(cp, [(dout, _query_heads(dout.shape[1], cp.size))]), order)


def grads_for_tokens(cp, dq, dk, dv, kv_heads: int):
    """Backward's second all-to-all, the transpose of heads_for_tokens: dQ (B, H/c, T, D), dK/dV of the K/V heads
    this rank used -> (dq, dk, dv) of this rank's tokens (B, H or Hkv, 2m, D). Replicated K/V heads sum the
    gradients of the ranks that shared them."""
    xp = array_module(dq)
    back = cp.exchange(_to_ranks(xp.concatenate([dq, dk, dv], axis=1), gathered_order(cp, dq.shape[2]), cp.size))
    hq, hkv = dq.shape[1], dk.shape[1]
    c, b, _, t, d = back.shape
    dq = back[:, :, :hq].transpose(1, 0, 2, 3, 4).reshape(b, c * hq, t, d)
    shape = (b, kv_heads, t, d)
    dk, dv = xp.zeros(shape, dtype=back.dtype), xp.zeros(shape, dtype=back.dtype)
    for source, heads_used in enumerate(kv_heads_for(c * hq, kv_heads, c)):
        dk[:, heads_used] += back[source, :, hq:hq + hkv]
        dv[:, heads_used] += back[source, :, hq + hkv:]
    return dq, dk, dv


def _query_heads(heads: int, cp_size: int) -> list[slice]:
    return [slice(r * heads // cp_size, (r + 1) * heads // cp_size) for r in range(cp_size)]


def forward(cp, q, k, v, documents=None):
    """(out, saved): causal attention of this rank's tokens. q: (B, H, 2m, D) holding its two zig-zag chunks; k, v:
    (B, Hkv, 2m, D) likewise; documents: None, or the whole rows' (ids, positions). out: (B, H, 2m, D)."""
    q_all, k_all, v_all = heads_for_tokens(cp, q, k, v)
    mask = whole_mask(q_all.shape[2], q.dtype, array_module(q), documents)
    (out, _), core = ops.attention_forward(q_all, k_all, v_all, mask)
    return tokens_for_heads(cp, out), (core, k.shape[1])


def backward(cp, saved, dout):
    """(dq, dk, dv) of this rank's tokens, the shapes of forward's q, k, v."""
    core, kv_heads = saved
    dq, dk, dv = ops.attention_backward(core, queries_for_tokens(cp, dout))
    return grads_for_tokens(cp, dq, dk, dv, kv_heads)
