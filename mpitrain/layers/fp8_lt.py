"""The FP8 linears' three GEMMs, routed: cuBLASLt's FP8 GEMM (mpitrain/kernels/fp8_gemm.py) for CuPy arrays where
it takes the recipe, else the emulation's matmul of the dequantized operands (mpitrain/layers/ops.py), which numpy
arrays always take, so CPU runs stay bit for bit what they were.

    forward   y  = x @ w          X = x (M, K) e4m3,      Y = w^T (N, K) e4m3   (a transposed copy of the codes)
    dgrad     dx = dy @ w^T       X = dy (M, N) e5m2,     Y = w (K, N) e4m3
    wgrad     dW = x^T @ dy       X = x^T (K, M) e4m3,    Y = dy^T (N, M) e5m2  (per-tensor recipes only)

The operands arrive as the emulation hands them to the matmul: dequantized values (codes * scale_inv), after the
tensor-parallel gathers and the sequence chunks of parallel.tp_overlap. They are encoded back to their fp8 codes
here: per tensor with the scale Fp8Gemms used for that operand (`scale_of`: of the operand key's latest scales, the
one under which the codes dequantize back to exactly these values; a gather or a chunk keeps it), per 1x128
tile / 128x128 block with the scales taken again from the values (an fp8 block's largest code is the format's max,
so its amax gives the scale back to float32 rounding and the codes exactly).

What keeps the emulation on a device, and why: mxfp8 (VEC32_UE8M0 GEMMs are Blackwell-only), float64 compute (no
FP8 GEMM accumulates in float64), the block recipe's weight gradient (its operands are scaled along the
non-reduced axis, which no cuBLASLt scale mode expresses; Transformer Engine keeps a column-wise copy for it), and
shapes cuBLASLt refuses (fp8_gemm.unsupported_reason: model dims not multiples of 16, K not of 128 under block;
the token dim is padded, below).

Token rows. The token count (M of the forward and dgrad, the reduction of wgrad) is rarely a multiple of 16 for an
MoE expert, whose rows are whatever the router sent it, so it is padded up to one with zero rows before the call
(`pad_tokens`): a zero row encodes to zero codes under any scale (a tile of zeros gets scale 1), so in the forward
and dgrad it gives output rows that are dropped, and in wgrad zero terms of the sum. Exact, and it leaves every
1x128 tile / 128x128 block of the other dimensions as it was. The other dims (model widths) are not padded.
UNTESTED ON A DEVICE: checked on the CPU through a fake cuBLASLt binding (tests/test_fp8_gemm.py).
"""
from __future__ import annotations

import numpy as np

from mpitrain.backend import array_module
from mpitrain.kernels import fp8_gemm
from mpitrain.layers import ops
from mpitrain.layers.fp8 import TILE, block_amax, cast_saturating, expand_blocks, tensor_scale


def runner(fp8, array):
    """The Fp8Lt that runs this linear's GEMMs, or None (the emulation's matmul)."""
    if fp8 is None or fp8.recipe not in fp8_gemm.LT_RECIPES:
        return None
    if fp8.lt is not None:  # set explicitly: the tests' fake binding over host arrays (float64 too: exact operands)
        return fp8.lt
    if array_module(array) is np or array.dtype != np.float32:  # float64: no FP8 GEMM accumulates in it
        return None
    return fp8_gemm.device_lt()[0]


def encode(fp8, values, key: str, fmt: str, mode: str) -> fp8_gemm.Fp8Operand:
    """Dequantized values (rows, K), K contiguous -> their fp8 codes and scales, or None (no scale of `key`
    reproduces them: the caller emulates). `mode`: "scalar" (the scale Fp8Gemms used for `key`), "vec128" (1x128
    tiles along K) or "blk128" (128x128 blocks)."""
    xp = array_module(values)
    if mode == "scalar":
        found = scale_of(fp8, key, values, fmt)
        if found is None:
            return None
        codes, scale_inv = found
        return fp8_gemm.Fp8Operand(fp8_gemm.fp8_bits(codes, fmt), fmt,
                                   fp8_gemm.cublas_scales(xp.asarray(scale_inv), mode), mode)
    block = (1, TILE) if mode == "vec128" else (TILE, TILE)
    scale, scale_inv = tensor_scale(block_amax(values, block), fmt)
    codes = cast_saturating(values * expand_blocks(scale, block, values.shape), fmt)
    return fp8_gemm.Fp8Operand(fp8_gemm.fp8_bits(codes, fmt), fmt, fp8_gemm.cublas_scales(scale_inv, mode), mode)


def scale_of(fp8, key: str, values, fmt: str):
    """(codes, scale_inv) of a per-tensor operand: the latest scale of `key` under which the codes dequantize back
    to exactly these values (a micro-batch's operand may be older than the key's newest scale), or None."""
    xp = array_module(values)
    for scale, scale_inv in fp8.recent_scales.get(key, []):
        codes = cast_saturating(values * np.float32(scale), fmt)
        if bool(xp.all(codes.astype(values.dtype) * values.dtype.type(scale_inv) == values)):
            return codes, scale_inv
    return None


def _modes(fp8) -> tuple[str, str]:
    return ("scalar", "scalar") if fp8.recipe != "block" else ("vec128", "blk128")


def pad_tokens(values, axis: int):
    """`values` with zeros appended along `axis` up to the next multiple of fp8_gemm.ALIGN (itself when it is one)."""
    short = -values.shape[axis] % fp8_gemm.ALIGN
    if short == 0:
        return values
    xp = array_module(values)
    shape = list(values.shape)
    shape[axis] = short
    return xp.concatenate([values, xp.zeros(shape, dtype=values.dtype)], axis=axis)


def _lt_product(fp8, lt, x, x_key, x_fmt, y, y_key, y_fmt, tokens: str):
    """X @ Y^T through cuBLASLt (float32), or None where it cannot take this shape (the caller emulates).
    `tokens`: which dim is the token count, padded with zeros to a multiple of 16 (module docstring): "m" (X's rows:
    the padded output rows are dropped) or "k" (the reduction: zero terms; per-tensor scales only, as wgrad)."""
    x_mode, y_mode = _modes(fp8)
    m = x.shape[0]
    if tokens == "m":
        x = pad_tokens(x, 0)
    else:
        x, y = pad_tokens(x, 1), pad_tokens(y, 1)
    (padded_m, k), n = x.shape, y.shape[0]
    probe = [fp8_gemm.Fp8Operand(None, fmt, None, mode) for fmt, mode in ((x_fmt, x_mode), (y_fmt, y_mode))]
    if fp8_gemm.unsupported_reason(padded_m, n, k, *probe):
        return None
    xp = array_module(x)
    operands = [encode(fp8, xp.ascontiguousarray(a), key, fmt, mode)
                for a, key, fmt, mode in ((x, x_key, x_fmt, x_mode), (y, y_key, y_fmt, y_mode))]
    return None if None in operands else lt.matmul(*operands)[:m]


def linear_forward(fp8, keys: tuple[str, str], x, w, b=None):
    """ops.linear_forward(x, w, b) of the dequantized input and weight; keys: (the input's, the weight's)."""
    lt = runner(fp8, x)
    y = None if lt is None else _lt_product(fp8, lt, x.reshape(-1, x.shape[-1]), keys[0], "e4m3", w.T, keys[1],
                                           "e4m3", tokens="m")
    if y is None:
        return ops.linear_forward(x, w, b)
    if b is not None:
        y += b.astype(y.dtype, copy=False)  # a bf16 bias: CuPy's bfloat16 arithmetic is not to be mixed in
    return y.reshape(*x.shape[:-1], w.shape[1]), x


def linear_input_grad(fp8, weight_keys, weights, grad_keys, output_grads):
    """ops.linear_input_grad: sum_i dy_i w_i^T, each product through cuBLASLt where it can."""
    lt = runner(fp8, output_grads[0])
    if lt is None:
        return ops.linear_input_grad(weights, output_grads)
    dx = None
    for w_key, w, dy_key, dy in zip(weight_keys, weights, grad_keys, output_grads):
        rows = dy.reshape(-1, dy.shape[-1])
        part = _lt_product(fp8, lt, rows, dy_key, "e5m2", w, w_key, "e4m3", tokens="m")
        part = rows @ w.T if part is None else part
        dx = part if dx is None else dx + part
    return dx.reshape(*output_grads[0].shape[:-1], weights[0].shape[0])


def add_weight_grad(fp8, keys: tuple[str, str], dw, x, dy) -> None:
    """ops.add_weight_grad: dw += x^T dy; keys: (the input's, the output gradient's)."""
    lt = runner(fp8, x) if fp8 is not None and fp8.recipe != "block" else None
    rows_x, rows_dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    product = None if lt is None else _lt_product(fp8, lt, rows_x.T, keys[0], "e4m3", rows_dy.T, keys[1], "e5m2",
                                                        tokens="k")
    if product is None:
        ops.add_weight_grad(dw, x, dy)
    else:
        dw += product.astype(dw.dtype, copy=False)
