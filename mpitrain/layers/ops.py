"""Transformer operations as forward/backward pairs over `xp` arrays.

Convention (docs/architecture.md, Layers): `y, saved = op_forward(..., x)` returns the output and exactly what
backward needs; `dx = op_backward(saved, ..., dy)` returns the input gradient and ADDS parameter gradients into the
given arrays in place (so micro-batches accumulate). Nothing is cached anywhere else: activation memory is what
`saved` holds. Linear weights are stored (in_features, out_features), so forward is `x @ w`. The ops that talk to
other ranks when a layer is split (embedding, loss) live in mpitrain/layers/tensor_parallel.py, and the linears'
collectives in mpitrain/layers/linear.py; with one rank they are the plain ops.

Every op computes in float32 when handed bfloat16/float16 arrays and rounds its outputs back (the one cast rule, in
mpitrain/layers/precision.py); float32/float64 arrays pass through untouched. CuPy arrays go to the fused twin an op
names in its `gpu_twin` decorator (mpitrain/kernels). The CPU fusions live inside the ops, so the layers have no CPU
branch: GELU takes the preceding linear's bias into its tiles, and the linears sharing an input make one product
where their output gradients lie side by side.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from mpitrain import tiles
from mpitrain.backend import array_module as _xp
from mpitrain.kernels import attention as gpu_attention
from mpitrain.kernels import fused
from mpitrain.kernels.dispatch import gpu_twin, gpu_twin_for_gemm_dtypes, gpu_twin_in_low_precision
from mpitrain.layers import attention_core
from mpitrain.layers.precision import computes_in_float32, low_precision_dtype

GELU_K = math.sqrt(2.0 / math.pi)


def _rows(x):
    return x.reshape(-1, x.shape[-1])


# ----------------------------------------------------------------------------- linear
@gpu_twin_in_low_precision(fused.linear_forward)
@computes_in_float32()
def linear_forward(x, w, b=None):
    y = _rows(x) @ w
    if b is not None:
        y += b
    return y.reshape(*x.shape[:-1], w.shape[1]), x


@computes_in_float32()
def _add_bias(x, b):
    return x + b


def _side_by_side(arrays):
    """The one array of which `arrays` are consecutive column blocks, in order (float32/float64 numpy views of one
    buffer with the same row strides: the Q/K/V gradients of the attention core), else None: linears sharing their
    input then make one product where they would make one per weight. bf16/fp16 keep one fp32 op per linear."""
    first = arrays[0]
    if (len(arrays) < 2 or _xp(first) is not np or low_precision_dtype((first,)) is not None or first.base is None
            or first.strides[-1] != first.itemsize):
        return None
    pointer = first.__array_interface__["data"][0]
    for array in arrays:
        if (array.base is not first.base or array.shape[:-1] != first.shape[:-1] or array.strides != first.strides
                or array.dtype != first.dtype or array.__array_interface__["data"][0] != pointer):
            return None
        pointer += array.shape[-1] * array.itemsize
    width = sum(array.shape[-1] for array in arrays)
    if any(stride < width * first.itemsize for stride in first.strides[:-1]):
        return None  # rows would overlap: not one buffer's rows
    return np.lib.stride_tricks.as_strided(first, (*first.shape[:-1], width), first.strides, writeable=False)


@gpu_twin_in_low_precision(fused.linear_input_grad)
@computes_in_float32()
def linear_input_grad(weights, output_grads):
    """sum_i dy_i w_i^T: the input gradient of linears that share one input (Q/K/V, gate/up); one product, with the
    weights side by side, where the dy_i lie side by side in one buffer."""
    combined = _side_by_side(output_grads)
    if combined is not None:
        weights, output_grads = [np.concatenate(weights, axis=1)], [combined]
    parts = (_rows(dy) @ w.T for w, dy in zip(weights, output_grads))
    dx = next(parts)
    for part in parts:
        dx += part
    return dx.reshape(*output_grads[0].shape[:-1], weights[0].shape[0])


@gpu_twin_in_low_precision(fused.add_weight_grad)
@computes_in_float32("dw")
def add_weight_grad(dw, x, dy) -> None:
    dw += _rows(x).T @ _rows(dy)


def share_one_buffer(arrays) -> bool:
    """Whether `arrays` are consecutive column blocks of one buffer, so that one product serves them all."""
    return _side_by_side(arrays) is not None


def add_weight_grads(dws, x, output_grads) -> None:
    """dws[i] += x^T dy_i for linears that share the input x: one product where the dy_i lie side by side in one
    buffer, its column blocks added to each dw; else one add_weight_grad per weight, in order."""
    combined = _side_by_side(output_grads)
    if combined is None:
        for dw, dy in zip(dws, output_grads):
            add_weight_grad(dw, x, dy)
        return
    full = _rows(x).T @ _rows(combined)
    start = 0
    for dw in dws:
        dw += full[:, start:start + dw.shape[1]]
        start += dw.shape[1]


@gpu_twin_in_low_precision(fused.add_bias_grad)
@computes_in_float32("db")
def add_bias_grad(db, dy) -> None:
    db += _rows(dy).sum(axis=0)


def scatter_add_rows(table, rows, values) -> None:
    """table[rows[i]] += values[i] for every i, a repeated row getting the sum (np.add.at's result). On numpy the
    values are sorted by row (stably: each row's sum runs in index order), summed per row by one reduceat and added
    once per row: much faster than np.add.at for an embedding's (tokens, width) gradient."""
    xp = _xp(table)
    if rows.size == 0:
        return
    if xp is not np:
        _scatter_add_rows_on_device(xp, table, rows, values)
        return
    order = np.argsort(rows, kind="stable")
    sorted_rows = rows[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_rows[1:] != sorted_rows[:-1])))
    table[sorted_rows[starts]] += np.add.reduceat(values[order], starts, axis=0)


def _scatter_add_rows_on_device(xp, table, rows, values) -> None:
    """CuPy's add.at takes no bfloat16 (its atomic adds cover int32/int64/uint32/uint64/float16/float32/float64): a
    bf16/fp16 table gets its touched rows' sums in float32, added and rounded once per row, as on numpy."""
    if table.dtype.itemsize >= 4:
        xp.add.at(table, rows, values)
        return
    touched, slot = xp.unique(rows, return_inverse=True)
    sums = xp.zeros((touched.size, *table.shape[1:]), dtype=np.float32)
    xp.add.at(sums, slot.reshape(-1), values.astype(np.float32, copy=False))
    table[touched] = (table[touched].astype(np.float32) + sums).astype(table.dtype)


# ----------------------------------------------------------------------------- norms
# Row tiles: each tile's chain of ufuncs runs in cache; the tiles spread over the rank's threads (mpitrain/tiles.py).
def _row_tiles(xp, n_rows, row_bytes, work):
    if xp is np:
        tiles.for_each_tile(n_rows, tiles.tile_rows(row_bytes), work)
    else:  # CuPy: one call over all rows
        work(0, 0, n_rows)


def _row_dots(xp, a, b):
    """(rows, 1): the dot product of each row of a with the same row of b (one pass, no temporary)."""
    if xp is np:
        return np.vecdot(a, b)[:, None]
    return (a * b).sum(axis=-1, keepdims=True)


def _norm_forward(x, w, b, eps, centre: bool):
    """layernorm (centre, bias b) or rmsnorm: (y, (xhat, rstd))."""
    xp = _xp(x)
    xr = _rows(x)
    xhat, y = xp.empty(xr.shape, x.dtype), xp.empty(xr.shape, x.dtype)
    rstd = xp.empty((xr.shape[0], 1), x.dtype)

    inv_width = 1.0 / xr.shape[1]

    def tile(_, start, stop):
        xs, xh, ys, rs = xr[start:stop], xhat[start:stop], y[start:stop], rstd[start:stop]
        if centre:
            xp.subtract(xs, xs.sum(axis=-1, keepdims=True) * inv_width, out=xh)
        centred = xh if centre else xs
        # the mean square by a dot product per row: no (rows, width) temporary for the squares
        xp.multiply(_row_dots(xp, centred, centred), inv_width, out=rs)
        rs += eps
        xp.sqrt(rs, out=rs)
        xp.divide(1.0, rs, out=rs)
        xp.multiply(centred, rs, out=xh)
        xp.multiply(xh, w, out=ys)
        if b is not None:
            ys += b

    _row_tiles(xp, xr.shape[0], xr.shape[1] * x.itemsize, tile)
    return y.reshape(x.shape), (xhat.reshape(x.shape), rstd.reshape(*x.shape[:-1], 1))


@gpu_twin(fused.layernorm_forward)
@computes_in_float32()
def layernorm_forward(x, w, b, eps):
    return _norm_forward(x, w, b, eps, centre=True)


@gpu_twin(fused.rmsnorm_forward)
@computes_in_float32()
def rmsnorm_forward(x, w, eps):
    return _norm_forward(x, w, None, eps, centre=False)


def _tile_count(xp, rows):
    """How many tiles _row_tiles cuts `rows` (2-D) into: one per-tile partial sum each."""
    return -(-rows.shape[0] // tiles.tile_rows(rows.shape[1] * rows.itemsize)) if xp is np else 1


def _norm_backward(xp, xhat, rstd, w, dy, dw, db, centre: bool, residual=None):
    """dx of layernorm (centre) or rmsnorm, plus `residual` where given (the other branch's gradient, added while
    the tile is in cache); dw (and db) += their sums over rows, added per tile in tile order."""
    xr, dyr, rs_all = _rows(xhat), _rows(dy), _rows(rstd)
    residual_rows = None if residual is None else _rows(residual)
    dx = xp.empty(xr.shape, dy.dtype)
    n_tiles = _tile_count(xp, xr)
    dw_parts = xp.empty((n_tiles, xr.shape[1]), dy.dtype)
    db_parts = xp.empty_like(dw_parts) if db is not None else None

    inv_width = 1.0 / xr.shape[1]

    def tile(index, start, stop):
        xh, dys, dxs, rs = xr[start:stop], dyr[start:stop], dx[start:stop], rs_all[start:stop]
        scratch = xp.multiply(dys, xh)
        scratch.sum(axis=0, out=dw_parts[index])
        if db is not None:
            dys.sum(axis=0, out=db_parts[index])
        xp.multiply(dys, w, out=dxs)  # dxhat
        # dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)); the row means by sums and dot products
        mean_dxhat_xhat = _row_dots(xp, dxs, xh) * inv_width
        xp.multiply(xh, mean_dxhat_xhat, out=scratch)
        if centre:
            scratch += dxs.sum(axis=-1, keepdims=True) * inv_width
        dxs -= scratch
        dxs *= rs
        if residual_rows is not None:
            dxs += residual_rows[start:stop]

    _row_tiles(xp, xr.shape[0], xr.shape[1] * xr.itemsize, tile)
    dw += dw_parts.sum(axis=0)
    if db is not None:
        db += db_parts.sum(axis=0)
    return dx.reshape(dy.shape)


@gpu_twin(fused.layernorm_backward, accumulators=("dw", "db"))
@computes_in_float32("dw", "db")
def layernorm_backward(saved, w, dy, dw, db, residual=None):
    """dx (+ residual, the gradient arriving by the residual branch: one pass fewer than adding it after)."""
    xhat, rstd = saved
    return _norm_backward(_xp(dy), xhat, rstd, w, dy, dw, db, True, residual)


@gpu_twin(fused.rmsnorm_backward, accumulators=("dw",))
@computes_in_float32("dw")
def rmsnorm_backward(saved, w, dy, dw, residual=None):
    xhat, rstd = saved
    return _norm_backward(_xp(dy), xhat, rstd, w, dy, dw, None, False, residual)


# ----------------------------------------------------------------------------- activations
# GELU-tanh written as x * sigmoid(2u), u = k (x + a x^3): the same function (1 + tanh(u) = 2 sigmoid(2u)), with one
# exp instead of a tanh (numpy's float32 exp is about twice as fast) and no cancellation in 1 + tanh(u) for x << 0.
def _minus_two_u(xp, xs, out):
    xp.multiply(xs, xs, out=out)
    out *= -2.0 * 0.044715 * GELU_K
    out += -2.0 * GELU_K
    out *= xs


def _quiet_overflow(xp):
    """exp(-2u) overflows to inf for x << 0, where sigmoid is exactly 0: expected, not a warning."""
    return np.errstate(over="ignore") if xp is np else contextlib.nullcontext()


@gpu_twin(fused.gelu_forward)
def gelu_forward(x, bias=None):
    """GELU (tanh approximation, GPT-2) of x + bias, saving only the pre-activation (the exp is recomputed in
    backward: memory over speed). bias, the preceding linear's, left out of its product: float32/float64 add it in
    place inside the tiles, x (that linear's fresh output) becoming the saved pre-activation, two passes fewer over
    the (tokens, ff) activations; bf16/fp16 add it first, an op of its own (its output rounded once)."""
    if bias is not None and low_precision_dtype((x,)) is not None:
        x, bias = _add_bias(x, bias), None
    return _gelu_forward(x, bias)


@computes_in_float32()
def _gelu_forward(x, bias):
    xp = _xp(x)
    xr = _rows(x)
    y = xp.empty(xr.shape, x.dtype)

    def tile(_, start, stop):
        xs, ys = xr[start:stop], y[start:stop]
        if bias is not None:
            xs += bias
        _minus_two_u(xp, xs, ys)
        with _quiet_overflow(xp):
            xp.exp(ys, out=ys)
        ys += 1.0
        xp.divide(xs, ys, out=ys)

    _row_tiles(xp, xr.shape[0], xr.shape[1] * x.itemsize, tile)
    return y.reshape(x.shape), x


@gpu_twin(fused.gelu_backward)
@computes_in_float32()
def gelu_backward(x, dy):
    xp = _xp(x)
    xr, dyr = _rows(x), _rows(dy)
    dx = xp.empty(xr.shape, dy.dtype)

    def tile(_, start, stop):
        xs, slope = xr[start:stop], dx[start:stop]
        sig = xp.empty_like(slope)
        _minus_two_u(xp, xs, sig)
        with _quiet_overflow(xp):
            xp.exp(sig, out=sig)
        sig += 1.0
        xp.divide(1.0, sig, out=sig)  # s = sigmoid(2u)
        # d/dx x s = s + x s (1 - s) 2k (1 + 3 a x^2)
        xp.multiply(xs, xs, out=slope)
        slope *= 3 * 0.044715 * 2.0 * GELU_K
        slope += 2.0 * GELU_K
        slope *= xs
        slope *= sig
        one_minus = xp.subtract(1.0, sig)
        slope *= one_minus
        slope += sig
        slope *= dyr[start:stop]

    _row_tiles(xp, xr.shape[0], xr.shape[1] * x.itemsize, tile)
    return dx.reshape(x.shape)


def gelu_backward_from_output(x, y, dy, db=None):
    """gelu_backward given also the forward's output y = x s (the next linear keeps it anyway): s = y / x, and 1/2
    where x = 0, instead of recomputing s with an exp (the exp is most of gelu_backward's time on the CPU).
    db: the bias gelu_forward took, whose gradient (the sum of dx over rows) is added per tile, in tile order.

    Low-precision (bf16/fp16) arrays and CuPy take gelu_backward: y rounded to bf16 would put bf16's rounding
    into s, and the GPU has its fused kernel."""
    if _xp(x) is not np or low_precision_dtype((x, y, dy)) is not None:
        dx = gelu_backward(x, dy)
        if db is not None:
            add_bias_grad(db, dx)
        return dx
    xr, yr, dyr = _rows(x), _rows(y), _rows(dy)
    dx = np.empty(xr.shape, dy.dtype)
    db_parts = np.empty((_tile_count(np, xr), xr.shape[1]), dy.dtype) if db is not None else None

    def tile(index, start, stop):
        xs, slope = xr[start:stop], dx[start:stop]
        with np.errstate(invalid="ignore"):  # 0 / 0 where x = 0, set to 1/2 below
            sig = np.divide(yr[start:stop], xs)
        zero = xs == 0
        if zero.any():
            sig[zero] = 0.5
        # d/dx x s = s + s (1 - s) x 2k (1 + 3 a x^2)
        np.multiply(xs, xs, out=slope)
        slope *= 3 * 0.044715 * 2.0 * GELU_K
        slope += 2.0 * GELU_K
        slope *= xs
        one_minus = np.subtract(1.0, sig)
        one_minus *= sig
        slope *= one_minus
        slope += sig
        slope *= dyr[start:stop]
        if db_parts is not None:
            slope.sum(axis=0, out=db_parts[index])

    _row_tiles(np, xr.shape[0], xr.shape[1] * x.itemsize, tile)
    if db is not None:
        db += db_parts.sum(axis=0)
    return dx.reshape(x.shape)


@gpu_twin(fused.swiglu_forward)
@computes_in_float32()
def swiglu_forward(gate, up):
    """silu(gate) * up (llama's MLP). Saves both inputs."""
    xp = _xp(gate)
    sig = 1.0 / (1.0 + xp.exp(-gate))
    return gate * sig * up, (gate, up)


@gpu_twin(fused.swiglu_backward)
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
    """cos/sin of shape (T, head_dim/2) for the given absolute positions (context parallelism passes its chunk's);
    (B, T, head_dim/2) for per-row positions (B, T), those inside packed documents (attention.rotate applies them)."""
    inv_freq = 1.0 / (theta ** (xp.arange(0, head_dim, 2, dtype=xp.float64) / head_dim))
    angles = xp.asarray(positions, dtype=xp.float64)[..., None] * inv_freq
    return xp.cos(angles).astype(dtype), xp.sin(angles).astype(dtype)


@gpu_twin(fused.rope_forward)
@computes_in_float32()
def rope_forward(x, cos, sin):
    """Rotate the two halves of each head (x: (B, H, T, D)); the 'rotate half' convention of Llama in HF."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    y = _xp(x).empty_like(x)
    y[..., :half] = x1 * cos - x2 * sin
    y[..., half:] = x2 * cos + x1 * sin
    return y


@gpu_twin(fused.rope_backward)
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


@gpu_twin_for_gemm_dtypes(gpu_attention.gpu_attention_forward)
@computes_in_float32()
def attention_forward(q, k, v, bias):
    """((out, lse), saved): softmax(q k^T / sqrt(D) + bias) v with grouped-query heads, and each query row's
    log-sum-exp of its scores, lse (B, H, Tq), by which attention over several key blocks is merged.

    q: (B, H, Tq, D); k, v: (B, Hkv, Tk, D) with H a multiple of Hkv; bias (Tq, Tk) or a scalar, e.g. causal_bias
    with the block's position offset, so that a block of queries can be run against a block of keys (context
    parallelism). saved holds q, k, v and the probabilities (B, Hkv, G*Tq, Tk): query heads that share a key/value
    head are stacked along the time axis, so K/V are never copied (on numpy also the output, for backward's
    rowsum(dO * O), and the key spans the blocks used).

    On numpy the work runs in layers/attention_core.py (blocks of query rows, one product per block over a stack
    of heads, masked key blocks skipped); CuPy float64 takes the whole batch in one product (whole_forward), the
    other CuPy dtypes kernels/attention.py: cuDNN's fused SDPA for bf16/fp16 under the causal mask or none when
    cuDNN is installed (saved then holds q, k, v, the output and cuDNN's float32 log-sum-exp instead of the
    probabilities), else cuBLAS's batched GEMMs.
    """
    if _xp(q) is not np:
        return attention_core.whole_forward(q, k, v, bias)
    return attention_core.attention_forward(q, k, v, bias)


@gpu_twin_for_gemm_dtypes(gpu_attention.gpu_attention_backward)
@computes_in_float32()
def attention_backward(saved, dout):
    if _xp(saved[0]) is not np:
        return attention_core.whole_backward(saved, dout)
    return attention_core.attention_backward(saved, dout)
