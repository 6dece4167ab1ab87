"""The fused CUDA kernels (mpitrain/kernels) against their numpy references: the ops of layers/ops.py, and
kernels/reference.py for softmax, cross-entropy and AdamW. The GPU tests skip, saying why, without CuPy or a GPU;
the references and the dispatch rule (numpy arrays never reach a kernel) are checked everywhere.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from mpitrain.kernels import cupy_status, reference
from mpitrain.kernels.dispatch import gpu_twin, gpu_twin_in_low_precision
from mpitrain.layers import ops

GPU_USABLE, GPU_REASON = cupy_status()
needs_gpu = pytest.mark.skipif(not GPU_USABLE, reason=f"fused kernels need a CUDA GPU: {GPU_REASON}")
TOL = {np.float64: 1e-12, np.float32: 2e-5}


# ---- references (CPU) --------------------------------------------------------------------------------------------
def test_softmax_and_cross_entropy_references_agree_with_torch():
    torch = pytest.importorskip("torch", reason="torch is the reference here: pip install -e '.[test]'")
    rng = np.random.default_rng(0)
    logits, targets = rng.standard_normal((3, 5, 11)) * 4, rng.integers(0, 11, (3, 5))
    t_logits = torch.tensor(logits, requires_grad=True)
    probs = torch.softmax(t_logits, -1)
    dy = rng.standard_normal(logits.shape)
    probs.backward(torch.tensor(dy))
    np.testing.assert_allclose(reference.softmax_forward(logits), probs.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(reference.softmax_backward(reference.softmax_forward(logits), dy),
                               t_logits.grad.numpy(), rtol=1e-10, atol=1e-14)
    t_logits.grad = None
    loss = torch.nn.functional.cross_entropy(t_logits.reshape(-1, 11), torch.tensor(targets.reshape(-1)),
                                             reduction="none")
    (loss.sum() * 0.5).backward()
    ours, grad = reference.cross_entropy_with_grad(logits, targets, 0.5)
    np.testing.assert_allclose(ours.reshape(-1), loss.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(grad, t_logits.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_adamw_reference_is_the_optimizers_update():
    from mpitrain.optim.adamw import AdamW, AdamWHyper
    from mpitrain.state.strategy import Segment
    rng = np.random.default_rng(1)
    params, grads = rng.standard_normal(50), rng.standard_normal(50)
    hyper = AdamWHyper(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    optimizer = AdamW([Segment(params, grads, [(0, 50)])], hyper, state_dtype=np.float64)
    p, m, v = params.copy(), np.zeros(50), np.zeros(50)
    for step in (1, 2, 3):
        optimizer.step(lr=1e-2, grad_scale=0.5)
        reference.adamw_update(p, grads, m, v, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, step=step,
                               shrink=1 - 1e-2 * 0.1, grad_scale=0.5)
    np.testing.assert_allclose(p, params, rtol=1e-14)


def test_numpy_arrays_never_reach_a_fused_kernel():
    def kernel(*args):
        raise AssertionError("a numpy array reached the fused kernel")

    wrapped = gpu_twin(kernel)(ops.gelu_forward)
    x = np.linspace(-3, 3, 12).reshape(3, 4)
    np.testing.assert_array_equal(wrapped(x)[0], ops.gelu_forward(x)[0])
    bf16 = x.astype(ml_dtypes.bfloat16)
    assert wrapped(bf16)[0].dtype == bf16.dtype
    native = gpu_twin_in_low_precision(kernel)(ops.linear_forward)
    w = np.ones((4, 2), ml_dtypes.bfloat16)
    np.testing.assert_array_equal(native(bf16, w)[0], ops.linear_forward(bf16, w)[0])


# ---- kernels vs references (GPU) ---------------------------------------------------------------------------------
@pytest.fixture
def cp():
    import cupy
    return cupy


def _close(got, want, dtype):
    got = got.get() if hasattr(got, "get") else got
    scale = max(float(np.max(np.abs(want))), 1.0)
    assert float(np.max(np.abs(np.asarray(got, np.float64) - want))) <= TOL[dtype] * scale


@needs_gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", ["layernorm", "rmsnorm"])
def test_norm_kernels(cp, dtype, name):
    from mpitrain.kernels import fused
    rng = np.random.default_rng(2)
    x, w, b, dy = (rng.standard_normal(s).astype(dtype) for s in ((4, 7, 300), (300,), (300,), (4, 7, 300)))
    params = (w, b) if name == "layernorm" else (w,)
    y, saved = getattr(ops, f"{name}_forward")(x, *params, 1e-5)
    grads = [np.zeros_like(p) for p in params]
    dx = getattr(ops, f"{name}_backward")(saved, w, dy, *grads)
    g_y, g_saved = getattr(fused, f"{name}_forward")(cp.asarray(x), *map(cp.asarray, params), 1e-5)
    g_grads = [cp.zeros_like(cp.asarray(p)) for p in params]
    g_dx = getattr(fused, f"{name}_backward")(g_saved, cp.asarray(w), cp.asarray(dy), *g_grads)
    for got, want in ((g_y, y), (g_saved[1], saved[1]), (g_dx, dx), *zip(g_grads, grads)):
        _close(got, want, dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_elementwise_kernels(cp, dtype):
    from mpitrain.kernels import fused
    rng = np.random.default_rng(3)
    x, up, dy = (rng.standard_normal((5, 64)).astype(dtype) for _ in range(3))
    _close(fused.gelu_forward(cp.asarray(x))[0], ops.gelu_forward(x)[0], dtype)
    _close(fused.gelu_backward(cp.asarray(x), cp.asarray(dy)), ops.gelu_backward(x, dy), dtype)
    _close(fused.swiglu_forward(cp.asarray(x), cp.asarray(up))[0], ops.swiglu_forward(x, up)[0], dtype)
    for got, want in zip(fused.swiglu_backward((cp.asarray(x), cp.asarray(up)), cp.asarray(dy)),
                         ops.swiglu_backward((x, up), dy)):
        _close(got, want, dtype)
    q = rng.standard_normal((2, 3, 16, 8)).astype(dtype)
    cos, sin = ops.rope_tables(np.arange(16), 8, 10000.0, np, dtype)
    _close(fused.rope_forward(cp.asarray(q), cp.asarray(cos), cp.asarray(sin)), ops.rope_forward(q, cos, sin), dtype)
    _close(fused.rope_backward(cp.asarray(q), cp.asarray(cos), cp.asarray(sin)), ops.rope_backward(q, cos, sin),
           dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softmax_cross_entropy_and_adamw_kernels(cp, dtype):
    from mpitrain.kernels import fused
    rng = np.random.default_rng(4)
    x, dy = (rng.standard_normal((6, 1000)).astype(dtype) * 3 for _ in range(2))
    y = reference.softmax_forward(x)
    _close(fused.softmax_forward(cp.asarray(x)), y, dtype)
    _close(fused.softmax_backward(cp.asarray(y), cp.asarray(dy)), reference.softmax_backward(y, dy), dtype)
    targets = rng.integers(0, 1000, 6)
    loss, grad = reference.cross_entropy_with_grad(x, targets, 0.25)
    g_loss, g_grad = fused.cross_entropy_with_grad(cp.asarray(x), cp.asarray(targets), 0.25)
    _close(g_loss, loss, dtype)
    _close(g_grad, grad, dtype)
    p, g = rng.standard_normal(4097).astype(dtype), rng.standard_normal(4097).astype(dtype)
    m, v = np.zeros_like(p), np.zeros_like(p)
    gp, gm, gv = cp.asarray(p), cp.asarray(m), cp.asarray(v)
    for step in (1, 2):
        reference.adamw_update(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, step=step, grad_scale=0.5)
        fused.adamw_update(gp, cp.asarray(g), gm, gv, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, step=step,
                           grad_scale=0.5)
    for got, want in ((gp, p), (gm, m), (gv, v)):
        _close(got, want, dtype)


@needs_gpu
@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (False, True), (True, False)])
def test_bf16_batched_gemm_accumulates_in_fp32(cp, transpose_a, transpose_b):
    from mpitrain.kernels import attention
    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 64, 96) if not transpose_a else (3, 96, 64)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((3, 96, 80) if not transpose_b else (3, 80, 96)).astype(ml_dtypes.bfloat16)
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    want = (a32.transpose(0, 2, 1) if transpose_a else a32) @ (b32.transpose(0, 2, 1) if transpose_b else b32)
    got = attention.batched_matmul(cp.asarray(a), cp.asarray(b), transpose_a, transpose_b).get().astype(np.float32)
    # fp32 accumulation: only the final rounding to bf16 (8 bits of mantissa) remains
    assert np.max(np.abs(got - want)) <= 2 ** -7 * np.max(np.abs(want))
    assert math.isfinite(float(got.sum()))


@needs_gpu
def test_bf16_linears_run_in_bf16_and_match_fp32_to_bf16_rounding(cp):
    from mpitrain.kernels import fused
    rng = np.random.default_rng(7)
    x, w, dy = (rng.standard_normal(s).astype(ml_dtypes.bfloat16) for s in ((2, 16, 64), (64, 48), (2, 16, 48)))
    y = fused.linear_forward(cp.asarray(x), cp.asarray(w))[0]
    assert y.dtype == x.dtype
    want = x.astype(np.float32).reshape(-1, 64) @ w.astype(np.float32)
    assert np.max(np.abs(y.get().astype(np.float32).reshape(-1, 48) - want)) <= 2 ** -7 * np.max(np.abs(want))
    dw = cp.zeros((64, 48), x.dtype)
    fused.add_weight_grad(dw, cp.asarray(x), cp.asarray(dy))
    want_dw = x.astype(np.float32).reshape(-1, 64).T @ dy.astype(np.float32).reshape(-1, 48)
    assert np.max(np.abs(dw.get().astype(np.float32) - want_dw)) <= 2 ** -7 * np.max(np.abs(want_dw))


@needs_gpu
def test_ops_give_the_numpy_results_on_cupy_arrays(cp):
    x = np.random.default_rng(6).standard_normal((4, 32))
    w = np.ones(32)
    for name, args in (("gelu_forward", (x,)), ("rmsnorm_forward", (x, w, 1e-5))):
        want = getattr(ops, name).__wrapped__(*args)[0]
        _close(getattr(ops, name)(*(cp.asarray(a) if hasattr(a, "shape") else a for a in args))[0], want,
               np.float64)
