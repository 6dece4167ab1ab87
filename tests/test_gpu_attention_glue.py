"""Attention's batched GEMMs on the GPU (mpitrain/kernels/attention.py), checked on CPU: the cuBLAS column-major
arguments against np.matmul through a numpy emulation of gemmStridedBatchedEx that reads the flat buffers exactly as
cuBLAS does (leading dimensions, batch strides, op codes), and the attention glue run over that emulation against
ops.attention_forward/backward at float64. The GPU twin skips without CuPy/GPU."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mpitrain.kernels import attention, cupy_status
from mpitrain.layers import ops

GPU_USABLE, GPU_REASON = cupy_status()


def _column_major(flat, offset, rows, cols, ld):
    """The (rows, cols) column-major matrix at flat[offset:] with leading dimension ld (element (i, j) at i + j*ld)."""
    assert ld >= rows and offset + (cols - 1) * ld + rows <= flat.size, "read past the buffer"
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], (rows, cols), (item, ld * item))


def emulated_gemm_strided_batched(g: attention.GemmArgs, a, b, out_dtype):
    """What cuBLAS computes from g, with cuBLAS's A = flat(b) and B = flat(a) (g.first == "b"), in column-major."""
    first, second = (b, a) if g.first == "b" else (a, b)
    flat_a, flat_b = np.ascontiguousarray(first).reshape(-1), np.ascontiguousarray(second).reshape(-1)
    flat_c = np.zeros(g.batch * g.stride_c, np.dtype(out_dtype))
    wide = np.float64 if np.dtype(out_dtype) == np.float64 else np.float32
    for i in range(g.batch):
        # op(A) is m x k: stored m x k if N, k x m if T; op(B) is k x n likewise
        stored_a = (g.m, g.k) if g.transa == attention.CUBLAS_OP_N else (g.k, g.m)
        stored_b = (g.k, g.n) if g.transb == attention.CUBLAS_OP_N else (g.n, g.k)
        mat_a = _column_major(flat_a, i * g.stride_a, *stored_a, g.lda).astype(wide)
        mat_b = _column_major(flat_b, i * g.stride_b, *stored_b, g.ldb).astype(wide)
        op_a = mat_a if g.transa == attention.CUBLAS_OP_N else mat_a.T
        op_b = mat_b if g.transb == attention.CUBLAS_OP_N else mat_b.T
        out = _column_major(flat_c, i * g.stride_c, g.m, g.n, g.ldc)
        out[...] = op_a @ op_b  # as_strided view writes into flat_c
    return flat_c.reshape(g.out_shape)


def emulated_matmul(a, b, transpose_a, transpose_b, out_dtype):
    return emulated_gemm_strided_batched(attention.gemm_strided_batched_args(a.shape, b.shape, transpose_a,
                                                                             transpose_b), a, b, out_dtype)


@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (False, True), (True, False), (True, True)])
def test_column_major_arguments_give_np_matmul(transpose_a, transpose_b):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 7, 5) if not transpose_a else (3, 5, 7))
    b = rng.standard_normal((3, 5, 4) if not transpose_b else (3, 4, 5))
    want = (a.swapaxes(1, 2) if transpose_a else a) @ (b.swapaxes(1, 2) if transpose_b else b)
    got = emulated_matmul(a, b, transpose_a, transpose_b, np.float64)
    assert got.shape == want.shape == (3, 7, 4)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


def test_argument_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match="inner sizes differ"):
        attention.gemm_strided_batched_args((2, 3, 4), (2, 5, 6))
    with pytest.raises(ValueError, match="one batch size"):
        attention.gemm_strided_batched_args((2, 3, 4), (3, 4, 6))


def _qkv(rng, b, h, hkv, t, d, dtype=np.float64):
    return (rng.standard_normal((b, h, t, d)).astype(dtype), rng.standard_normal((b, hkv, t, d)).astype(dtype),
            rng.standard_normal((b, hkv, t, d)).astype(dtype))


@pytest.mark.parametrize("n_head, n_kv_head, offset", [(4, 4, 0), (4, 2, 0), (4, 1, 3)])
def test_gemm_attention_glue_matches_ops_in_float64(n_head, n_kv_head, offset):
    rng = np.random.default_rng(1)
    t, t_k = 6, 6 + offset
    q = rng.standard_normal((2, n_head, t, 8))
    k, v = rng.standard_normal((2, n_kv_head, t_k, 8)), rng.standard_normal((2, n_kv_head, t_k, 8))
    bias = ops.causal_bias(t, t_k, np, np.float64, offset=offset)
    dout = rng.standard_normal(q.shape)
    (out, lse), saved = attention.attention_forward(q, k, v, bias, emulated_matmul)
    (ref_out, ref_lse), ref_saved = ops.attention_forward(q, k, v, bias)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(saved[3], ref_saved[3], rtol=1e-12, atol=1e-13)
    for got, want in zip(attention.attention_backward(saved, dout, emulated_matmul),
                         ops.attention_backward(ref_saved, dout)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


def test_gemm_attention_glue_in_bf16_stays_within_bf16_rounding_of_fp32():
    """bf16 data, fp32 scores and softmax, bf16 probabilities: as close to the fp32 result as bf16 allows."""
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 1, 2, 1, 16, 8, np.float32)
    bias = ops.causal_bias(16, 16, np, np.float32)
    bf = ml_dtypes.bfloat16
    (out, lse), saved = attention.attention_forward(q.astype(bf), k.astype(bf), v.astype(bf), bias.astype(bf),
                                                    emulated_matmul)
    assert out.dtype == bf and saved[3].dtype == bf
    (want, want_lse), _ = ops.attention_forward(q, k, v, bias)
    assert np.max(np.abs(out.astype(np.float32) - want)) < 3e-2 * np.max(np.abs(want))
    assert np.max(np.abs(lse.astype(np.float32) - want_lse)) < 3e-2 * np.max(np.abs(want_lse))


@pytest.mark.skipif(not GPU_USABLE, reason=f"cuBLAS attention needs a CUDA GPU: {GPU_REASON}")
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_gpu_gemm_attention_matches_the_numpy_ops(dtype, monkeypatch):
    import cupy as cp
    monkeypatch.setenv(attention.ATTENTION_SWITCH, "cublas")  # bf16 would go to cuDNN's fused SDPA where installed
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 2, 4, 2, 32, 16, np.float32)
    bias = ops.causal_bias(32, 32, np, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    (out, _), saved = attention.gpu_attention_forward(*(cp.asarray(x.astype(dtype)) for x in (q, k, v)),
                                                      cp.asarray(bias))
    grads = attention.gpu_attention_backward(saved, cp.asarray(dout.astype(dtype)))
    (want, _), ref_saved = ops.attention_forward(q, k, v, bias)
    tol = 2e-5 if dtype == np.float32 else 3e-2
    for got, ref in zip((out, *grads), (want, *ops.attention_backward(ref_saved, dout))):
        got = cp.asnumpy(got).astype(np.float32)
        assert np.max(np.abs(got - ref)) <= tol * np.max(np.abs(ref))


def test_numpy_attention_keeps_the_ops_code():
    from mpitrain.kernels.dispatch import gpu_twin_for_gemm_dtypes

    def kernel(*args):
        raise AssertionError("a numpy array reached the cuBLAS attention")

    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 1, 2, 2, 4, 4)
    forward = gpu_twin_for_gemm_dtypes(kernel)(ops.attention_forward)
    (out, _), saved = forward(q, k, v, ops.causal_bias(4, 4, np, np.float64))
    gpu_twin_for_gemm_dtypes(kernel)(ops.attention_backward)(saved, np.ones_like(out))


def test_context_parallelism_is_accepted_on_cuda():
    """The ring's buffers follow the arrays' module (ring_attention.py, ContextParallel), so cp > 1 may run on a GPU."""
    from mpitrain.config import load_config
    cfg = load_config("configs/tiny.toml", ["parallel.cp=2", "train.device=cuda"])
    assert (cfg.parallel.cp, cfg.train.device) == (2, "cuda")
