"""data.document_mask: attention, learned positions and RoPE stay inside each document packed in a row.

Proven in float64: the masked attention core's gradients by finite differences (a query row that sees no key gives
0, not NaN); a packed row's per-token hidden states, loss and gradients are those of its documents run one by one
(gpt2's learned positions, llama's RoPE with grouped K/V heads); ring attention with document masks equals the
one-process core and its gradients match finite differences; and whole training runs under tp 2, tp 2 with sequence
parallelism, cp 2, pp 2, dp 2 with ZeRO-3 and thread replicas give the one-process run's losses and parameters at
1e-10.
"""
from __future__ import annotations

import numpy as np
import pytest

from mpitrain.backend import make_backend
from mpitrain.config import ModelConfig, load_config
from mpitrain.data.documents import (
    SYNTHETIC_EOD,
    documents_from_starts,
    documents_of,
    starts_after_eod,
    stored_starts,
)
from mpitrain.errors import DataError
from mpitrain.kernels import attention as gpu_attention
from mpitrain.kernels import cupy_status
from mpitrain.layers import ops
from mpitrain.layers.attention import rotate
from mpitrain.layers.attention_core import document_bias
from mpitrain.model.gpt import GPT
from mpitrain.state.replicated import ReplicatedState
from tests.mpi_helpers import run_python_mpi_results

EOD = SYNTHETIC_EOD  # the id data.synthetic ends documents with
GPU_USABLE, GPU_REASON = cupy_status()


# ----------------------------------------------------------------------------- documents of a row
def test_documents_of_a_row_count_eods_before_each_token():
    inputs = np.array([[5, 0, 3, 4, 0, 0, 7, 1], [1, 2, 3, 4, 5, 6, 7, 0]])
    documents = documents_of(inputs, EOD)
    # an EOD belongs to the document it ends; a row's first token starts a document whatever it is
    assert documents.ids.tolist() == [[0, 0, 1, 1, 1, 2, 3, 3], [0] * 8]
    assert documents.positions.tolist() == [[0, 1, 0, 1, 2, 0, 0, 1], list(range(8))]
    assert documents.take([2, 3, 6]).positions.tolist() == [[0, 1, 0], [2, 3, 6]]


def test_stored_starts_give_the_same_documents_as_eod_tokens():
    """A file without an EOD id stores where its documents start: the same split of a window."""
    stream = np.array([9, 9, 0, 8, 0, 7, 7, 7, 0, 6, 6])
    doc_starts = np.array([0, 3, 5, 9])  # after each 0
    window = np.arange(1, 9)[None, :]  # stream positions 1..8
    from_file = documents_from_starts(stored_starts(window, doc_starts))
    from_tokens = documents_from_starts(starts_after_eod(stream[window], 0))
    assert np.array_equal(from_file.ids, from_tokens.ids)
    assert np.array_equal(from_file.positions, from_tokens.positions)


def test_document_bias_is_causal_inside_each_document():
    documents = documents_of(np.array([[3, 0, 4, 5, 0, 6]]), EOD)
    bias = document_bias(documents.ids, documents.positions, documents.ids, documents.positions, np, np.float64)
    allowed = np.isfinite(bias[0])
    i, j = np.indices(allowed.shape)
    same = documents.ids[0][:, None] == documents.ids[0][None, :]
    assert np.array_equal(allowed, (j <= i) & same)
    assert set(np.unique(bias)) == {0.0, -np.inf}


def test_a_file_without_boundaries_is_refused_naming_it(tmp_path):
    import h5py

    from mpitrain.data.dataset import TokenDataset, train_and_val_samplers
    from mpitrain.data.documents import check_document_boundaries
    path = tmp_path / "old.h5"
    with h5py.File(path, "w") as f:  # the format before document starts and eod_id
        f.create_dataset("train", data=np.arange(200, dtype=np.uint16) % 256)
        f.create_dataset("val", data=np.arange(100, dtype=np.uint16) % 256)
        f.attrs.update({"vocab_size": 256, "tokenizer": '{"kind": "byte", "vocab_size": 256}'})
    samplers = train_and_val_samplers(TokenDataset(path), 16, 2, 0)
    with pytest.raises(DataError, match=f"data.document_mask = true .* {path}"):
        check_document_boundaries(*samplers)
    with pytest.raises(DataError, match=str(path)):
        samplers[0].document_starts(0, range(2))


def test_config_key_defaults_off():
    assert load_config("configs/tiny.toml").data.document_mask is False
    assert load_config("configs/tiny.toml", ["data.document_mask=true"]).data.document_mask is True


# ----------------------------------------------------------------------------- the attention core
def _qkv(rng, b, h, hkv, t, d):
    return (rng.standard_normal((b, h, t, d)), rng.standard_normal((b, hkv, t, d)), rng.standard_normal((b, hkv, t, d)))


def _finite_difference(f, x, index, eps=1e-6):
    old = x[index]
    x[index] = old + eps
    up = f()
    x[index] = old - eps
    down = f()
    x[index] = old
    return (up - down) / (2 * eps)


def test_masked_attention_gradients_match_finite_differences():
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, 4, 2, 10, 4)
    documents = documents_of(np.array([[1, 0, 2, 3, 0, 4, 5, 6, 0, 7], [1, 2, 3, 4, 0, 5, 6, 7, 8, 9]]), EOD)
    bias = document_bias(documents.ids, documents.positions, documents.ids, documents.positions, np, np.float64)
    weights = rng.standard_normal(q.shape)

    def loss():
        return float(np.sum(ops.attention_forward(q, k, v, bias)[0][0] * weights))

    (out, _), saved = ops.attention_forward(q, k, v, bias)
    grads = ops.attention_backward(saved, weights)
    for array, grad in zip((q, k, v), grads):
        for index in [tuple(rng.integers(0, s) for s in array.shape) for _ in range(12)]:
            assert grad[index] == pytest.approx(_finite_difference(loss, array, index), rel=1e-6, abs=1e-8)
    # the same as running each document alone: row 0's second document (tokens 2..4) sees only itself
    (alone, _), _ = ops.attention_forward(q[:1, :, 2:5], k[:1, :, 2:5], v[:1, :, 2:5], ops.causal_bias(3, 3, np,
                                                                                                     np.float64))
    np.testing.assert_allclose(out[:1, :, 2:5], alone, rtol=1e-13, atol=1e-14)


def test_a_query_that_sees_no_key_gives_zero_not_nan():
    """Ring attention's blocks can hide every key from a row (its document starts after the key chunk)."""
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 2, 2, 1, 6, 4)
    ids_q, ids_k = np.array([[1] * 6, [0, 0, 1, 1, 1, 1]]), np.zeros((2, 6), np.int64)
    positions = np.broadcast_to(np.arange(6) + 6, (2, 6))
    bias = document_bias(ids_q, positions, ids_k, positions - 6, np, np.float64)  # keys: an earlier chunk
    (out, lse), saved = ops.attention_forward(q, k, v, bias)
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)  # row 0 sees nothing at all
    assert np.all(out[1, :, 2:] == 0) and np.all(np.isfinite(out[1, :, :2]))
    grads = ops.attention_backward(saved, rng.standard_normal(out.shape))
    assert all(np.all(np.isfinite(g)) for g in grads) and np.all(grads[0][0] == 0)
    # the whole-batch form (CuPy's float64 path) and the cuBLAS glue (emulated here by np.matmul) agree
    (whole, whole_lse), _ = ops.attention_core.whole_forward(q, k, v, bias)
    (glue, glue_lse), _ = gpu_attention.attention_forward(q, k, v, bias, _matmul)
    for got, got_lse in ((whole, whole_lse), (glue, glue_lse)):
        np.testing.assert_allclose(got, out, rtol=1e-13, atol=1e-14)
        assert np.array_equal(np.isinf(got_lse), np.isinf(lse))


def _matmul(a, b, transpose_a, transpose_b, out_dtype):
    return ((a.swapaxes(1, 2) if transpose_a else a) @ (b.swapaxes(1, 2) if transpose_b else b)).astype(out_dtype)


def test_the_gpu_glue_takes_the_document_mask_and_cudnn_leaves_it_to_cublas():
    """kernels/attention.py's cuBLAS path applies a per-row mask per batch row (checked over an emulated GEMM in
    float64); cuDNN's graphs take only the causal triangle or no mask, so a document mask routes to cuBLAS."""
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 2, 4, 2, 8, 4)
    documents = documents_of(rng.integers(0, 3, (2, 8)), EOD)
    bias = document_bias(documents.ids, documents.positions, documents.ids, documents.positions, np, np.float64)
    dout = rng.standard_normal(q.shape)
    (out, lse), saved = gpu_attention.attention_forward(q, k, v, bias, _matmul)
    (want, want_lse), want_saved = ops.attention_forward(q, k, v, bias)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)
    for got, ref in zip(gpu_attention.attention_backward(saved, dout, _matmul), ops.attention_backward(want_saved,
                                                                                                       dout)):
        np.testing.assert_allclose(got, ref, rtol=1e-11, atol=1e-12)
    assert gpu_attention.cudnn_mask(bias, 8, 8) is None
    assert "document" in gpu_attention.describe_attention_path(np.float32, 4, 2, 8, documents=True)


def test_a_document_mask_on_device_arrays_reaches_the_cublas_path(monkeypatch):
    """Fake CuPy arrays (tests/fake_device.py): a per-row mask is routed to the cuBLAS GEMMs (their first product is
    reached), never to cuDNN's graphs; per-row rotary tables get past CuPy's Python-level checks up to device work."""
    from tests.fake_device import device_work_error, fake_cupy, fake_device_array
    cupy = fake_cupy()

    class ReachedGemm(Exception):
        pass

    def no_cudnn(*args, **kwargs):
        raise AssertionError("a document mask reached cuDNN's graphs")

    def first_product(*args):
        raise ReachedGemm

    monkeypatch.setattr(gpu_attention.cudnn_attention, "forward", no_cudnn)
    monkeypatch.setattr(gpu_attention, "gpu_matmul", first_product)
    rng = np.random.default_rng(6)
    q, k, v = (fake_device_array(cupy, x.astype(np.float32)) for x in _qkv(rng, 2, 4, 2, 8, 16))
    documents = documents_of(rng.integers(0, 3, (2, 8)), EOD)
    bias = fake_device_array(cupy, document_bias(documents.ids, documents.positions, documents.ids,
                                                 documents.positions, np, np.float32))
    with pytest.raises(ReachedGemm):
        gpu_attention.gpu_attention_forward(q, k, v, bias)
    cos, sin = ops.rope_tables(documents.positions, 16, 10000.0, np, np.float32)
    with pytest.raises(device_work_error(cupy)):
        rotate(ops.rope_forward, q, fake_device_array(cupy, cos), fake_device_array(cupy, sin))


@pytest.mark.skipif(not GPU_USABLE, reason=f"the GPU's attention needs a CUDA GPU: {GPU_REASON}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_document_masked_attention_on_the_gpu_matches_numpy(dtype):
    import cupy as cp

    from mpitrain.backend import BFLOAT16
    low = np.float32 if dtype == "float32" else BFLOAT16
    rng = np.random.default_rng(7)
    q, k, v = (x.astype(np.float32) for x in _qkv(rng, 2, 4, 2, 32, 16))
    documents = documents_of(rng.integers(0, 6, (2, 32)), EOD)
    bias = document_bias(documents.ids, documents.positions, documents.ids, documents.positions, np, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    (out, _), saved = ops.attention_forward(*(cp.asarray(x.astype(low)) for x in (q, k, v)), cp.asarray(bias))
    grads = ops.attention_backward(saved, cp.asarray(dout.astype(low)))
    (want, _), want_saved = ops.attention_forward(q, k, v, bias)
    tol = 2e-5 if dtype == "float32" else 3e-2
    for got, ref in zip((out, *grads), (want, *ops.attention_backward(want_saved, dout))):
        assert np.max(np.abs(cp.asnumpy(got).astype(np.float32) - ref)) <= tol * np.max(np.abs(ref))


def test_rotary_tables_per_row_rotate_each_row_by_its_positions():
    """attention.rotate lays the rows end to end along time; the GPU kernel's index arithmetic (kernels/fused.py's
    rope: t = (i / D) % T over a contiguous array, the table row t) then reads each token's own row."""
    rng = np.random.default_rng(3)
    b, h, t, d = 2, 3, 5, 4
    x, positions = rng.standard_normal((b, h, t, d)), rng.integers(0, 7, (b, t))
    cos, sin = ops.rope_tables(positions, d, 10000.0, np, np.float64)
    got = rotate(ops.rope_forward, x, cos, sin)
    for row in range(b):
        row_cos, row_sin = ops.rope_tables(positions[row], d, 10000.0, np, np.float64)
        np.testing.assert_array_equal(got[row], ops.rope_forward(x[row], row_cos, row_sin))
    np.testing.assert_allclose(rotate(ops.rope_backward, got, cos, sin), x, rtol=1e-13, atol=1e-14)
    flat = np.ascontiguousarray(x.swapaxes(0, 1).reshape(h, b * t, d)).reshape(-1)
    table_cos, table_sin = cos.reshape(b * t, -1), sin.reshape(b * t, -1)
    kernel = np.empty_like(flat)
    for i in range(flat.size):  # the kernel's formula, element by element
        half, dim = d // 2, i % d
        row = (i // d) % (b * t)
        c, s = table_cos[row, dim % half], table_sin[row, dim % half]
        kernel[i] = flat[i] * c - flat[i + half] * s if dim < half else flat[i] * c + flat[i - half] * s
    np.testing.assert_allclose(kernel.reshape(h, b, t, d).swapaxes(0, 1), got, rtol=1e-14, atol=1e-15)


# ----------------------------------------------------------------------------- a packed row = its documents alone
VARIANTS = {"gpt2": {}, "llama": {"arch": "llama", "n_kv_head": 2}}
SMALL = {"n_layer": 2, "d_model": 16, "n_head": 4, "vocab_size": 16, "seq_len": 24}
LENGTHS = [[7, 10, 7], [3, 12, 9]]  # each row: documents ending with an EOD, the last one cut by the window


def _packed_rows(rng):
    rows = []
    for lengths in LENGTHS:
        pieces = [np.append(rng.integers(1, SMALL["vocab_size"], n - 1), EOD) for n in lengths]
        rows.append(np.concatenate(pieces))
    tokens = np.stack(rows)
    return tokens, np.roll(tokens, -1, axis=1)


def _model(arch, head: bool):
    cfg = ModelConfig(**SMALL, **VARIANTS[arch])
    backend = make_backend("cpu", "float64")
    model = GPT(cfg, backend, stages=None if head else [(0, cfg.n_layer + 1)])
    return model, ReplicatedState(model.layouts, backend, 0)


@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_a_packed_row_gives_each_documents_hidden_states_alone(arch):
    model, state = _model(arch, head=False)
    tokens, _ = _packed_rows(np.random.default_rng(4))
    packed, _ = model.forward(state, tokens, documents=documents_of(tokens, EOD))
    unmasked, _ = model.forward(state, tokens)
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            alone, _ = model.forward(state, tokens[row:row + 1, start:start + n])
            np.testing.assert_allclose(packed[row:row + 1, start:start + n], alone, rtol=1e-12, atol=1e-13)
            if start:  # without the mask a later document sees the ones before it
                assert np.abs(unmasked[row:row + 1, start:start + n] - alone).max() > 1e-3
            start += n


@pytest.mark.parametrize("arch", sorted(VARIANTS))
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_a_packed_row_gives_the_loss_and_gradients_of_its_documents_alone(arch, recompute):
    """The loss sum and every gradient of a packed batch are the sums over its documents run one by one, each with
    the targets it has in the stream (an EOD's: the next document's first token)."""
    from mpitrain.layers.recompute import apply_recompute
    model, state = _model(arch, head=True)
    apply_recompute(model, recompute)
    tokens, targets = _packed_rows(np.random.default_rng(5))
    loss, saved = model.forward(state, tokens, targets, documents=documents_of(tokens, EOD))
    model.backward(state, saved, 1.0)
    packed_grads = state.grads.data.copy()
    state.zero_grads()
    total = 0.0
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            part, saved = model.forward(state, tokens[row:row + 1, start:start + n],
                                        targets[row:row + 1, start:start + n])
            model.backward(state, saved, 1.0)
            total += float(part)
            start += n
    assert float(loss) == pytest.approx(total, rel=1e-12)
    assert np.abs(packed_grads).max() > 0
    np.testing.assert_allclose(packed_grads, state.grads.data, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", sorted(VARIANTS))
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_declared_saved_bytes_count_the_documents(arch, recompute):
    """GPT.saved_bytes (what `mpitrain memory` counts) with data.document_mask: the arrays the saved state keeps
    alive (backend.nbytes_of), plus, where blocks recompute, the (B, T, T) mask of the context they keep (opaque to
    nbytes_of: a recompute.Shared)."""
    from mpitrain.backend import nbytes_of
    from mpitrain.layers.recompute import Shared, apply_recompute
    model, state = _model(arch, head=True)
    model.document_mask = True
    apply_recompute(model, recompute)
    tokens, targets = _packed_rows(np.random.default_rng(8))
    _, saved = model.forward(state, tokens, targets, documents=documents_of(tokens, EOD))
    measured = nbytes_of(saved)
    if recompute != "none":
        kept = [unit["ctx"].ctx for unit in saved if isinstance(unit, dict) and isinstance(unit.get("ctx"), Shared)]
        assert len({id(ctx["bias"]) for ctx in kept}) == 1 and kept[0]["bias"].shape == (2, 24, 24)
        measured += kept[0]["bias"].nbytes
    per_micro_batch, shared = model.saved_bytes(2, np.dtype(np.float64))
    assert measured == per_micro_batch + shared


# ----------------------------------------------------------------------------- ring attention (MPI)
RING_SCRIPT = """
import json
import numpy as np
from mpi4py import MPI
from mpitrain.comm.group import Group
from mpitrain.data.documents import documents_of
from mpitrain.layers import ops, ring_attention
from mpitrain.layers.attention_core import document_bias
from mpitrain.parallel.context import ContextParallel, zigzag_positions

cp = ContextParallel(Group(MPI.COMM_WORLD, "cp"))
rng = np.random.default_rng(0)  # the same full-sequence arrays on every rank
B, H, Hkv, T, D = 2, 4, 2, 24, 4
q, weights = rng.standard_normal((B, H, T, D)), rng.standard_normal((B, H, T, D))
k, v = rng.standard_normal((B, Hkv, T, D)), rng.standard_normal((B, Hkv, T, D))
tokens = rng.integers(0, 4, (B, T))
tokens[1, :] = 1 + tokens[1] % 3
tokens[1, [2, 3]] = 0  # row 1: a short document early, then one spanning the other chunks
documents = documents_of(tokens, 0)
bias = document_bias(documents.ids, documents.positions, documents.ids, documents.positions, np, np.float64)
(ref, _), saved = ops.attention_forward(q, k, v, bias)
ref_grads = ops.attention_backward(saved, weights)
mine = zigzag_positions(T, cp.size, cp.rank)
whole = (documents.ids, documents.positions)


def ring_loss():
    out, _ = ring_attention.forward(cp, q[:, :, mine], k[:, :, mine], v[:, :, mine], whole)
    return cp.group.all_reduce_scalar(float(np.sum(out * weights[:, :, mine])))


out, kept = ring_attention.forward(cp, q[:, :, mine], k[:, :, mine], v[:, :, mine], whole)
grads = ring_attention.backward(cp, kept, weights[:, :, mine])
errors = [float(np.abs(a - b[:, :, mine]).max() / np.abs(b).max()) for a, b in zip((out, *grads), (ref, *ref_grads))]
# finite differences of the ring's own loss at a few global entries (every rank perturbs its copy alike)
full_grads = [np.zeros_like(x) for x in (q, k, v)]
for full, local in zip(full_grads, grads):
    full[:, :, mine] = local
    cp.group.all_reduce(full)
picks = np.random.default_rng(1)
fd = []
for array, full in zip((q, k, v), full_grads):
    for _ in range(4):
        index = tuple(int(picks.integers(0, s)) for s in array.shape)
        old = array[index]
        array[index] = old + 1e-6
        up = ring_loss()
        array[index] = old - 1e-6
        down = ring_loss()
        array[index] = old
        fd.append([float(full[index]), (up - down) / 2e-6])
everyone = MPI.COMM_WORLD.gather({"errors": errors, "fd": fd, "finite": bool(np.all(np.isfinite(out)))})
if cp.rank == 0:
    print("RESULTS " + json.dumps(everyone))
"""


@pytest.mark.parametrize("cp", [2, 3])
def test_ring_attention_with_documents_equals_one_process_and_finite_differences(cp):
    for rank in run_python_mpi_results(cp, RING_SCRIPT, timeout=180):
        assert rank["finite"] and max(rank["errors"]) < 1e-12, rank  # output, dq, dk, dv
        for analytic, numeric in rank["fd"]:
            assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-8)


# ----------------------------------------------------------------------------- whole runs at parity (MPI)
def _run(ranks, run_dir, arch, *overrides):
    from tests.test_context_parallel import ARCH, train_run
    # synthetic tokens in [0, 16): about one in 16 is SYNTHETIC_EOD, two documents per row of 32 on average
    return train_run(ranks, run_dir, *ARCH[arch], "data.document_mask=true", "model.vocab_size=16", *overrides)


DOCUMENT_LAYOUTS = {  # name: (arch, ranks, overrides)
    "tp2": ("llama", 2, ["parallel.tp=2"]),
    "tp2-sp": ("gpt2", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2": ("gpt2", 2, ["parallel.cp=2"]),
    "cp2-llama": ("llama", 2, ["parallel.cp=2"]),
    "pp2": ("llama", 2, ["parallel.pp=2"]),
    "dp2-zero3": ("gpt2", 2, ["parallel.dp=2", "parallel.zero=3"]),
    "replicas2": ("llama", 1, ["train.thread_replicas=2"]),
    "tp2-sp-llama": ("llama", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2-pp2-recompute": ("gpt2", 4, ["parallel.cp=2", "parallel.pp=2", "memory.recompute=full"]),
    "selective": ("llama", 1, ["memory.recompute=selective"]),
}


@pytest.fixture(scope="module")
def single_document_run(tmp_path_factory):
    runs = {}

    def get(arch):
        if arch not in runs:
            runs[arch] = _run(1, tmp_path_factory.mktemp(f"documents-{arch}"), arch)
        return runs[arch]
    return get


@pytest.mark.parametrize("name", list(DOCUMENT_LAYOUTS))
def test_document_masked_run_matches_one_process(tmp_path, single_document_run, name):
    from tests.test_context_parallel import assert_same_run
    arch, ranks, overrides = DOCUMENT_LAYOUTS[name]
    assert_same_run(single_document_run(arch), _run(ranks, tmp_path / name, arch, *overrides), name)


def test_the_mask_changes_the_run(tmp_path, single_document_run):
    """The parity above is not a run without the mask: the same data unmasked gives other losses."""
    from tests.test_context_parallel import ARCH, train_run
    masked = single_document_run("gpt2")[0]
    unmasked = train_run(1, tmp_path / "plain", *ARCH["gpt2"], "model.vocab_size=16")[0]
    assert masked[0]["loss"] != pytest.approx(unmasked[0]["loss"], rel=1e-6)


# ----------------------------------------------------------------------------- a token file's stored starts
MARK = "@"  # every document starts with it and holds no other: the stream's starts are where it stands


@pytest.fixture(scope="module")
def document_folder(tmp_path_factory):
    """80 text files, documents of 3..40 bytes, each starting with MARK."""
    folder = tmp_path_factory.mktemp("documents")
    rng = np.random.default_rng(7)
    for i in range(80):
        text = "".join(rng.choice(list("abcdefgh ,."), int(rng.integers(2, 40))))
        (folder / f"doc{i:02d}.txt").write_text(MARK + text)
    return folder


@pytest.fixture(scope="module")
def byte_file(document_folder):
    """A byte-tokenizer file (no EOD id: its documents' starts are stored)."""
    from mpitrain.data.prepare import prepare_dataset
    path = document_folder.parent / "documents.h5"
    prepare_dataset(document_folder, path, val_fraction=0.25)
    return path


def test_a_byte_file_splits_rows_at_its_stored_document_starts(byte_file):
    from mpitrain.data.dataset import TokenDataset, train_and_val_samplers
    dataset = TokenDataset(byte_file)
    assert dataset.eod_id is None and dataset.doc_starts("train") is not None
    for sampler in train_and_val_samplers(dataset, 32, 4, 0):
        for step in range(3):
            inputs, _ = sampler.global_batch_rows(step, range(4))
            starts = sampler.document_starts(step, range(4))
            assert np.array_equal(starts[:, 1:], inputs[:, 1:] == ord(MARK))
            assert starts[:, 1:].any()


@pytest.mark.parametrize("ranks, overrides", [(2, ["parallel.dp=2"]), (2, ["parallel.cp=2"])], ids=["dp2", "cp2"])
def test_a_run_on_a_byte_file_matches_one_process(tmp_path, byte_file, ranks, overrides):
    from tests.test_train_parity import assert_same_run, train_run
    single = train_run(1, tmp_path / "one", byte_file, "data.document_mask=true", "train.eval_batches=1")
    assert_same_run(single, train_run(ranks, tmp_path / "many", byte_file, "data.document_mask=true",
                                      "train.eval_batches=1", *overrides))


def test_a_bpe_file_ends_documents_with_its_eod_where_its_starts_say(tmp_path, document_folder):
    """A trained BPE has an end-of-document token: rows split after it, at the same places as the stored starts."""
    pytest.importorskip("tokenizers", reason="BPE needs the 'tokenizers' package (the bpe extra)")
    from mpitrain.data.dataset import TokenDataset, train_and_val_samplers
    from mpitrain.data.prepare import prepare_dataset
    path = tmp_path / "bpe.h5"
    prepare_dataset(document_folder, path, tokenizer="bpe", vocab_size=300, val_fraction=0.25)
    dataset = TokenDataset(path)
    assert dataset.eod_id is not None
    for sampler in train_and_val_samplers(dataset, 32, 4, 0):
        by_eod = sampler.document_starts(1, range(4))
        sampler.eod_id = None  # the stored starts instead
        assert np.array_equal(by_eod[:, 1:], sampler.document_starts(1, range(4))[:, 1:])
        assert by_eod[:, 1:].any()


def test_train_refuses_document_mask_on_a_file_without_boundaries(tmp_path):
    import h5py

    from tests.mpi_helpers import describe, run_mpi
    path = tmp_path / "old.h5"
    with h5py.File(path, "w") as f:  # the format before document starts and eod_id
        f.create_dataset("train", data=np.arange(400, dtype=np.uint16) % 256)
        f.create_dataset("val", data=np.arange(200, dtype=np.uint16) % 256)
        f.attrs.update({"vocab_size": 256, "tokenizer": '{"kind": "byte", "vocab_size": 256}'})
    result = run_mpi(1, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path / "run"),
                         "--set", f"data.path={path}", "--set", "data.document_mask=true"])
    assert result.returncode == 1, describe(result)
    assert "data.document_mask = true needs document boundaries" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
