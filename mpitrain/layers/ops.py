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

Here: the linears' products, the embedding's row scatter, rotary positions and the causal attention core. The
row-wise ops tiled over the rank's threads (a bias's gradient, the norms, GELU, SwiGLU) live in
mpitrain/layers/row_ops.py and are re-exported here, so every layer calls its ops as `ops.NAME`.
"""
from __future__ import annotations

import numpy as np

from mpitrain.backend import array_module as _xp
from mpitrain.kernels import attention as gpu_attention
from mpitrain.kernels import fused
from mpitrain.kernels.dispatch import gpu_twin, gpu_twin_for_gemm_dtypes, gpu_twin_in_low_precision
from mpitrain.layers import attention_core
from mpitrain.layers.precision import computes_in_float32, low_precision_dtype
from mpitrain.layers.row_ops import (  # noqa: F401 (re-exported: the layers call every op through this module)
    add_bias_grad,
    as_rows,
    gelu_backward,
    gelu_backward_from_output,
    gelu_forward,
    layernorm_backward,
    layernorm_forward,
    rmsnorm_backward,
    rmsnorm_forward,
    swiglu_backward,
    swiglu_forward,
)


# ----------------------------------------------------------------------------- linear
@gpu_twin_in_low_precision(fused.linear_forward)
@computes_in_float32()
def linear_forward(x, w, b=None):
    y = as_rows(x) @ w
    if b is not None:
        y += b
    return y.reshape(*x.shape[:-1], w.shape[1]), x


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
    parts = (as_rows(dy) @ w.T for w, dy in zip(weights, output_grads))
    dx = next(parts)
    for part in parts:
        dx += part
    return dx.reshape(*output_grads[0].shape[:-1], weights[0].shape[0])


@gpu_twin_in_low_precision(fused.add_weight_grad)
@computes_in_float32("dw")
def add_weight_grad(dw, x, dy) -> None:
    dw += as_rows(x).T @ as_rows(dy)


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
    full = as_rows(x).T @ as_rows(combined)
    start = 0
    for dw in dws:
        dw += full[:, start:start + dw.shape[1]]
        start += dw.shape[1]


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
