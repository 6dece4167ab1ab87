"""Attention on the GPU, the twins of ops.attention_forward / ops.attention_backward for CuPy arrays (chosen where
those ops are defined, with kernels/dispatch.py's gpu_twin_for_gemm_dtypes): cuDNN's fused SDPA
(kernels/cudnn_attention.py) for bf16/fp16 with the causal mask or none, when cuDNN is installed; otherwise, and for
fp32, batched products through cuBLAS strided-batched GEMM (fp32 accumulation). Packed documents' per-row masks
(B, Tq, Tk) (data.document_mask) always take the GEMMs: the fused graphs built here have no mask input. The
environment variable MPITRAIN_ATTENTION=cublas keeps the GEMMs everywhere (benchmarks compare the two paths).

CuPy 14's batched matmul fails on bf16 and silently upcasts fp16, so q k^T, p v and the backward's four products go
through `gemmStridedBatchedEx` in the data's own dtype (`batched_matmul`). The scores and their gradient come out of
cuBLAS in fp32 and the softmax runs in fp32; the probabilities are rounded to the data dtype once, for the p v product
and for what is saved (the same memory as the numpy ops' cast rule keeps). The T x T scores are materialised on this
path; the fused one never holds them.

The glue is written over an injected `matmul` so it runs on CPU too: `gemm_strided_batched_args` is the pure
function that turns row-major shapes into cuBLAS's column-major arguments, and the tests check it, and these two
functions, against np.matmul through a numpy emulation of the cuBLAS call.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import numpy as np

from mpitrain.backend import array_module
from mpitrain.kernels import cudnn_attention

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
    per_row = getattr(bias, "ndim", 0) == 3  # packed documents: one mask per batch row, (B, Tq, Tk)
    if bias is not None:
        bias = bias.astype(wide, copy=False) if hasattr(bias, "astype") else bias
        scores += bias[:, None, None] if per_row else bias
    row_max = scores.max(axis=-1, keepdims=True)
    if per_row:  # a row that sees no key (ring attention's blocks): probabilities 0 and lse -inf, not NaN
        row_max = xp.where(row_max == -xp.inf, 0.0, row_max)
    scores -= row_max
    probs = xp.exp(scores, out=scores)
    row_sum = probs.sum(axis=-1, keepdims=True)
    probs /= xp.where(row_sum == 0.0, 1.0, row_sum) if per_row else row_sum
    with np.errstate(divide="ignore"):  # log(0) = -inf for a row that sees no key (numpy arrays)
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


# ---- the twins of ops.attention_forward / attention_backward: cuDNN's fused SDPA, else the GEMMs above -----------
class FusedSaved(NamedTuple):
    """What the fused forward keeps for its backward: no probabilities, the output and its float32 Stats."""
    q: object
    k: object
    v: object
    out: object
    stats: object
    causal: bool
    bias: object  # the forward's mask, for the GEMMs' backward if the fused one declines to plan


def cudnn_mask(bias, t_q: int, t_k: int):
    """True when `bias` is the causal triangle (0 where key <= query, -inf above), False when it masks nothing
    (None or 0.0), None for any other mask (cuDNN's graphs here take only those two: the cuBLAS path then; so does
    a document mask, (B, Tq, Tk), whose shape is not (t_q, t_k)).

    An array bias is checked on the device against the triangle once: one device-to-host bool per mask array, the
    verdict kept for the same array (the model's mask is one array per sequence length). Ring attention's blocks
    (layers/ring_attention.py) would fit as they are: a full block is no mask, a diagonal block the square causal
    one; but the ring computes in float32 (its log-sum-exp merge and block_grads backward), so its blocks keep the
    cuBLAS path."""
    if bias is None:
        return False
    if getattr(bias, "ndim", 0) == 0:
        return False if float(bias) == 0.0 else None
    if tuple(bias.shape) != (t_q, t_k) or t_q != t_k:
        return None
    known = _MASK_VERDICTS.get(id(bias))
    if known is not None and known[0] is bias:
        return known[1]
    xp = array_module(bias)
    above = xp.arange(t_k)[None, :] > xp.arange(t_q)[:, None]
    verdict = True if bool(xp.all(xp.where(above, bias == -xp.inf, bias == 0))) else None
    if len(_MASK_VERDICTS) >= MASK_VERDICTS_KEPT:
        _MASK_VERDICTS.pop(next(iter(_MASK_VERDICTS)))
    _MASK_VERDICTS[id(bias)] = (bias, verdict)
    return verdict


# The model builds its causal mask once per sequence length (GPT.context) and hands the same array to every layer and
# step: its verdict is read from the device once, not once per attention call (each read waits for the queue).
# Keyed by id, with the array itself held so that its id cannot be reused by another; the oldest entry goes first.
MASK_VERDICTS_KEPT = 4
_MASK_VERDICTS: dict[int, tuple[object, bool | None]] = {}


ATTENTION_SWITCH = "MPITRAIN_ATTENTION"  # "cublas" keeps the GEMMs; "cudnn" (the default) fuses where it applies
ATTENTION_PATHS = ("cudnn", "cublas")


def attention_switch(environ=os.environ) -> str:
    """The path the environment asks for, read at each call (benchmarks time both paths in one process)."""
    path = environ.get(ATTENTION_SWITCH, "cudnn")
    if path not in ATTENTION_PATHS:
        raise ValueError(f"{ATTENTION_SWITCH}={path!r}: allowed {', '.join(ATTENTION_PATHS)}")
    return path


def fused_attention_reason(dtype, heads: int, kv_heads: int, head_dim: int, graphs=cudnn_attention.GRAPHS) -> str:
    """Why attention of these heads would not run fused by cuDNN ('' when it would, shapes permitting)."""
    if attention_switch() == "cublas":
        return f"{ATTENTION_SWITCH}=cublas"
    cudnn, why = graphs.cudnn()
    if cudnn is None:
        return why
    key = cudnn_attention.SdpaKey("forward", 1, heads, kv_heads, 1, 1, head_dim, np.dtype(dtype).name, False)
    return cudnn_attention.unsupported_reason(key)


def describe_attention_path(dtype, heads: int, kv_heads: int, head_dim: int, ring: bool = False,
                            graphs=cudnn_attention.GRAPHS, documents: bool = False) -> str:
    """The banner's one line on which attention runs on the GPU (`ring`: context parallelism's ring attention;
    `documents`: data.document_mask, whose per-row masks cuDNN's graphs here do not take)."""
    if ring:
        return "attention: ring attention, float32 blocks through cuBLAS batched GEMMs (context parallelism)"
    if documents:
        return "attention: cuBLAS batched GEMMs (data.document_mask: a mask per row, which the fused graphs lack)"
    why = fused_attention_reason(dtype, heads, kv_heads, head_dim, graphs)
    if not why:
        return f"attention: cuDNN fused SDPA ({np.dtype(dtype).name})"
    return f"attention: cuBLAS batched GEMMs ({why})"


def fused_mask(q, k, bias):
    """The `causal` flag cuDNN's graph runs these arrays with, or None: the cuBLAS path (cuDNN missing, a dtype
    or shape it does not take, another mask). The cheap checks come before cudnn_mask's device check."""
    if fused_attention_reason(q.dtype, q.shape[1], k.shape[1], q.shape[3]):
        return None
    causal = cudnn_mask(bias, q.shape[2], k.shape[2])
    if causal is None or cudnn_attention.unsupported_reason(cudnn_attention.sdpa_key("forward", q, k, causal)):
        return None
    return causal


def gpu_attention_forward(q, k, v, bias):
    causal = fused_mask(q, k, bias)
    if causal is None:
        return attention_forward(q, k, v, bias, gpu_matmul)
    try:
        out, stats = cudnn_attention.forward(q, k, v, causal)
    except cudnn_attention.SdpaDeclined:
        return attention_forward(q, k, v, bias, gpu_matmul)
    lse = stats.reshape(stats.shape[:3]).astype(q.dtype, copy=False)
    return (out, lse), FusedSaved(q, k, v, out, stats, causal, bias)


def gpu_attention_backward(saved, dout):
    if not isinstance(saved, FusedSaved):
        return attention_backward(saved, dout, gpu_matmul)
    try:
        return cudnn_attention.backward(saved.q, saved.k, saved.v, saved.out, saved.stats, dout, saved.causal)
    except cudnn_attention.SdpaDeclined:  # the forward ran fused, its backward did not plan: the GEMMs' backward
        _, probs_saved = attention_forward(saved.q, saved.k, saved.v, saved.bias, gpu_matmul)
        return attention_backward(probs_saved, dout, gpu_matmul)

