"""The tiled CPU ops (mpitrain/tiles.py): cut into many tiles and run on several threads they still give the gradients
finite differences give, the same numbers as the whole-array formulas (the CuPy path), and bitwise the same numbers
whatever the thread count. The default tile sizes make one tile of test_ops' small cases, so here the tiles are made
tiny: a few rows of a norm, two query rows of attention (so masked key blocks are skipped)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import mpitrain
from mpitrain import tiles
from mpitrain.layers import attention_core, ops
from mpitrain.layers.attention import head_view, merge_heads
from mpitrain.optim.adamw import AdamW, AdamWHyper
from mpitrain.state.strategy import Segment
from tests import test_ops


@pytest.fixture
def tiny_tiles(monkeypatch):
    monkeypatch.setattr(tiles, "TILE_BYTES", 64)  # 1-8 rows per tile in these cases
    monkeypatch.setattr(attention_core, "QUERY_BLOCK", 2)
    monkeypatch.setattr(attention_core, "CHUNK_BYTES", 64)  # one batch row per chunk of attention heads
    monkeypatch.setenv("MPITRAIN_THREADS", "3")


TILED_CASES = [name for name in test_ops.CASES if name.startswith(("layernorm", "rmsnorm", "gelu", "attention",
                                                                     "sublayer-attention", "block"))]


@pytest.mark.parametrize("name", TILED_CASES)
def test_tiled_backward_matches_finite_differences(tiny_tiles, name):
    test_ops.test_backward_matches_finite_differences(name)


@pytest.mark.parametrize("name", [n for n in TILED_CASES if n in test_ops.PARAM_CASES])
def test_tiled_parameter_grads_accumulate(tiny_tiles, name):
    test_ops.test_parameter_grads_accumulate(name)


@pytest.mark.parametrize("name", TILED_CASES)
def test_tiled_ops_do_not_modify_their_arguments(tiny_tiles, name):
    test_ops.test_ops_do_not_modify_their_arguments(name)


def _attention_inputs(rng, n_head=4, n_kv_head=2, t_q=7, t_k=11, b=2, d=4):
    return (rng.normal(size=(b, n_head, t_q, d)), rng.normal(size=(b, n_kv_head, t_k, d)),
            rng.normal(size=(b, n_kv_head, t_k, d)), rng.normal(size=(b, n_head, t_q, d)))


@pytest.mark.parametrize("bias", ["causal-offset", "causal-square", "band", "zeros", "scalar"])
def test_tiled_attention_equals_the_whole_array_formula(tiny_tiles, bias):
    """Skipped key blocks are exactly the masked ones: out, lse, the saved probabilities (exact zeros where masked)
    and the three gradients agree with the one-product formula to rounding. The band (each query sees its 3 latest
    keys, two rows more) gives blocks whose key spans start past 0 and overlap only in part: backward's widest span
    writes dk/dv, the others add to it."""
    rng = np.random.default_rng(1)
    q, k, v, dout = _attention_inputs(rng, t_q=7 if bias not in ("causal-square", "band") else 11)
    t_q, t_k = q.shape[2], k.shape[2]
    band = ops.causal_bias(t_q, t_k, np, np.float64)
    band[np.arange(t_k)[None, :] < np.arange(t_q)[:, None] - 2] = -np.inf
    band[4:6, 1:9] = 0.0  # the widest key span lies inside: its writes leave keys on both sides to zero
    mask = {"causal-offset": ops.causal_bias(t_q, t_k, np, np.float64, offset=t_k - t_q),
            "causal-square": ops.causal_bias(t_q, t_k, np, np.float64), "band": band,
            "zeros": np.zeros((t_q, t_k)), "scalar": 0.0}[bias]
    (out, lse), saved = ops.attention_forward(q, k, v, mask)
    (ref_out, ref_lse), ref_saved = attention_core.whole_forward(q, k, v, mask)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(saved[3] == 0, ref_saved[3] == 0)
    np.testing.assert_allclose(saved[3], ref_saved[3], rtol=1e-12, atol=1e-15)
    for grad, ref in zip(ops.attention_backward(saved, dout), attention_core.whole_backward(ref_saved, dout)):
        np.testing.assert_allclose(grad, ref, rtol=1e-11, atol=1e-13)


def test_attention_takes_head_views_and_its_outputs_merge_without_a_copy(tiny_tiles):
    """attention.head_view hands the core strided (B, T, H, D) heads; the results equal those of contiguous heads,
    and out / dq / dk / dv come back in the (B, T, H, D) layout, so merge_heads is a view, not a copy."""
    rng = np.random.default_rng(3)
    q, k, v, dout = _attention_inputs(rng)
    mask = ops.causal_bias(q.shape[2], k.shape[2], np, np.float64, offset=k.shape[2] - q.shape[2])
    rows = [np.ascontiguousarray(merge_heads(x)) for x in (q, k, v, dout)]  # what the linears produce
    views = [head_view(x, n) for x, n in zip(rows, (q.shape[1], k.shape[1], v.shape[1], q.shape[1]))]
    assert not views[0].flags.c_contiguous and np.shares_memory(views[0], rows[0])
    (out, lse), saved = ops.attention_forward(*views[:3], mask)
    (ref_out, ref_lse), ref_saved = ops.attention_forward(q, k, v, mask)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-14)
    grads = ops.attention_backward(saved, views[3])
    for grad, ref in zip(grads, ops.attention_backward(ref_saved, dout)):
        np.testing.assert_allclose(grad, ref, rtol=1e-11, atol=1e-13)
    for result in (out, *grads):
        assert np.shares_memory(merge_heads(result), result)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_fully_masked_row_gives_nan_as_before(tiny_tiles):
    rng = np.random.default_rng(2)
    q, k, v, _ = _attention_inputs(rng, t_q=3, t_k=3)
    mask = ops.causal_bias(3, 3, np, np.float64)
    mask[1] = -np.inf
    (out, _), _ = ops.attention_forward(q, k, v, mask)
    assert np.isnan(out[:, :, 1]).all() and np.isfinite(out[:, :, [0, 2]]).all()


def _run_everything(rng):
    """Every tiled op (forward and backward) and an AdamW step on fixed inputs -> list of arrays."""
    x, dy, w, b = rng.normal(size=(3, 5, 6)), rng.normal(size=(3, 5, 6)), rng.normal(size=6), rng.normal(size=6)
    results = []
    for forward, backward, params in [
            (lambda: ops.layernorm_forward(x, w, b, 1e-5), lambda s, g: ops.layernorm_backward(s, w, dy, *g), 2),
            (lambda: ops.rmsnorm_forward(x, w, 1e-5), lambda s, g: ops.rmsnorm_backward(s, w, dy, *g), 1),
            (lambda: ops.layernorm_forward(x, w, b, 1e-5), lambda s, g: ops.layernorm_backward(s, w, dy, *g, x), 2),
            (lambda: ops.gelu_forward(x), lambda s, g: ops.gelu_backward(s, dy), 0),
            (lambda: ops.gelu_forward(x.copy(), b),
             lambda s, g: ops.gelu_backward_from_output(s, ops.gelu_forward(s)[0], dy, *g), 1)]:
        y, saved = forward()
        grads = [np.zeros(6) for _ in range(params)]
        results += [y, backward(saved, grads), *grads]
    q, k, v, dout = _attention_inputs(rng)
    (out, lse), saved = ops.attention_forward(q, k, v, ops.causal_bias(7, 11, np, np.float64, offset=4))
    results += [out, lse, *ops.attention_backward(saved, dout)]
    params, grads = rng.normal(size=100), rng.normal(size=100)
    optimizer = AdamW([Segment(params, grads, [(10, 60)])], AdamWHyper())
    for lr in (1e-2, 3e-3):
        optimizer.step(lr, grad_scale=0.5)
    return results + [params, optimizer.exp_avg, optimizer.exp_avg_sq]


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_backward_adds_the_residual_gradient_in_its_tiles(tiny_tiles, kind):
    """The block hands its skip connection's gradient to the norm's backward: the same as adding it after."""
    rng = np.random.default_rng(4)
    x, dy, residual = (rng.normal(size=(3, 5, 6)) for _ in range(3))
    w, b = rng.normal(size=6), rng.normal(size=6)
    if kind == "layernorm":
        _, saved = ops.layernorm_forward(x, w, b, 1e-5)
        plain = ops.layernorm_backward(saved, w, dy, np.zeros(6), np.zeros(6))
        summed = ops.layernorm_backward(saved, w, dy, np.zeros(6), np.zeros(6), residual)
    else:
        _, saved = ops.rmsnorm_forward(x, w, 1e-5)
        plain = ops.rmsnorm_backward(saved, w, dy, np.zeros(6))
        summed = ops.rmsnorm_backward(saved, w, dy, np.zeros(6), residual)
    np.testing.assert_array_equal(summed, plain + residual)


def test_results_do_not_depend_on_the_thread_count(tiny_tiles, monkeypatch):
    """Tile boundaries follow from the shapes only, and partial sums are added in tile order: bitwise equal."""
    runs = []
    for threads in ("1", "2", "5"):
        monkeypatch.setenv("MPITRAIN_THREADS", threads)
        runs.append(_run_everything(np.random.default_rng(3)))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


def test_tiled_adamw_equals_the_textbook_update(tiny_tiles):
    rng = np.random.default_rng(4)
    params, grads = rng.normal(size=50), rng.normal(size=50)
    p, m, v = params.copy(), np.zeros(50), np.zeros(50)
    h = AdamWHyper()
    optimizer = AdamW([Segment(params, grads, [(0, 20)])], h)
    for t, lr in enumerate((1e-2, 5e-3), start=1):
        optimizer.step(lr, grad_scale=0.25)
        g = 0.25 * grads
        p[:20] *= 1 - lr * h.weight_decay
        m = h.beta1 * m + (1 - h.beta1) * g
        v = h.beta2 * v + (1 - h.beta2) * g * g
        p -= lr / (1 - h.beta1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - h.beta2 ** t) + h.eps)
    np.testing.assert_allclose(params, p, rtol=1e-13, atol=1e-15)


def test_the_pool_takes_as_many_threads_as_blas_unless_told(monkeypatch):
    monkeypatch.delenv("MPITRAIN_THREADS", raising=False)
    monkeypatch.setattr(mpitrain, "OPENBLAS_THREAD_TIMEOUT_AT_LOAD", "4")  # as when mpitrain loads before numpy
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tiles._blas_threads.cache_clear()
    try:
        assert tiles.thread_count() == 3  # OpenBLAS's own variable first, as OpenBLAS reads them
        monkeypatch.setenv("MPITRAIN_THREADS", "1")
        assert tiles.thread_count() == 1
    finally:
        tiles._blas_threads.cache_clear()


def test_the_pool_stays_off_where_openblas_spins_long_unless_told(monkeypatch):
    """numpy imported before mpitrain, no OPENBLAS_THREAD_TIMEOUT set then (or a long one): OpenBLAS's idle threads
    spin on the cores the tile threads would take, so by default there is no pool; MPITRAIN_THREADS still rules."""
    monkeypatch.delenv("MPITRAIN_THREADS", raising=False)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    tiles._blas_threads.cache_clear()
    try:
        for at_load, expected in ((None, 1), ("28", 1), ("16", 2), ("4", 2)):
            monkeypatch.setattr(mpitrain, "OPENBLAS_THREAD_TIMEOUT_AT_LOAD", at_load)
            assert tiles.thread_count() == expected, at_load
        monkeypatch.setattr(mpitrain, "OPENBLAS_THREAD_TIMEOUT_AT_LOAD", None)
        monkeypatch.setenv("MPITRAIN_THREADS", "2")
        assert tiles.thread_count() == 2
    finally:
        tiles._blas_threads.cache_clear()


def test_openblas_runs_the_short_spin_whichever_is_imported_first():
    """Imported first, mpitrain sets the short spin before numpy loads OpenBLAS; imported after numpy, it has
    OpenBLAS re-read it. Asked of OpenBLAS itself (openblas_thread_timeout: the value it read), after a product
    that runs its threads."""
    script = ("import sys, os, ctypes\n"
              "if sys.argv[1] == 'numpy-first': import numpy\n"
              "import mpitrain, numpy as np\n"
              "from mpitrain import tiles\n"
              "np.ones((256, 256), np.float32) @ np.ones((256, 256), np.float32)\n"
              "lib = [lib for lib in tiles._blas_libraries() if lib.internal_api == 'openblas'][0]\n"
              "print(mpitrain.OPENBLAS_THREAD_TIMEOUT_AT_LOAD, ctypes.CDLL(lib.filepath).openblas_thread_timeout())\n")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env["OPENBLAS_NUM_THREADS"] = "2"
    outputs = [subprocess.run([sys.executable, "-c", script, order], env=env, capture_output=True, text=True,
                              check=True).stdout.split() for order in ("mpitrain-first", "numpy-first")]
    assert outputs == [["4", "4"], ["4", "4"]]


def test_openblas_is_not_restarted_while_another_thread_could_be_inside_it():
    """Stopping OpenBLAS's threads under a product another thread runs would break it: with a second thread alive
    the restart is skipped (and the pool then stays off unless told)."""
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert tiles.restart_openblas_threads() is False
    finally:
        release.set()
        other.join()


class _FakeBlas:
    def __init__(self, threads):
        self.num_threads = threads

    def set_num_threads(self, threads):
        self.num_threads = threads


def test_overlapping_one_blas_thread_sections_restore_the_first_setting(monkeypatch):
    """Two threads inside at once (entered A, B; left A, B): BLAS stays at 1 until both left, then gets back its 2;
    restoring per section would leave it at 1 for good (B saved A's 1)."""
    blas = _FakeBlas(2)
    monkeypatch.setattr(tiles, "_blas_libraries", lambda: [blas])
    first, second = tiles.one_blas_thread(), tiles.one_blas_thread()
    first.__enter__()
    second.__enter__()
    assert blas.num_threads == 1
    first.__exit__(None, None, None)
    assert blas.num_threads == 1  # the second section still runs its small products on one thread
    second.__exit__(None, None, None)
    assert blas.num_threads == 2
