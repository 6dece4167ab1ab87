"""Attention's batched products on the GPU through cuBLAS strided-batched GEMM (fp32 accumulation), the twins of
ops.attention_forward / ops.attention_backward for CuPy arrays (chosen where those ops are defined, with
kernels/dispatch.py's gpu_twin_for_gemm_dtypes).

CuPy 14's batched matmul fails on bf16 and silently upcasts fp16, so q k^T, p v and the backward's four products go
through `gemmStridedBatchedEx` in the data's own dtype (`batched_matmul`). The scores and their gradient come out of
cuBLAS in fp32 and the softmax runs in fp32; the probabilities are rounded to the data dtype once, for the p v product
and for what is saved (the same memory as the numpy ops' cast rule keeps). The T x T scores are still materialised: a
flash-style kernel that never holds them is NOT built yet.

The glue is written over an injected `matmul` so it runs on CPU too: `gemm_strided_batched_args` is the pure
function that turns row-major shapes into cuBLAS's column-major arguments, and the tests check it, and these two
functions, against np.matmul through a numpy emulation of the cuBLAS call.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from mpitrain.backend import array_module

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1


class GemmArgs(NamedTuple):
    """The arguments of cublas<t>gemmStridedBatched(Ex), in cuBLAS's order, for row-major C = op(a) @ op(b)."""
    transa: int
    transb: int
    m: int
    n: int
    k: int
    first: str   # which row-major operand cuBLAS's "A" is ("b": row-major C = A B is column-major C^T = B^T A^T)
    lda: int
    stride_a: int
    ldb: int
    stride_b: int
    ldc: int
    stride_c: int
    batch: int
    out_shape: tuple


def gemm_strided_batched_args(a_shape, b_shape, transpose_a: bool = False, transpose_b: bool = False) -> GemmArgs:
    """cuBLAS arguments for out[i] = op(a[i]) @ op(b[i]), a, b, out contiguous 3-D row-major arrays.

    A row-major (r, c) matrix is a column-major (c, r) one with leading dimension c, so cuBLAS computes C^T = op(b)^T
    op(a)^T: its "A" is our b, its "B" our a, and m, n are our columns and rows of the result."""
    if len(a_shape) != 3 or len(b_shape) != 3 or a_shape[0] != b_shape[0]:
        raise ValueError(f"batched GEMM: 3-D arrays with one batch size, got {tuple(a_shape)} and {tuple(b_shape)}")
    batch = a_shape[0]
    rows, inner = (a_shape[2], a_shape[1]) if transpose_a else (a_shape[1], a_shape[2])
    inner_b, cols = (b_shape[2], b_shape[1]) if transpose_b else (b_shape[1], b_shape[2])
    if inner != inner_b:
        raise ValueError(f"batched GEMM: inner sizes differ ({inner} and {inner_b})")
    return GemmArgs(transa=CUBLAS_OP_T if transpose_b else CUBLAS_OP_N,
                    transb=CUBLAS_OP_T if transpose_a else CUBLAS_OP_N,
                    m=cols, n=rows, k=inner, first="b",
                    lda=b_shape[2], stride_a=b_shape[1] * b_shape[2],
                    ldb=a_shape[2], stride_b=a_shape[1] * a_shape[2],
                    ldc=cols, stride_c=rows * cols, batch=batch, out_shape=(batch, rows, cols))


def _accumulate_dtype(dtype):
    """fp32 for bf16/fp16/fp32 (cuBLAS's CUBLAS_COMPUTE_32F), float64 stays float64 (CPU tests of the glue)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def attention_forward(q, k, v, bias, matmul):
    """ops.attention_forward's contract ((out, lse), (q, k, v, probs)), each product one batched GEMM over
    (batch x kv head) with a group's query heads stacked along time; `matmul(a, b, transpose_a, transpose_b,
    out_dtype)` is fused.batched_matmul on the GPU."""
    xp = array_module(q)
    b, h, t, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = h // hkv
    wide = _accumulate_dtype(q.dtype)
    qg = q.reshape(b * hkv, group * t, d)
    scores = matmul(qg, k.reshape(b * hkv, tk, d), False, True, wide)  # (B*Hkv, G*T, Tk), fp32
    scores *= 1.0 / math.sqrt(d)
    scores = scores.reshape(b, hkv, group, t, tk)
    if bias is not None:
        scores += bias.astype(wide, copy=False) if hasattr(bias, "astype") else bias
    row_max = scores.max(axis=-1, keepdims=True)
    scores -= row_max
    probs = xp.exp(scores, out=scores)
    row_sum = probs.sum(axis=-1, keepdims=True)
    probs /= row_sum
    lse = (row_max + xp.log(row_sum)).reshape(b, h, t).astype(q.dtype, copy=False)
    probs = probs.reshape(b * hkv, group * t, tk).astype(q.dtype, copy=False)
    out = matmul(probs, v.reshape(b * hkv, tk, d), False, False, q.dtype).reshape(b, h, t, d)
    return (out, lse), (q, k, v, probs.reshape(b, hkv, group * t, tk))


def attention_backward(saved, dout, matmul):
    """ops.attention_backward's contract (dq, dk, dv): four batched GEMMs, the softmax backward in fp32."""
    q, k, v, probs = saved
    b, h, t, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    rows = (h // hkv) * t
    dtype, wide = q.dtype, _accumulate_dtype(q.dtype)
    p = probs.reshape(b * hkv, rows, tk)
    dout_g = dout.astype(dtype, copy=False).reshape(b * hkv, rows, d)
    k3, v3 = k.reshape(b * hkv, tk, d), v.reshape(b * hkv, tk, d)
    dv = matmul(p, dout_g, True, False, dtype)  # sums over the query heads of each group
    dscores = matmul(dout_g, v3, False, True, wide)
    p_wide = p.astype(wide, copy=False)
    # softmax backward: ds = p * (dp - sum(dp * p))
    dscores -= (dscores * p_wide).sum(axis=-1, keepdims=True)
    dscores *= p_wide
    dscores *= 1.0 / math.sqrt(d)
    ds = dscores.astype(dtype, copy=False)
    dq = matmul(ds, k3, False, False, dtype).reshape(b, h, t, d)
    dk = matmul(ds, q.reshape(b * hkv, rows, d), True, False, dtype).reshape(k.shape)
    return dq, dk, dv.reshape(v.shape)


# ---- bf16 / fp16 / fp32 batched GEMM through cuBLAS ----------------------------------------------------------------
CUDA_DTYPES = {"bfloat16": 14, "float16": 2, "float32": 0}
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1


def batched_matmul(a, b, transpose_a: bool = False, transpose_b: bool = False, out=None, out_dtype=None):
    """out[i] = op(a[i]) @ op(b[i]) for 3-D row-major CuPy a, b of bf16/fp16/fp32, accumulated in fp32 on tensor
    cores; out in `out_dtype` (default a's dtype; fp32 for attention's scores). The column-major arguments come from
    gemm_strided_batched_args, which the CPU tests check against np.matmul."""
    import cupy as cp
    from cupy.cuda import cublas
    a, b = cp.ascontiguousarray(a), cp.ascontiguousarray(b)
    if a.dtype != b.dtype:
        raise ValueError(f"batched_matmul: operands of one dtype, got {a.dtype} and {b.dtype}")
    g = gemm_strided_batched_args(a.shape, b.shape, transpose_a, transpose_b)
    out_dtype = np.dtype(a.dtype if out_dtype is None else out_dtype)
    out = cp.empty(g.out_shape, out_dtype) if out is None else out
    one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    code = CUDA_DTYPES[np.dtype(a.dtype).name]
    cublas.gemmStridedBatchedEx(
        handle, g.transa, g.transb, g.m, g.n, g.k, one.ctypes.data,
        b.data.ptr, code, g.lda, g.stride_a,
        a.data.ptr, code, g.ldb, g.stride_b,
        zero.ctypes.data, out.data.ptr, CUDA_DTYPES[out_dtype.name], g.ldc, g.stride_c, g.batch,
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    return out


def gpu_matmul(a, b, transpose_a, transpose_b, out_dtype):
    return batched_matmul(a, b, transpose_a, transpose_b, out_dtype=out_dtype)


def gpu_attention_forward(q, k, v, bias):
    return attention_forward(q, k, v, bias, gpu_matmul)


def gpu_attention_backward(saved, dout):
    return attention_backward(saved, dout, gpu_matmul)
