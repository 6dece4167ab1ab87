"""Gradient checks of every forward/backward pair the model runs, against central finite differences: the ops of
mpitrain.layers.ops, and with one rank (their serial form) the tensor-parallel linears, the embedding and loss ops,
and every sublayer (norm, attention, MLP, embedding, head) and whole block. Sublayer-level properties (frozen
linears, the split backward, declared saved arrays, low precision) are in tests/test_layers.py.

Each case is an op with its differentiable inputs (whose gradients backward returns) and its parameters (whose
gradients backward ADDS into given arrays). The scalar checked is a random projection of the outputs,
L = sum(y * R) with a fixed random R, so every output element contributes; float64 throughout.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from mpitrain.backend import nbytes_of
from mpitrain.config import ModelConfig
from mpitrain.layers import ops
from mpitrain.layers import tensor_parallel as tensor
from mpitrain.layers.attention import Attention
from mpitrain.layers.embedding import TokenEmbedding
from mpitrain.layers.head import LMHead
from mpitrain.layers.linear import ColumnParallelLinear, RowParallelLinear
from mpitrain.layers.mlp import MLP
from mpitrain.layers.norm import Norm
from mpitrain.model.units import Block

ONE_RANK = tensor.TensorParallel(None)

FD_STEP = 1e-5
RTOL = 1e-6


@dataclass
class OpCase:
    """An op under test.

    forward(inputs, params) -> (outputs: tuple, saved)
    backward(saved, inputs, params, douts: tuple, grads: dict) -> tuple of input gradients, in `inputs` order
    """
    inputs: dict
    params: dict
    forward: Callable
    backward: Callable


# ----------------------------------------------------------------------------- the cases
def linear_case(rng, bias, lead, n_weights=1):
    """Column-parallel linear(s) sharing one input (one rank: plain linears)."""
    names = [f"w{i}" for i in range(n_weights)]
    params = {name: rng.normal(size=(5, 4 + i)) for i, name in enumerate(names)}
    biases = [f"b{i}" if bias else None for i in range(n_weights)]
    params.update({f"b{i}": rng.normal(size=4 + i) for i in range(n_weights) if bias})
    linear = ColumnParallelLinear(ONE_RANK, 5, names, biases)
    return OpCase(
        {"x": rng.normal(size=(*lead, 5))}, params,
        lambda i, p: tuple(linear.forward(p, i["x"])),
        lambda s, i, p, dys, g: (linear.backward(p, g, s, list(dys)),))


def row_parallel_case(rng, bias):
    params = {"w": rng.normal(size=(5, 4))}
    if bias:
        params["b"] = rng.normal(size=4)
    linear = RowParallelLinear(ONE_RANK, 5, "w", "b" if bias else None)
    return OpCase(
        {"x": rng.normal(size=(2, 3, 5))}, params,
        lambda i, p: _one(linear.forward(p, i["x"])),
        lambda s, i, p, dys, g: (linear.backward(p, g, s, dys[0]),))


def layernorm_case(rng):
    eps = 1e-5
    return OpCase(
        {"x": 0.5 + rng.normal(size=(2, 3, 6))}, {"w": rng.normal(size=6), "b": rng.normal(size=6)},
        lambda i, p: _one(ops.layernorm_forward(i["x"], p["w"], p["b"], eps)),
        lambda s, i, p, dys, g: (ops.layernorm_backward(s, p["w"], dys[0], g["w"], g["b"]),))


def rmsnorm_case(rng):
    eps = 1e-5
    return OpCase(
        {"x": 0.5 + rng.normal(size=(2, 3, 6))}, {"w": rng.normal(size=6)},
        lambda i, p: _one(ops.rmsnorm_forward(i["x"], p["w"], eps)),
        lambda s, i, p, dys, g: (ops.rmsnorm_backward(s, p["w"], dys[0], g["w"]),))


def gelu_case(rng):
    return OpCase(
        {"x": 2.0 * rng.normal(size=(3, 7))}, {},
        lambda i, p: _one(ops.gelu_forward(i["x"])),
        lambda s, i, p, dys, g: (ops.gelu_backward(s, dys[0]),))


def gelu_from_output_case(rng):
    """The MLP's GELU backward: s from the saved output y = x s; x holds exact zeros (s = 1/2 there, not 0 / 0)."""
    x = 2.0 * rng.normal(size=(3, 7))
    x[0, :2] = 0.0
    return OpCase(
        {"x": x}, {},
        lambda i, p: _one(ops.gelu_forward(i["x"])),
        lambda s, i, p, dys, g: (ops.gelu_backward_from_output(s, ops.gelu_forward(s)[0], dys[0]),))


def gelu_bias_case(rng):
    """The gpt2 MLP's GELU on float64/float32 numpy: it adds the fc bias in its tiles and sums the bias gradient
    there (forward gets the product without bias; the copy because it adds in place, as it may on the MLP's own
    buffer)."""
    return OpCase(
        {"x": 2.0 * rng.normal(size=(3, 7))}, {"b": rng.normal(size=7)},
        lambda i, p: _one(ops.gelu_forward(i["x"].copy(), p["b"])),
        lambda s, i, p, dys, g: (ops.gelu_backward_from_output(s, ops.gelu_forward(s)[0], dys[0], g["b"]),))


def swiglu_case(rng):
    return OpCase(
        {"gate": 2.0 * rng.normal(size=(2, 3, 5)), "up": rng.normal(size=(2, 3, 5))}, {},
        lambda i, p: _one(ops.swiglu_forward(i["gate"], i["up"])),
        lambda s, i, p, dys, g: ops.swiglu_backward(s, dys[0]))


def embedding_case(rng):
    ids = np.array([[0, 3, 3, 6], [6, 1, 3, 0]])  # repeated ids: their gradients must add up, not overwrite

    def backward(saved, inputs, params, dys, grads):
        tensor.vocab_parallel_embedding_backward(ONE_RANK, saved, dys[0], grads["table"])
        return ()  # token ids have no gradient

    return OpCase({}, {"table": rng.normal(size=(7, 5))},
                  lambda i, p: _one(tensor.vocab_parallel_embedding_forward(ONE_RANK, p["table"], ids.copy(), 0)),
                  backward)


def rope_case(rng, positions):
    cos, sin = ops.rope_tables(np.asarray(positions), 6, 10000.0, np, np.float64)
    return OpCase(
        {"x": rng.normal(size=(2, 3, len(positions), 6))}, {},
        lambda i, p: ((ops.rope_forward(i["x"], cos, sin),), None),
        lambda s, i, p, dys, g: (ops.rope_backward(dys[0], cos, sin),))


def attention_case(rng, n_head, n_kv_head, t_q, t_k, bias):
    b, d = 2, 4
    if bias == "causal":
        mask = ops.causal_bias(t_q, t_k, np, np.float64, offset=t_k - t_q)  # the queries are the last t_q positions
    else:
        mask = np.zeros((t_q, t_k))
    return OpCase(
        {"q": rng.normal(size=(b, n_head, t_q, d)), "k": rng.normal(size=(b, n_kv_head, t_k, d)),
         "v": rng.normal(size=(b, n_kv_head, t_k, d))}, {},
        lambda i, p: _out_only(ops.attention_forward(i["q"], i["k"], i["v"], mask)),
        lambda s, i, p, dys, g: ops.attention_backward(s, dys[0]))


def cross_entropy_case(rng):
    targets = rng.integers(0, 6, size=(2, 3))
    return OpCase(
        {"logits": 2.0 * rng.normal(size=(2, 3, 6))}, {},
        lambda i, p: _one(tensor.vocab_parallel_cross_entropy_forward(ONE_RANK, i["logits"], targets, 0)),
        lambda s, i, p, dys, g: (tensor.vocab_parallel_cross_entropy_backward(s, dys[0]),))


# ----------------------------------------------------------------------------- sublayers and blocks (one rank)
SUBLAYER_MODEL = {"n_layer": 1, "d_model": 8, "n_head": 2, "vocab_size": 7, "seq_len": 4, "d_ff": 12}


def sublayer_context(cfg: ModelConfig, t: int, dtype=np.float64) -> dict:
    """What GPT.context hands every unit: positions, the causal mask, rotary tables."""
    ctx = {"xp": np, "positions": np.arange(t), "bias": ops.causal_bias(t, t, np, dtype)}
    if cfg.arch == "llama":
        ctx["cos"], ctx["sin"] = ops.rope_tables(np.arange(t), cfg.head_dim, cfg.rope_theta, np, dtype)
    return ctx


def random_params(specs, rng) -> dict:
    """Every tensor off its initial value (norm gains 1, biases 0), so that each one matters to the output."""
    return {spec.name: (1.0 if spec.init == "ones" else 0.0) + 0.4 * rng.normal(size=spec.shape) for spec in specs}


def sublayer_case(rng, make, arch, **model):
    cfg = ModelConfig(arch=arch, **{**SUBLAYER_MODEL, **model})
    layer, ctx = make(cfg), sublayer_context(cfg, cfg.seq_len)
    specs = layer.layout.specs if hasattr(layer, "layout") else layer.specs
    return OpCase(
        {"x": rng.normal(size=(2, cfg.seq_len, cfg.d_model))}, random_params(specs, rng),
        lambda i, p: _one(layer.forward(p, i["x"], ctx)),
        lambda s, i, p, dys, g: (layer.backward(p, g, s, dys[0]),))


def token_embedding_case(rng, arch):
    cfg = ModelConfig(arch=arch, **SUBLAYER_MODEL)
    layer, ctx = TokenEmbedding(cfg, ONE_RANK), sublayer_context(cfg, cfg.seq_len)
    tokens = np.array([[0, 3, 3, 6], [6, 1, 3, 0]])

    def backward(saved, inputs, params, dys, grads):
        layer.backward(params, grads, saved, dys[0])
        return ()

    return OpCase({}, random_params(layer.specs, rng), lambda i, p: _one(layer.forward(p, tokens.copy(), ctx)),
                  backward)


def head_case(rng, arch):
    """The loss (a scalar) of the final norm, the projection (gpt2: the borrowed embedding, transposed) and the
    cross-entropy."""
    cfg = ModelConfig(arch=arch, **SUBLAYER_MODEL)
    head = LMHead(cfg, ONE_RANK)
    params = random_params(head.specs, rng)
    if head.tied:
        params["wte"] = rng.normal(size=(cfg.vocab_size, cfg.d_model))
    targets = rng.integers(0, cfg.vocab_size, size=(2, cfg.seq_len))
    return OpCase(
        {"x": rng.normal(size=(2, cfg.seq_len, cfg.d_model))}, params,
        lambda i, p: _one(head.forward(p, i["x"], {"targets": targets})),
        lambda s, i, p, dys, g: (head.backward(p, g, s, dys[0]),))


def _one(result):
    """(y, saved) -> ((y,), saved)."""
    y, saved = result
    return (y,), saved


def _out_only(result):
    """((out, lse), saved) of the attention core -> ((out,), saved): lse's values are pinned separately."""
    (out, _), saved = result
    return (out,), saved


CASES = {
    "linear-bias-3d": lambda rng: linear_case(rng, True, (2, 3)),
    "linear-bias-2d": lambda rng: linear_case(rng, True, (4,)),
    "linear-nobias-3d": lambda rng: linear_case(rng, False, (2, 3)),
    "linear-three-sharing-input": lambda rng: linear_case(rng, True, (2, 3), n_weights=3),
    "row-parallel-linear-bias": lambda rng: row_parallel_case(rng, True),
    "row-parallel-linear-nobias": lambda rng: row_parallel_case(rng, False),
    "layernorm": layernorm_case,
    "rmsnorm": rmsnorm_case,
    "gelu": gelu_case,
    "gelu-from-output": gelu_from_output_case,
    "gelu-bias-in-tiles": gelu_bias_case,
    "swiglu": swiglu_case,
    "embedding": embedding_case,
    "rope": lambda rng: rope_case(rng, [0, 1, 2, 3]),
    "rope-offset-positions": lambda rng: rope_case(rng, [5, 6, 7, 100]),
    "attention-mha-causal": lambda rng: attention_case(rng, 4, 4, 3, 3, "causal"),
    "attention-mha-nobias": lambda rng: attention_case(rng, 2, 2, 3, 3, "none"),
    "attention-gqa-causal": lambda rng: attention_case(rng, 4, 2, 3, 3, "causal"),
    "attention-mqa-causal": lambda rng: attention_case(rng, 4, 1, 3, 3, "causal"),
    "attention-gqa-causal-chunk": lambda rng: attention_case(rng, 4, 2, 2, 5, "causal"),  # t_q < t_k, offset > 0
    "attention-gqa-nobias": lambda rng: attention_case(rng, 4, 2, 3, 3, "none"),
    "cross_entropy": cross_entropy_case,
    "sublayer-layernorm": lambda rng: sublayer_case(rng, lambda c: Norm("layernorm", "n", 8, 1e-5, ONE_RANK), "gpt2"),
    "sublayer-rmsnorm": lambda rng: sublayer_case(rng, lambda c: Norm("rmsnorm", "n", 8, 1e-5, ONE_RANK), "llama"),
    "sublayer-attention-gpt2": lambda rng: sublayer_case(rng, lambda c: Attention(c, ONE_RANK), "gpt2"),
    "sublayer-attention-llama-gqa": lambda rng: sublayer_case(rng, lambda c: Attention(c, ONE_RANK), "llama",
                                                              n_head=4, n_kv_head=2),
    "sublayer-mlp-gpt2": lambda rng: sublayer_case(rng, lambda c: MLP(c, ONE_RANK), "gpt2"),
    "sublayer-mlp-llama": lambda rng: sublayer_case(rng, lambda c: MLP(c, ONE_RANK), "llama"),
    "sublayer-embedding-gpt2": lambda rng: token_embedding_case(rng, "gpt2"),
    "sublayer-embedding-llama": lambda rng: token_embedding_case(rng, "llama"),
    "sublayer-head-gpt2-tied": lambda rng: head_case(rng, "gpt2"),
    "sublayer-head-llama": lambda rng: head_case(rng, "llama"),
    "block-gpt2": lambda rng: sublayer_case(rng, lambda c: Block(c, 0, ONE_RANK), "gpt2"),
    "block-llama-mqa": lambda rng: sublayer_case(rng, lambda c: Block(c, 0, ONE_RANK), "llama", n_kv_head=1),
}
PARAM_CASES = [name for name in CASES if name.startswith(("linear", "layernorm", "rmsnorm", "embedding", "sublayer",
                                                          "block", "gelu-bias"))]


def make_case(name, seed=0):
    return CASES[name](np.random.default_rng(seed))


def projections(outputs, rng):
    return tuple(float(rng.normal()) if np.ndim(y) == 0 else rng.normal(size=np.shape(y)) for y in outputs)


def projected_loss(case, projs):
    outputs, _ = case.forward(case.inputs, case.params)
    return sum(float(np.sum(y * r)) for y, r in zip(outputs, projs))


def finite_difference(case, projs, array):
    """Central differences of the projected loss w.r.t. every coordinate of `array` (perturbed in place)."""
    grad = np.zeros_like(array)
    flat = array.reshape(-1)
    assert np.shares_memory(flat, array)
    for j in range(flat.size):
        old = flat[j]
        flat[j] = old + FD_STEP
        plus = projected_loss(case, projs)
        flat[j] = old - FD_STEP
        minus = projected_loss(case, projs)
        flat[j] = old
        grad.reshape(-1)[j] = (plus - minus) / (2 * FD_STEP)
    return grad


def rel_err(expected, actual):
    expected, actual = np.asarray(expected, dtype=np.float64), np.asarray(actual, dtype=np.float64)
    assert expected.shape == actual.shape, (expected.shape, actual.shape)
    scale = max(np.linalg.norm(expected), np.linalg.norm(actual))
    return 0.0 if scale == 0 else float(np.linalg.norm(expected - actual) / scale)


def run_backward(case, projs, grads=None):
    _, saved = case.forward(case.inputs, case.params)
    if grads is None:
        grads = {k: np.zeros_like(v) for k, v in case.params.items()}
    dxs = case.backward(saved, case.inputs, case.params, projs, grads)
    return dxs, grads


# ----------------------------------------------------------------------------- gradient checks
@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_finite_differences(name):
    case = make_case(name)
    outputs, _ = case.forward(case.inputs, case.params)
    projs = projections(outputs, np.random.default_rng(1))
    dxs, grads = run_backward(case, projs)

    assert len(dxs) == len(case.inputs), "backward must return one gradient per differentiable input"
    checked = {}
    for (input_name, x), dx in zip(case.inputs.items(), dxs):
        checked[f"d{input_name}"] = rel_err(finite_difference(case, projs, x), dx)
    for param_name, w in case.params.items():
        checked[f"d{param_name}"] = rel_err(finite_difference(case, projs, w), grads[param_name])
    assert checked, "nothing was checked"
    bad = {k: v for k, v in checked.items() if not v < RTOL}
    assert not bad, f"{name}: relative errors {checked}"


@pytest.mark.parametrize("name", PARAM_CASES)
def test_parameter_grads_accumulate(name):
    """backward ADDS into the gradient arrays: into what is there already, and once more per call."""
    case = make_case(name)
    outputs, _ = case.forward(case.inputs, case.params)
    projs = projections(outputs, np.random.default_rng(1))
    dxs_ref, fresh = run_backward(case, projs)
    assert all(np.any(g != 0) for g in fresh.values())

    start = {k: np.random.default_rng(2).normal(size=v.shape) for k, v in case.params.items()}
    grads = {k: v.copy() for k, v in start.items()}
    _, saved = case.forward(case.inputs, case.params)
    for calls in (1, 2):
        dxs = case.backward(saved, case.inputs, case.params, projs, grads)
        for k, grad in grads.items():
            np.testing.assert_allclose(grad, start[k] + calls * fresh[k], rtol=1e-12, atol=1e-12, err_msg=k)
        for dx, dx_ref in zip(dxs, dxs_ref):
            np.testing.assert_array_equal(dx, dx_ref)


def _assert_same_tree(before, after, what):
    if isinstance(before, dict):
        assert before.keys() == after.keys()
        for k in before:
            _assert_same_tree(before[k], after[k], f"{what}[{k!r}]")
    elif isinstance(before, (tuple, list)):
        assert len(before) == len(after)
        for j, (b, a) in enumerate(zip(before, after)):
            _assert_same_tree(b, a, f"{what}[{j}]")
    elif isinstance(before, np.ndarray):
        np.testing.assert_array_equal(after, before, err_msg=f"{what} was modified")
    else:
        assert before == after, what


@pytest.mark.parametrize("name", list(CASES))
def test_ops_do_not_modify_their_arguments(name):
    """forward leaves inputs and parameters alone; backward leaves saved state, dy and parameters alone, so a
    backward can be re-run (and the tied head's views stay intact)."""
    case = make_case(name)
    inputs, params = copy.deepcopy(case.inputs), copy.deepcopy(case.params)
    outputs, saved = case.forward(case.inputs, case.params)
    _assert_same_tree(inputs, case.inputs, "inputs")
    _assert_same_tree(params, case.params, "params")
    projs = projections(outputs, np.random.default_rng(1))
    saved_copy, projs_copy = copy.deepcopy(saved), copy.deepcopy(projs)
    case.backward(saved, case.inputs, case.params, projs, {k: np.zeros_like(v) for k, v in case.params.items()})
    _assert_same_tree(saved_copy, saved, "saved")
    _assert_same_tree(projs_copy, projs, "dy")
    _assert_same_tree(inputs, case.inputs, "inputs")
    _assert_same_tree(params, case.params, "params")


# ----------------------------------------------------------------------------- forward values (backward checks
# above only prove consistency with forward; these pin what forward computes)
def test_causal_bias_values():
    np.testing.assert_array_equal(ops.causal_bias(3, 3, np, np.float64),
                                  np.array([[0, -np.inf, -np.inf], [0, 0, -np.inf], [0, 0, 0]]))
    # a chunk of 2 queries at positions 3, 4 against keys 0..4
    bias = ops.causal_bias(2, 5, np, np.float64, offset=3)
    np.testing.assert_array_equal(bias == 0, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    assert np.all(np.isneginf(bias[bias != 0]))


@pytest.mark.parametrize("n_head,n_kv_head", [(4, 4), (4, 2), (4, 1)])
def test_attention_forward_matches_naive_loop(n_head, n_kv_head):
    rng = np.random.default_rng(3)
    b, t, d = 2, 4, 3
    q, k, v = (rng.normal(size=(b, n, t, d)) for n in (n_head, n_kv_head, n_kv_head))
    (out, lse), _ = ops.attention_forward(q, k, v, ops.causal_bias(t, t, np, np.float64))
    group = n_head // n_kv_head
    expected, expected_lse = np.zeros_like(q), np.zeros(q.shape[:3])
    for bi in range(b):
        for h in range(n_head):
            kv = h // group  # query head h reads key/value head h // group (HF's repeat_kv order)
            for i in range(t):
                s = np.array([q[bi, h, i] @ k[bi, kv, j] / np.sqrt(d) for j in range(i + 1)])
                w = np.exp(s - s.max())
                expected_lse[bi, h, i] = s.max() + np.log(w.sum())
                w /= w.sum()
                expected[bi, h, i] = w @ v[bi, kv, : i + 1]
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12, atol=1e-14)


def test_attention_over_key_blocks_merges_by_log_sum_exp():
    """The core on a block of queries against each block of keys (causal mask with the blocks' position offset),
    merged by log-sum-exp, is attention over all keys: what context parallelism will do with sequence chunks."""
    rng = np.random.default_rng(8)
    b, h, hkv, t, d, split = 2, 4, 2, 6, 3, 2
    q, k, v = (rng.normal(size=(b, n, t, d)) for n in (h, hkv, hkv))
    (full, full_lse), _ = ops.attention_forward(q, k, v, ops.causal_bias(t, t, np, np.float64))
    queries = q[:, :, split:]  # positions split..t-1 against keys [0, split) and [split, t)
    (out1, lse1), _ = ops.attention_forward(queries, k[:, :, :split], v[:, :, :split],
                                            ops.causal_bias(t - split, split, np, np.float64, offset=split))
    (out2, lse2), _ = ops.attention_forward(queries, k[:, :, split:], v[:, :, split:],
                                            ops.causal_bias(t - split, t - split, np, np.float64))
    lse = np.logaddexp(lse1, lse2)
    merged = np.exp(lse1 - lse)[..., None] * out1 + np.exp(lse2 - lse)[..., None] * out2
    np.testing.assert_allclose(lse, full_lse[:, :, split:], rtol=1e-12)
    np.testing.assert_allclose(merged, full[:, :, split:], rtol=1e-12, atol=1e-14)


def test_rope_is_the_rotate_half_rotation():
    rng = np.random.default_rng(4)
    positions, d, theta = np.array([0, 1, 5, 9]), 8, 500.0
    x = rng.normal(size=(1, 2, 4, d))
    cos, sin = ops.rope_tables(positions, d, theta, np, np.float64)
    y = ops.rope_forward(x, cos, sin)
    # pair (x[i], x[i + d/2]) is the complex number x[i] + i x[i + d/2], turned by position * theta^(-2i/d)
    angles = positions[:, None] * theta ** (-np.arange(d // 2) * 2.0 / d)
    z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * np.exp(1j * angles)
    np.testing.assert_allclose(y, np.concatenate([z.real, z.imag], axis=-1), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(y[:, :, 0], x[:, :, 0])  # position 0 is not rotated
    np.testing.assert_allclose(ops.rope_backward(y, cos, sin), x, atol=1e-14)  # orthogonal: transpose = inverse


def test_cross_entropy_forward_is_summed_negative_log_likelihood():
    rng = np.random.default_rng(5)
    logits, targets = 30.0 * rng.normal(size=(2, 3, 7)), rng.integers(0, 7, size=(2, 3))
    loss_sum, _ = tensor.vocab_parallel_cross_entropy_forward(ONE_RANK, logits, targets, 0)
    rows = logits.reshape(-1, 7)
    m = rows.max(axis=1)
    logz = m + np.log(np.exp(rows - m[:, None]).sum(axis=1))
    np.testing.assert_allclose(loss_sum, np.sum(logz - rows[np.arange(6), targets.reshape(-1)]), rtol=1e-13)


def test_norms_and_activations_forward_values():
    rng = np.random.default_rng(6)
    x, w, b = rng.normal(size=(3, 5)), rng.normal(size=5), rng.normal(size=5)
    ln, _ = ops.layernorm_forward(x, w, b, 1e-5)
    xc = x - x.mean(-1, keepdims=True)
    np.testing.assert_allclose(ln, xc / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b, rtol=1e-12)
    rms, _ = ops.rmsnorm_forward(x, w, 1e-5)
    np.testing.assert_allclose(rms, x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w, rtol=1e-12)
    g, _ = ops.gelu_forward(x)
    np.testing.assert_allclose(g, 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))), rtol=1e-12)
    x[0, 0] = x[1, 1] = 0.0
    np.testing.assert_allclose(ops.gelu_backward_from_output(x, ops.gelu_forward(x)[0], w * x),
                               ops.gelu_backward(x, w * x), rtol=1e-12, atol=1e-15)
    s, _ = ops.swiglu_forward(x, w * x)
    np.testing.assert_allclose(s, x / (1 + np.exp(-x)) * w * x, rtol=1e-12)


def test_scatter_add_rows_sums_repeated_rows_as_add_at_does():
    rng = np.random.default_rng(8)
    rows, values = rng.integers(0, 6, size=40), rng.normal(size=(40, 3))
    table = rng.normal(size=(9, 3))
    want = table.copy()
    np.add.at(want, rows, values)
    ops.scatter_add_rows(table, rows, values)
    np.testing.assert_allclose(table, want, rtol=1e-13, atol=1e-13)
    ops.scatter_add_rows(table, rows[:0], values[:0])  # no rows: nothing changes
    np.testing.assert_allclose(table, want, rtol=1e-13, atol=1e-13)


# ----------------------------------------------------------------------------- activation memory accounting
def test_nbytes_of_counts_a_shared_array_once():
    a = np.zeros((4, 8))
    b = np.zeros(3, dtype=np.float32)
    assert nbytes_of(None) == 0
    assert nbytes_of(a) == a.nbytes
    assert nbytes_of((a, a, [a, {"x": a}])) == a.nbytes
    assert nbytes_of({"first": a, "second": (None, b)}) == a.nbytes + b.nbytes
    # views keep their base alive: they count as the base, once, however many there are
    assert nbytes_of((a[1:], a.T, a.reshape(-1), a[:, 2])) == a.nbytes
    assert nbytes_of((a, a[:2])) == a.nbytes
    assert nbytes_of([a[:1]]) == a.nbytes
    assert nbytes_of((a, a.copy())) == 2 * a.nbytes


def test_nbytes_of_layer_saved_state():
    """One input feeding q, k and v is saved three times but held once."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(2, 3, 4))
    saved = [ops.linear_forward(x, rng.normal(size=(4, 4)))[1] for _ in range(3)]
    assert nbytes_of(saved) == x.nbytes
