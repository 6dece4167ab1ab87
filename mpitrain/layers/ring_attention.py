"""Ring attention: causal attention of this rank's queries against K/V blocks that travel around the cp ring.

The rank holds two zig-zag chunks of the sequence (mpitrain/parallel/context.py); so does the K/V block it holds at
each ring step. Each (query chunk, key chunk) pair is one of: fully visible (the key chunk comes earlier), causal (the
same chunk: the usual triangle) or fully masked (later): masked pairs are skipped, never computed. The partial
outputs of the pairs a query chunk sees merge by their log-sum-exp (online softmax), so the result is the one-process
attention up to rounding.

Backward recomputes each pair's probabilities from the saved global log-sum-exp, P = exp(S - lse), and uses
delta = rowsum(dO * O) for the softmax's Jacobian (dS = P (dP - delta)), the flash-attention form: nothing of size
T x T is saved. dQ stays here; the pair's dK/dV is added into the accumulator of the block's owner, which travels on
around the ring and arrives home after c-1 hops.

Packed documents (data.document_mask): `documents` is the whole row's (ids, positions), (B, T) each, the same on
every cp rank (computed from the row's tokens before the zig-zag split), so a pair's mask is built from the two
chunks' slices of it (attention_core.document_bias) with no message. A visible pair can then hide every key from
some query rows (their document starts after the key chunk): those rows' partial output is 0 with lse -inf, which
`merge` weighs zero; a pair that hides every key from every row is skipped like a masked one. Each query sees
itself, so its merged lse is finite and backward's exp(S - lse) is 0 on every masked score.

`ring` is the rank's ContextParallel (pass_kv, send_grads, receive_grads, chunks_of, source, size, rank): this
module does the math and asks it to move buffers. Arrays are numpy (the MPI group's requirement); low precision is
computed in float32: the saved q, k, v and output stay in the input's dtype, the log-sum-exp in float32
(`lse_dtype`), since rounding it to bfloat16 would scale every recomputed probability by up to 1 +- 2^-8 x |lse|.
"""
from __future__ import annotations

import math

import numpy as np

from mpitrain.backend import array_module
from mpitrain.layers import attention_core, ops
from mpitrain.layers.precision import LOW_PRECISION


def pair_mask(query_chunk: int, key_chunk: int, m: int, dtype, xp=np):
    """The additive mask of a (query chunk, key chunk) pair of m positions each: 0.0 (all visible), the causal
    triangle (the same chunk, an xp array: on the GPU a device one) or None (all masked: skip)."""
    if key_chunk < query_chunk:
        return 0.0
    if key_chunk == query_chunk:
        return ops.causal_bias(m, m, xp, dtype)
    return None


def visible_pairs(query_chunks, key_chunks, m: int, dtype, xp=np, documents=None):
    """[(query part, key part, mask)] of the pairs that are not fully masked (parts index the two chunks); with
    `documents` (the whole row's ids and positions) each mask is the pair's document mask, (B, m, m)."""
    pairs = []
    for qi, qc in enumerate(query_chunks):
        for ki, kc in enumerate(key_chunks):
            mask = pair_mask(qc, kc, m, dtype, xp)
            if mask is not None and documents is not None:
                mask = document_pair_mask(documents, qc, kc, m, dtype, xp)
            if mask is not None:
                pairs.append((qi, ki, mask))
    return pairs


def document_pair_mask(documents, query_chunk: int, key_chunk: int, m: int, dtype, xp=np):
    """The (B, m, m) document mask of a pair of chunks, or None when it hides every key from every query."""
    ids, positions = documents
    queries, keys = slice(query_chunk * m, (query_chunk + 1) * m), slice(key_chunk * m, (key_chunk + 1) * m)
    mask = attention_core.document_bias(ids[:, queries], positions[:, queries], ids[:, keys], positions[:, keys],
                                        xp, dtype)
    return mask if bool(xp.isfinite(mask).any()) else None


def merge(out, lse, part_out, part_lse):
    """Two softmax-weighted partial outputs over disjoint key sets -> the output over their union."""
    if out is None:
        return part_out, part_lse
    xp = array_module(out)
    total = xp.logaddexp(lse, part_lse)
    # a row that has seen no key in either part (packed documents) has total -inf: weigh both by exp(-inf) = 0
    finite = xp.where(total == -xp.inf, 0.0, total)
    merged = out * xp.exp(lse - finite)[..., None]
    merged += part_out * xp.exp(part_lse - finite)[..., None]
    return merged, total


def block_grads(q, k, v, dout, lse, delta, mask):
    """(dq, dk, dv) of one (query chunk, key chunk) pair, given the rows' GLOBAL log-sum-exp and delta.

    q, dout: (B, H, tq, D); k, v: (B, Hkv, tk, D); lse, delta: (B, H, tq); mask as pair_mask, or a (B, tq, tk)
    document mask. Query heads that share a K/V head stack along time, as in ops.attention_forward."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    scale = 1.0 / math.sqrt(d)
    qg = q.reshape(b, hkv, group * t, d)
    scores = qg @ k.swapaxes(-1, -2)
    scores *= scale
    scores = scores.reshape(b, hkv, group, t, -1)
    scores += mask[:, None, None] if getattr(mask, "ndim", 0) == 3 else mask  # a document mask: per batch row
    scores -= lse.reshape(b, hkv, group, t, 1)
    probs = array_module(q).exp(scores, out=scores).reshape(b, hkv, group * t, -1)
    dout_g = dout.reshape(b, hkv, group * t, d)
    dv = probs.swapaxes(-1, -2) @ dout_g
    dscores = dout_g @ v.swapaxes(-1, -2)
    dscores -= delta.reshape(b, hkv, group * t, 1)
    dscores *= probs
    dscores *= scale
    dq = (dscores @ k).reshape(b, h, t, d)
    dk = dscores.swapaxes(-1, -2) @ qg
    return dq, dk, dv


def lse_dtype(dtype):
    """The dtype ring attention computes in and keeps its log-sum-exp in: float32 under bf16/fp16."""
    return np.dtype(np.float32) if np.dtype(dtype) in LOW_PRECISION else np.dtype(dtype)


def forward(ring, q, k, v, documents=None):
    """(out, saved): causal attention of the local queries over the whole sequence. q: (B, H, 2m, D) holding this
    rank's two chunks; k, v: (B, Hkv, 2m, D) likewise; documents: None, or the whole row's (ids, positions)."""
    inputs, dtype, xp = (q, k, v), lse_dtype(q.dtype), array_module(q)
    q, k, v = q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False)
    m = q.shape[2] // 2
    queries = (q[:, :, :m], q[:, :, m:])
    mine = ring.chunks_of(ring.rank)
    out, lse = [None, None], [None, None]
    kv = xp.ascontiguousarray(xp.stack([k, v]))  # one message per hop
    for step in range(ring.size):
        last = step == ring.size - 1
        if not last:  # the next block travels while this one is computed
            incoming, handles = ring.pass_kv(kv)
        for qi, ki, mask in visible_pairs(mine, ring.chunks_of(ring.source(step)), m, dtype, xp, documents):
            keys = slice(ki * m, (ki + 1) * m)
            (part, part_lse), _ = ops.attention_forward(queries[qi], kv[0][:, :, keys], kv[1][:, :, keys], mask)
            out[qi], lse[qi] = merge(out[qi], lse[qi], part, part_lse)
        if not last:
            for handle in handles:
                handle.wait()
            kv = incoming
    out, lse = xp.concatenate(out, axis=2), xp.concatenate(lse, axis=2)
    saved = (*inputs, out.astype(inputs[0].dtype, copy=False), lse)
    return out, saved if documents is None else (*saved, documents)


def backward(ring, saved, dout):
    """(dq, dk, dv) of this rank's chunks; dK/dV of the other ranks' blocks travel back to them on the ring."""
    dtype, xp = lse_dtype(saved[0].dtype), array_module(saved[0])
    documents = saved[5] if len(saved) > 5 else None  # packed documents: the whole row's (ids, positions)
    q, k, v, out, lse = (x.astype(dtype, copy=False) for x in saved[:5])
    dout = dout.astype(dtype, copy=False)
    m = q.shape[2] // 2
    delta = (dout * out).sum(axis=-1)  # rowsum(dO * O): the softmax Jacobian's row term
    parts = [(x[:, :, :m], x[:, :, m:]) for x in (q, dout, lse, delta)]
    mine = ring.chunks_of(ring.rank)
    dq = xp.zeros_like(q)
    own = xp.zeros((2,) + k.shape, dtype=q.dtype)  # dK, dV of this rank's own block (step 0, then the ring's)
    kv, sending = xp.ascontiguousarray(xp.stack([k, v])), []
    for step in range(ring.size):
        last = step == ring.size - 1
        if not last:
            incoming, handles = ring.pass_kv(kv)
        if step >= 2:  # the accumulator for this block, from the rank that held it one step ago
            travelling, arrival = ring.receive_grads(own)
        grads = own if step == 0 else xp.zeros_like(own)
        for qi, ki, mask in visible_pairs(mine, ring.chunks_of(ring.source(step)), m, q.dtype, xp, documents):
            keys = slice(ki * m, (ki + 1) * m)
            (q_i, dout_i, lse_i, delta_i) = (p[qi] for p in parts)
            dq_part, dk_part, dv_part = block_grads(q_i, kv[0][:, :, keys], kv[1][:, :, keys], dout_i, lse_i,
                                                    delta_i, mask)
            dq[:, :, qi * m:(qi + 1) * m] += dq_part
            grads[0][:, :, keys] += dk_part
            grads[1][:, :, keys] += dv_part
        if step >= 1:
            if step >= 2:
                for handle in arrival:
                    handle.wait()
                grads += travelling
            sending += ring.send_grads(grads)  # the last hop (step c-1) reaches the owner
        if not last:
            for handle in handles:
                handle.wait()
            kv = incoming
    if ring.size > 1:  # this rank's own accumulator, home after its c-1 hops
        home, arrival = ring.receive_grads(own)
        for handle in arrival + sending:
            handle.wait()
        own += home
    return dq, own[0], own[1]
