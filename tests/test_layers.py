"""Sublayers and linears beyond their gradients (tests/test_ops.py checks those against finite differences): frozen
linears, the split (deferred) backward, the declared saved arrays, generic ties, low precision (bf16/fp16 storage with
fp32 compute)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mpitrain.backend import make_backend, nbytes_of
from mpitrain.config import ModelConfig
from mpitrain.layers import ops
from mpitrain.layers.linear import ColumnParallelLinear, RowParallelLinear, run_weight_grads
from mpitrain.layers.tensor_parallel import TensorParallel
from mpitrain.model.gpt import GPT
from mpitrain.model.units import Block, Embedding, Head
from tests.test_ops import SUBLAYER_MODEL, random_params, sublayer_context

ONE_RANK = TensorParallel(None)
BF16 = np.dtype(ml_dtypes.bfloat16)


def column_and_row(rng):
    """A column-parallel pair of linears sharing their input, and a row-parallel one, with inputs and output grads."""
    column = ColumnParallelLinear(ONE_RANK, 6, ["wa", "wb"], ["ba", None])
    row = RowParallelLinear(ONE_RANK, 6, "wr", "br")
    params = {"wa": rng.normal(size=(6, 5)), "ba": rng.normal(size=5), "wb": rng.normal(size=(6, 3)),
              "wr": rng.normal(size=(6, 4)), "br": rng.normal(size=4)}
    x = rng.normal(size=(2, 3, 6))
    return column, row, params, x, [rng.normal(size=(2, 3, 5)), rng.normal(size=(2, 3, 3))], rng.normal(size=(2, 3, 4))


def test_frozen_linears_write_no_weight_gradient_and_the_same_input_gradient():
    column, row, p, x, column_dys, row_dy = column_and_row(np.random.default_rng(0))
    zeros = {name: np.zeros_like(value) for name, value in p.items()}
    _, h = column.forward(p, x)
    dx_trained = column.backward(p, dict(zeros), h, column_dys)
    dx_row_trained = row.backward(p, dict(zeros), x, row_dy)
    for linear in (column, row):
        linear.trainable = False
    # an empty gradient dict: any gradient the frozen linears tried to add would be a KeyError
    np.testing.assert_array_equal(column.backward(p, {}, h, column_dys), dx_trained)
    np.testing.assert_array_equal(row.backward(p, {}, x, row_dy), dx_row_trained)
    deferred = []
    column.backward(p, {}, h, column_dys, deferred)
    row.backward(p, {}, x, row_dy, deferred)
    assert deferred == []  # nothing left for a W pass either


def test_split_backward_defers_exactly_the_weight_matmuls():
    """With a `deferred` list the input and bias gradients come at once, the weight gradients only from W, and the
    result equals the one-pass backward: one code path for zb1p and the rest."""
    column, row, p, x, column_dys, row_dy = column_and_row(np.random.default_rng(1))
    grads = [{name: np.zeros_like(value) for name, value in p.items()} for _ in range(2)]
    _, h = column.forward(p, x)
    dx_once = column.backward(p, grads[0], h, column_dys), row.backward(p, grads[0], x, row_dy)
    deferred = []
    dx_split = column.backward(p, grads[1], h, column_dys, deferred), row.backward(p, grads[1], x, row_dy, deferred)
    assert [name for name, _, _ in deferred] == ["wa", "wb", "wr"]
    assert not any(np.any(grads[1][name]) for name in ("wa", "wb", "wr"))
    np.testing.assert_array_equal(grads[1]["ba"], grads[0]["ba"])
    np.testing.assert_array_equal(grads[1]["br"], grads[0]["br"])
    run_weight_grads(deferred, grads[1])
    for a, b in zip(dx_once, dx_split):
        np.testing.assert_array_equal(a, b)
    for name in p:
        np.testing.assert_array_equal(grads[1][name], grads[0][name], err_msg=name)


def arrays_in(tree):
    """The arrays of a nested dict/tuple/list (a saved state)."""
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (tuple, list)):
        for node in tree:
            yield from arrays_in(node)
    elif hasattr(tree, "nbytes"):
        yield tree


def distinct_arrays(tree, leave_out=()):
    """(size, dtype) of each array a saved state keeps alive (views counted as their base, once), as nbytes_of."""
    found = {}
    for array in arrays_in(tree):
        if not any(array is other for other in leave_out):
            while getattr(array, "base", None) is not None:
                array = array.base
            found[id(array)] = (array.size, array.dtype)
    return sorted(found.values(), key=str)


@pytest.mark.parametrize("dtype", [np.float64, BF16], ids=["float64", "bfloat16"])
@pytest.mark.parametrize("arch, extra", [("gpt2", {}), ("llama", {"n_head": 4, "n_kv_head": 2})])
def test_units_save_exactly_the_arrays_they_declare(arch, extra, dtype):
    """saved_arrays (what `mpitrain memory` counts) lists every array forward saves, with its size and dtype."""
    cfg = ModelConfig(arch=arch, **{**SUBLAYER_MODEL, **extra})
    ctx, rng = sublayer_context(cfg, cfg.seq_len, dtype), np.random.default_rng(2)
    tokens, batch = rng.integers(0, cfg.vocab_size, size=(3, cfg.seq_len)), 3
    x = rng.normal(size=(batch, cfg.seq_len, cfg.d_model)).astype(dtype)
    embed, block, head = Embedding(cfg, ONE_RANK), Block(cfg, 0, ONE_RANK), Head(cfg, ONE_RANK)
    runs = [(embed, tokens), (block, x), (head, x)]
    for unit, unit_input in runs:
        p = {k: v.astype(dtype) for k, v in random_params(unit.layout.specs, rng).items()}
        p.update({name: rng.normal(size=(cfg.vocab_size, cfg.d_model)).astype(dtype) for name in unit.borrows})
        _, saved = unit.forward(p, unit_input, {**ctx, "targets": tokens})
        shared = [ctx.get("cos"), ctx.get("sin")]  # the model's tables, declared once by GPT.saved_bytes
        declared = [(int(np.prod(shape)), np.dtype(kind)) for shape, kind in unit.saved_arrays(batch, cfg.seq_len,
                                                                                               np.dtype(dtype))]
        assert distinct_arrays(saved, shared) == sorted(declared, key=str), unit.layout.name
        held = nbytes_of(saved) - nbytes_of([a for a in shared if a is not None and unit is block])
        assert held == sum(size * kind.itemsize for size, kind in declared)


def test_a_tied_copy_is_marked_with_the_tensor_it_copies():
    """gpt2's head borrows "embed.wte"; on the last pipeline stage that is a copy whose tensors say so."""
    cfg = ModelConfig(arch="gpt2", **{**SUBLAYER_MODEL, "n_layer": 2})
    last_stage = GPT(cfg, make_backend("cpu", "float64"), stages=[(2, 4)])
    copy = last_stage.layouts[last_stage.tied_unit]
    assert [(spec.name, spec.tied_to) for spec in copy.specs] == [("wte", "embed.wte"), ("wpe", "embed.wpe")]
    assert last_stage.tied_copies == ("embed.wte", "embed.wpe")
    first_stage = GPT(cfg, make_backend("cpu", "float64"), stages=[(0, 2)])
    assert first_stage.tied_unit == 0 and all(spec.tied_to is None for spec in first_stage.layouts[0].specs)


# ---- low precision: bf16/fp16 storage, fp32 compute inside each op ---------------------------------------------------
def rel_err(expected, actual) -> float:
    expected, actual = np.asarray(expected, np.float64), np.asarray(actual, np.float64)
    return float(np.linalg.norm(expected - actual) / np.linalg.norm(expected))


def all_floating(tree):
    return [array for array in arrays_in(tree) if array.dtype.kind in "fV"]  # V: ml_dtypes' bfloat16


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("arch, extra", [("gpt2", {}), ("llama", {"n_head": 4, "n_kv_head": 2})])
def test_low_precision_block_is_close_to_float32_and_stays_low_precision(arch, extra, dtype):
    cfg = ModelConfig(arch=arch, **{**SUBLAYER_MODEL, "d_model": 32, "seq_len": 16, **extra})
    rng = np.random.default_rng(3)
    block = Block(cfg, 0, ONE_RANK)
    p32 = {k: v.astype(np.float32) for k, v in random_params(block.layout.specs, rng).items()}
    x32 = rng.normal(size=(2, cfg.seq_len, cfg.d_model)).astype(np.float32)
    dy32 = rng.normal(size=x32.shape).astype(np.float32)
    results = {}
    for kind in (np.float32, dtype):
        p = {k: v.astype(kind) for k, v in p32.items()}
        g = {k: np.zeros_like(v) for k, v in p.items()}
        y, saved = block.forward(p, x32.astype(kind), sublayer_context(cfg, cfg.seq_len, kind))
        assert y.dtype == kind and all(a.dtype == kind for a in all_floating(saved)), kind
        dx = block.backward(p, g, saved, dy32.astype(kind))
        assert dx.dtype == kind and all(v.dtype == kind for v in g.values()), kind
        results[kind] = y, dx, g
    (y32, dx32, g32), (y, dx, g) = results[np.float32], results[dtype]
    # relative to the dtype's epsilon (bf16 2^-7, fp16 2^-10): forward ~1e-2 for bf16; backward rounds more often
    unit = float(ml_dtypes.finfo(dtype).eps)
    assert rel_err(y32, y) < 3 * unit
    assert rel_err(dx32, dx) < 8 * unit
    assert max(rel_err(g32[name], g[name]) for name in g32) < 8 * unit
    assert rel_err(y32, y) > 0  # rounding happened: the low-precision path is not secretly float32


def test_float32_passes_through_the_cast_rule_untouched():
    rng = np.random.default_rng(4)
    x, w = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(4, 2)).astype(np.float32)
    y, saved = ops.linear_forward(x, w)
    assert y.dtype == np.float32 and saved is x
    low = x.astype(BF16)
    y_low, saved_low = ops.linear_forward(low, w.astype(BF16))
    assert y_low.dtype == BF16 and saved_low is low  # a handed-through input stays that very array
