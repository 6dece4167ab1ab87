"""Transformer operations as forward/backward pairs over `xp` arrays.

Convention (design decision 1): `y, saved = op_forward(..., x)` returns the output and exactly what backward needs;
`dx = op_backward(saved, ..., dy)` returns the input gradient and ADDS parameter gradients into the given arrays in
place (so micro-batches accumulate). Nothing is cached anywhere else: activation memory is what `saved` holds.
Linear weights are stored (in_features, out_features), so forward is `x @ w`. The ops that talk to other ranks when
a layer is split (embedding, loss) live in mpitrain/layers/tensor_parallel.py, and the linears' collectives in
mpitrain/layers/linear.py; with one rank they are the plain ops.

Every op computes in float32 when handed bfloat16/float16 arrays and rounds its outputs back (the one cast rule, in
mpitrain/layers/precision.py); float32/float64 arrays pass through untouched.
"""
from __future__ import annotations

import math

from mpitrain.backend import array_module as _xp
from mpitrain.layers.precision import computes_in_float32

GELU_K = math.sqrt(2.0 / math.pi)


def _rows(x):
    return x.reshape(-1, x.shape[-1])


# ----------------------------------------------------------------------------- linear
@computes_in_float32()
def linear_forward(x, w, b=None):
    y = _rows(x) @ w
    if b is not None:
        y += b
    return y.reshape(*x.shape[:-1], w.shape[1]), x


@computes_in_float32()
def linear_input_grad(weights, output_grads):
    """sum_i dy_i w_i^T: the input gradient of linears that share one input (Q/K/V, gate/up)."""
    dx = None
    for w, dy in zip(weights, output_grads):
        part = _rows(dy) @ w.T
        if dx is None:
            dx = part
        else:
            dx += part
    return dx.reshape(*output_grads[0].shape[:-1], weights[0].shape[0])


@computes_in_float32("dw")
def add_weight_grad(dw, x, dy) -> None:
    dw += _rows(x).T @ _rows(dy)


@computes_in_float32("db")
def add_bias_grad(db, dy) -> None:
    db += _rows(dy).sum(axis=0)


# ----------------------------------------------------------------------------- norms
@computes_in_float32()
def layernorm_forward(x, w, b, eps):
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    rstd = 1.0 / _xp(x).sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    xhat = xc
    xhat *= rstd
    y = xhat * w
    y += b
    return y, (xhat, rstd)


@computes_in_float32("dw", "db")
def layernorm_backward(saved, w, dy, dw, db):
    xhat, rstd = saved
    dw += (_rows(dy) * _rows(xhat)).sum(axis=0)
    db += _rows(dy).sum(axis=0)
    dxhat = dy * w
    dx = dxhat - dxhat.mean(axis=-1, keepdims=True)
    dx -= xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
    dx *= rstd
    return dx


@computes_in_float32()
def rmsnorm_forward(x, w, eps):
    rstd = 1.0 / _xp(x).sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    xhat = x * rstd
    return xhat * w, (xhat, rstd)


@computes_in_float32("dw")
def rmsnorm_backward(saved, w, dy, dw):
    xhat, rstd = saved
    dw += (_rows(dy) * _rows(xhat)).sum(axis=0)
    dxhat = dy * w
    dx = dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
    dx *= rstd
    return dx


# ----------------------------------------------------------------------------- activations
@computes_in_float32()
def gelu_forward(x):
    """GELU, tanh approximation (GPT-2). Saves only x; tanh is recomputed in backward (memory over speed)."""
    xp = _xp(x)
    inner = x * x
    inner *= 0.044715 * GELU_K
    inner += GELU_K
    inner *= x
    y = xp.tanh(inner)
    y += 1.0
    y *= x
    y *= 0.5
    return y, x


@computes_in_float32()
def gelu_backward(x, dy):
    xp = _xp(x)
    x2 = x * x
    t = x2 * (0.044715 * GELU_K)
    t += GELU_K
    t *= x
    t = xp.tanh(t, out=t)
    # d/dx 0.5 x (1 + t) = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 a x^2)
    slope = x2
    slope *= 3 * 0.044715 * GELU_K
    slope += GELU_K
    slope *= x
    slope *= 0.5
    slope *= 1.0 - t * t
    t += 1.0
    t *= 0.5
    slope += t
    slope *= dy
    return slope


@computes_in_float32()
def swiglu_forward(gate, up):
    """silu(gate) * up (llama's MLP). Saves both inputs."""
    xp = _xp(gate)
    sig = 1.0 / (1.0 + xp.exp(-gate))
    return gate * sig * up, (gate, up)


@computes_in_float32()
def swiglu_backward(saved, dy):
    gate, up = saved
    xp = _xp(gate)
    sig = 1.0 / (1.0 + xp.exp(-gate))
    silu = gate * sig
    d_up = dy * silu
    # d silu / d gate = sig * (1 + gate * (1 - sig))
    d_gate = 1.0 - sig
    d_gate *= gate
    d_gate += 1.0
    d_gate *= sig
    d_gate *= dy
    d_gate *= up
    return d_gate, d_up


# ----------------------------------------------------------------------------- rotary positions (llama)
def rope_tables(positions, head_dim, theta, xp, dtype):
    """cos/sin of shape (T, head_dim/2) for the given absolute positions (context parallelism passes its chunk's)."""
    inv_freq = 1.0 / (theta ** (xp.arange(0, head_dim, 2, dtype=xp.float64) / head_dim))
    angles = xp.asarray(positions, dtype=xp.float64)[:, None] * inv_freq[None, :]
    return xp.cos(angles).astype(dtype), xp.sin(angles).astype(dtype)


@computes_in_float32()
def rope_forward(x, cos, sin):
    """Rotate the two halves of each head (x: (B, H, T, D)); the 'rotate half' convention of Llama in HF."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    y = _xp(x).empty_like(x)
    y[..., :half] = x1 * cos - x2 * sin
    y[..., half:] = x2 * cos + x1 * sin
    return y


@computes_in_float32()
def rope_backward(dy, cos, sin):
    """The rotation's transpose: rotate by -angle."""
    half = dy.shape[-1] // 2
    d1, d2 = dy[..., :half], dy[..., half:]
    dx = _xp(dy).empty_like(dy)
    dx[..., :half] = d1 * cos + d2 * sin
    dx[..., half:] = d2 * cos - d1 * sin
    return dx


# ----------------------------------------------------------------------------- causal attention
def causal_bias(t_q, t_k, xp, dtype, offset=0):
    """Additive mask (t_q, t_k): 0 where key position <= query position + offset, -inf elsewhere."""
    q = xp.arange(t_q)[:, None] + offset
    k = xp.arange(t_k)[None, :]
    return xp.where(k <= q, 0.0, -xp.inf).astype(dtype)


@computes_in_float32()
def attention_forward(q, k, v, bias):
    """((out, lse), saved): softmax(q k^T / sqrt(D) + bias) v with grouped-query heads, and each query row's
    log-sum-exp of its scores, lse (B, H, Tq), by which attention over several key blocks is merged.

    q: (B, H, Tq, D); k, v: (B, Hkv, Tk, D) with H a multiple of Hkv; bias (Tq, Tk), e.g. causal_bias with the
    block's position offset, so that a block of queries can be run against a block of keys (context parallelism).
    Query heads that share a key/value head are stacked along the time axis, (B, Hkv, G*Tq, D), so each product is
    one large matmul and K/V are never copied.
    """
    xp = _xp(q)
    b, h, t, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    qg = q.reshape(b, hkv, group * t, d)
    scores = qg @ k.swapaxes(-1, -2)  # (B, Hkv, G*Tq, Tk)
    scores *= 1.0 / math.sqrt(d)
    scores = scores.reshape(b, hkv, group, t, -1)
    scores += bias
    row_max = scores.max(axis=-1, keepdims=True)
    scores -= row_max
    probs = xp.exp(scores, out=scores)
    row_sum = probs.sum(axis=-1, keepdims=True)
    probs /= row_sum
    probs = probs.reshape(b, hkv, group * t, -1)
    out = (probs @ v).reshape(b, h, t, d)
    lse = (row_max + xp.log(row_sum)).reshape(b, h, t)
    return (out, lse), (q, k, v, probs)


@computes_in_float32()
def attention_backward(saved, dout):
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
