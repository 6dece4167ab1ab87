"""The causal attention core on numpy: softmax(q k^T / sqrt(D) + bias) v and its backward, re-exported by ops;
and its whole-batch form (whole_forward / whole_backward: CuPy's path, and the reference the tests hold the blocked
one to).

The work is cut into blocks of QUERY_BLOCK query rows. For each block, one np.matmul runs over a 3-D stack of every
(batch row, head) pair of a chunk of batch rows, so a step makes a few BLAS calls per block instead of one per pair
and block, and the softmax's elementwise passes run over the whole stack at once (OpenBLAS is slow on small
(128 x 64)(64 x keys) products, and Python's overhead per product adds up).

A block skips the keys its bias masks for every row of the block (the causal future: about half of the work); those
probabilities are exact zeros, and backward skips the same columns (the spans travel in the saved state). The bias
is added only from the first column where it is non-zero for some row of the block (the causal diagonal).

Backward uses FlashAttention's identity sum_j P_ij dP_ij = dO_i . O_i (a (rows, D) product instead of a pass over
the (rows, keys) block), with O the forward's output, saved as a view of the buffer the output projection keeps
anyway (no extra memory). Each chunk's widest key span writes dk/dv (matmul out=), the other blocks add to it.

The outputs (out, dq, dk, dv) are (B, heads, T, D) views of (B, T, heads, D) buffers: attention.merge_heads then
needs no copy to give the (B, T, heads * D) rows the output projection and the QKV linear take. dq, dk and dv share
one (B, T, H + 2 Hkv, D) buffer, side by side, so that the QKV linear's backward is one product. Chunks of batch rows
are spread over the tile threads (mpitrain/tiles.py); their boundaries depend on the shapes only.

The bias is a scalar, one (Tq, Tk) mask for every batch row (the causal one), or one per row, (B, Tq, Tk): packed
documents (`document_bias`, data.document_mask). A per-row mask can hide every key from a query row (ring
attention's block of an earlier chunk, all of another document): such a row gives out = 0 and lse = -inf, which the
log-sum-exp merge weighs zero, instead of softmax's NaN over nothing.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from mpitrain import tiles
from mpitrain.backend import array_module

QUERY_BLOCK = 128  # query rows per block (64 measured slower: more, smaller products)
CHUNK_BYTES = 256 * 1024  # a chunk's block of scores (at least one batch row): measured, larger ones leave the cache


def _heads_last(shape, dtype, zeros=False):
    """A (B, T, H, D) buffer seen as (B, H, T, D)."""
    b, h, t, d = shape
    return (np.zeros if zeros else np.empty)((b, t, h, d), dtype).transpose(0, 2, 1, 3)


def _batch_chunks(b, bytes_per_row, work):
    """work(b0, b1) over chunks of batch rows of about CHUNK_BYTES, chunks spread over the tile threads."""
    rows = max(1, min(b, CHUNK_BYTES // max(1, bytes_per_row)))
    tiles.for_each_tile(b, rows, lambda _, b0, b1: work(b0, b1))


def attention_forward(q, k, v, bias):
    b, h, t, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = h // hkv
    out = _heads_last(q.shape, q.dtype)
    qg, out_g = q.reshape(b, hkv, group, t, d), out.reshape(b, hkv, group, t, d)
    k_t = k.swapaxes(-1, -2)[:, :, None]  # (B, Hkv, 1, D, Tk): broadcast over the group's query heads
    v_g = v[:, :, None]
    probs = np.empty((b, hkv, group, t, tk), q.dtype)
    lse = np.empty((b, hkv, group, t), q.dtype)
    spans = _key_spans(bias, t, tk)
    scale = 1.0 / math.sqrt(d)
    biased = getattr(bias, "ndim", 0) > 0
    per_row = getattr(bias, "ndim", 0) == 3  # one mask per batch row: packed documents
    bias_starts = [_first_nonzero_column(bias[..., q0:q1, :], k0, k1) if biased else k0 for q0, q1, k0, k1 in spans]
    if not biased and bias is not None and float(bias) == 0.0:
        bias = None  # adding 0.0 changes nothing

    def chunk(b0, b1):
        for (q0, q1, k0, k1), bias_from in zip(spans, bias_starts):
            s = probs[b0:b1, :, :, q0:q1]
            s[..., :k0] = 0.0
            s[..., k1:] = 0.0
            # scaling the (rows, D) queries instead of the (rows, keys) scores saves a pass over the scores
            np.matmul(qg[b0:b1, :, :, q0:q1] * scale, k_t[b0:b1, ..., k0:k1], out=s[..., k0:k1])
            if per_row:
                s[..., bias_from:k1] += bias[b0:b1, None, None, q0:q1, bias_from:k1]
            elif biased:
                s[..., bias_from:k1] += bias[q0:q1, bias_from:k1]  # adding exact zeros changes nothing
            elif bias is not None:
                s[..., k0:k1] += bias
            s = s[..., k0:k1]
            row_max = s.max(axis=-1, keepdims=True)
            if per_row:  # a row that sees no key: exp(-inf - 0) = 0 everywhere, not exp(-inf + inf) = NaN
                row_max[row_max == -np.inf] = 0.0
            s -= row_max
            np.exp(s, out=s)
            row_sum = s.sum(axis=-1, keepdims=True)
            if per_row:
                s *= 1.0 / np.where(row_sum == 0.0, 1.0, row_sum)  # ... and its probabilities stay 0
            else:
                s *= 1.0 / row_sum  # one division per row, then products (faster than dividing every score)
            np.matmul(s, v_g[b0:b1, :, :, k0:k1], out=out_g[b0:b1, :, :, q0:q1])
            with np.errstate(divide="ignore") if per_row else contextlib.nullcontext():  # log(0): a row seeing no key
                np.log(row_sum, out=row_sum)
            np.add(row_max[..., 0], row_sum[..., 0], out=lse[b0:b1, :, :, q0:q1])

    _batch_chunks(b, h * min(t, QUERY_BLOCK) * tk * q.itemsize, chunk)
    probs = probs.reshape(b, hkv, group * t, tk)
    return (out, lse.reshape(b, h, t)), (q, k, v, probs, out, tuple(spans))


def _first_nonzero_column(bias_rows, k0, k1):
    """The first column of [k0, k1) where some row of the block's bias (of some batch row) is not 0 (k1 if none)."""
    nonzero = np.flatnonzero((bias_rows[..., k0:k1] != 0).reshape(-1, k1 - k0).any(axis=0))
    return k0 + int(nonzero[0]) if nonzero.size else k1


def _key_spans(bias, t_q, t_k):
    """[(q0, q1, k0, k1)]: blocks of query rows and the key columns [k0, k1) outside of which the bias masks (-inf)
    every row of the block (of every batch row, for a per-row bias). A block whose rows are all fully masked keeps
    every key (and gives NaN, as softmax over nothing does; 0 and lse -inf under a per-row bias)."""
    spans = []
    ndim = getattr(bias, "ndim", 0)
    visible = np.isfinite(bias) if ndim == 2 else np.isfinite(bias).any(axis=0) if ndim == 3 else None
    for q0 in range(0, t_q, QUERY_BLOCK):
        q1 = min(q0 + QUERY_BLOCK, t_q)
        k0, k1 = 0, t_k
        if visible is not None:
            columns = np.flatnonzero(visible[q0:q1].any(axis=0))
            if columns.size:
                k0, k1 = int(columns[0]), int(columns[-1]) + 1
        spans.append((q0, q1, k0, k1))
    return spans


def attention_backward(saved, dout):
    q, k, v, probs, out, spans = saved
    b, h, t, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = h // hkv
    probs = probs.reshape(b, hkv, group, t, tk)
    qg, dout_g = q.reshape(b, hkv, group, t, d), dout.reshape(b, hkv, group, t, d)
    out_g = out.reshape(b, hkv, group, t, d)
    if tk == t:  # dq, dk, dv side by side in one (B, T, H + 2 Hkv, D) buffer: the QKV linear's backward is one product
        grads = _heads_last((b, h + 2 * hkv, t, d), dout.dtype)
        dq, dk, dv = grads[:, :h], grads[:, h:h + hkv], grads[:, h + hkv:]
    else:  # a block of queries against another block's keys (context parallelism)
        dq, dk, dv = (_heads_last(x.shape, dout.dtype) for x in (q, k, v))
    dq_g = dq.reshape(b, hkv, group, t, d)
    k_g, v_t = k[:, :, None], v.swapaxes(-1, -2)[:, :, None]
    scale = 1.0 / math.sqrt(d)
    # the widest key span first: it writes its dk/dv rows (and zeros the keys it leaves out), later blocks add
    order = sorted(spans, key=lambda span: span[2] - span[3])

    def chunk(b0, b1):
        # softmax backward: ds = p * (dp - D), D_i = sum_j p_ij dp_ij = dO_i . O_i; with the score scale folded in
        # (ds scale = p (dp scale - D scale)), dq = ds k and dk = ds^T q need no pass of their own for it
        row_dots = np.vecdot(dout_g[b0:b1], out_g[b0:b1])[..., None]
        row_dots *= scale
        for index, (q0, q1, k0, k1) in enumerate(order):
            p, do = probs[b0:b1, :, :, q0:q1, k0:k1], dout_g[b0:b1, :, :, q0:q1]
            dk_keys, dv_keys = dk[b0:b1, :, k0:k1], dv[b0:b1, :, k0:k1]
            if index == 0:
                for grad in (dk, dv):
                    grad[b0:b1, :, :k0] = 0.0
                    grad[b0:b1, :, k1:] = 0.0
            _add_product(dv_keys, p.swapaxes(-1, -2), do, write=index == 0)  # sums over the group's query heads
            ds = (do * scale) @ v_t[b0:b1, ..., k0:k1]  # the scale on the (rows, D) dO, not the (rows, keys) ds
            ds -= row_dots[:, :, :, q0:q1]
            ds *= p
            np.matmul(ds, k_g[b0:b1, :, :, k0:k1], out=dq_g[b0:b1, :, :, q0:q1])
            _add_product(dk_keys, ds.swapaxes(-1, -2), qg[b0:b1, :, :, q0:q1], write=index == 0)

    _batch_chunks(b, h * min(t, QUERY_BLOCK) * tk * q.itemsize, chunk)
    return dq, dk, dv


def _add_product(target, a, b, write: bool):
    """target (B, Hkv, keys, D) = (write) or += (not write) the sum over the group axis of a @ b (B, Hkv, G, ...)."""
    if write and a.shape[2] == 1:
        np.matmul(a, b, out=target[:, :, None])
    elif write:
        np.sum(a @ b, axis=2, out=target)
    else:
        target += _sum_group(a @ b)


def _sum_group(x):
    """(B, Hkv, G, ...) -> (B, Hkv, ...): the query heads of a group share their K/V head's gradient."""
    return x[:, :, 0] if x.shape[2] == 1 else x.sum(axis=2)


def document_bias(ids_q, positions_q, ids_k, positions_k, xp, dtype):
    """Additive mask (B, Tq, Tk) of packed documents (mpitrain/data/documents.py): 0 where the key is in the query's
    document and not after it (position in the document <= the query's), -inf elsewhere. Within one row this is the
    causal mask cut at document boundaries; for a block of queries and a block of keys (ring attention) it needs no
    offsets, only the blocks' own document ids and positions."""
    same = ids_q[:, :, None] == ids_k[:, None, :]
    seen = positions_k[:, None, :] <= positions_q[:, :, None]
    return xp.where(same & seen, 0.0, -xp.inf).astype(dtype)


def whole_forward(q, k, v, bias):
    """attention_forward over the whole batch in one product per stage (CuPy's path; no key blocks skipped).
    saved: (q, k, v, probs)."""
    xp = array_module(q)
    b, h, t, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    qg = q.reshape(b, hkv, group * t, d)
    scores = qg @ k.swapaxes(-1, -2)  # (B, Hkv, G*Tq, Tk)
    scores *= 1.0 / math.sqrt(d)
    scores = scores.reshape(b, hkv, group, t, -1)
    per_row = getattr(bias, "ndim", 0) == 3
    scores += bias[:, None, None] if per_row else bias
    row_max = scores.max(axis=-1, keepdims=True)
    if per_row:  # rows that see no key: probabilities 0, lse -inf (module docstring)
        row_max = xp.where(row_max == -xp.inf, 0.0, row_max)
    scores -= row_max
    probs = xp.exp(scores, out=scores)
    row_sum = probs.sum(axis=-1, keepdims=True)
    probs /= xp.where(row_sum == 0.0, 1.0, row_sum) if per_row else row_sum
    probs = probs.reshape(b, hkv, group * t, -1)
    out = (probs @ v).reshape(b, h, t, d)
    with np.errstate(divide="ignore"):  # log(0) = -inf for a row that sees no key (numpy arrays)
        lse = (row_max + xp.log(row_sum)).reshape(b, h, t)
    return (out, lse), (q, k, v, probs)


def whole_backward(saved, dout):
    """attention_backward of whole_forward's saved state."""
    q, k, v, probs = saved
    b, h, t, d = q.shape
    hkv = k.shape[1]
    dout_g = dout.reshape(b, hkv, (h // hkv) * t, d)
    dv = probs.swapaxes(-1, -2) @ dout_g  # sums over the query heads of each group
    dprobs = dout_g @ v.swapaxes(-1, -2)
    # softmax backward: ds = p * (dp - sum(dp * p))
    dscores = dprobs
    dscores -= (dprobs * probs).sum(axis=-1, keepdims=True)
    dscores *= probs
    dscores *= 1.0 / math.sqrt(d)
    dq = (dscores @ k).reshape(b, h, t, d)
    dk = dscores.swapaxes(-1, -2) @ q.reshape(b, hkv, -1, d)
    return dq, dk, dv
