"""The row-wise ops: a bias's gradient, layernorm and rmsnorm, GELU and SwiGLU, forward/backward pairs with the
convention of layers/ops.py (which re-exports them). The norms' and activations' chains of ufuncs run over rows in
cache-sized tiles spread over the rank's threads (mpitrain/tiles.py); each tile's partial sums of a parameter
gradient are added in tile order, so the result does not depend on the thread count. CuPy arrays go to the fused
twin each op names (mpitrain/kernels/fused.py).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from mpitrain import tiles
from mpitrain.backend import array_module as _xp
from mpitrain.kernels import fused
from mpitrain.kernels.dispatch import gpu_twin, gpu_twin_in_low_precision
from mpitrain.layers.precision import computes_in_float32, low_precision_dtype

GELU_K = math.sqrt(2.0 / math.pi)


def as_rows(x):
    """x as (rows, last axis): a view for the contiguous arrays the ops take."""
    return x.reshape(-1, x.shape[-1])


# ----------------------------------------------------------------------------- biases
@computes_in_float32()
def _add_bias(x, b):
    return x + b


@gpu_twin_in_low_precision(fused.add_bias_grad)
@computes_in_float32("db")
def add_bias_grad(db, dy) -> None:
    db += as_rows(dy).sum(axis=0)


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
    xr = as_rows(x)
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
    xr, dyr, rs_all = as_rows(xhat), as_rows(dy), as_rows(rstd)
    residual_rows = None if residual is None else as_rows(residual)
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
    xr = as_rows(x)
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
    xr, dyr = as_rows(x), as_rows(dy)
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
    xr, yr, dyr = as_rows(x), as_rows(y), as_rows(dy)
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
