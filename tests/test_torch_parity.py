"""The hand-written model against PyTorch autograd: same weights, same batch, same loss and gradients (float64)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is the gradient reference: pip install -e '.[test]'")

from mpitrain.backend import make_backend  # noqa: E402
from mpitrain.config import Config, ModelConfig, validate  # noqa: E402
from mpitrain.model.gpt import GPT  # noqa: E402
from mpitrain.state.replicated import ReplicatedState  # noqa: E402

try:
    import torch_reference as ref
except ImportError:  # tests/ imported as a package
    from tests import torch_reference as ref

LOSS_RTOL = 1e-10
GRAD_RTOL = 1e-10
BATCH = 3
TINY = {"n_layer": 2, "d_model": 32, "n_head": 4, "vocab_size": 61, "seq_len": 12}
CONFIGS = {
    "gpt2": ModelConfig(arch="gpt2", **TINY),
    "llama-gqa": ModelConfig(arch="llama", n_kv_head=2, **TINY),
    "llama-mqa": ModelConfig(arch="llama", n_kv_head=1, **TINY),
    "llama-mha": ModelConfig(arch="llama", **TINY),
}


class SingleProcessModel:
    """The model with its parameters in one process (the state every parallel layout is compared against)."""

    def __init__(self, cfg: ModelConfig, seed: int):
        backend = make_backend("cpu", "float64")
        self.cfg, self.gpt = cfg, GPT(cfg, backend)
        self.state = ReplicatedState(self.gpt.layouts, backend, seed)
        self.params, self.grads = self.state.params, self.state.grads

    def forward(self, tokens, targets):
        return self.gpt.forward(self.state, tokens, targets)

    def backward(self, saved, dloss):
        self.gpt.backward(self.state, saved, dloss)

    def last_logits(self, tokens):
        return self.gpt.last_logits(self.state, tokens)


def tiny_model(name: str, seed: int = 0) -> SingleProcessModel:
    cfg = CONFIGS[name]
    validate(Config(model=cfg))
    model = SingleProcessModel(cfg, seed=seed)
    # Move every tensor off its initial value (norm gains 1, biases 0) so that each one matters to the loss.
    rng = np.random.default_rng(seed + 100)
    for _, view in model.params.named_views():
        view += 0.1 * rng.normal(size=view.shape)
    return model


def batch(cfg: ModelConfig, t: int, seed: int = 1, exclude=()):
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(cfg.vocab_size), exclude)
    tokens = rng.choice(allowed, size=(BATCH, t))
    targets = rng.integers(0, cfg.vocab_size, size=(BATCH, t))
    return tokens, targets


def weights_of(model: SingleProcessModel) -> dict[str, np.ndarray]:
    return {name: view.copy() for name, view in model.params.named_views()}


def rel_err(expected, actual) -> float:
    expected, actual = np.asarray(expected, dtype=np.float64), np.asarray(actual, dtype=np.float64)
    assert expected.shape == actual.shape
    scale = max(np.linalg.norm(expected), np.linalg.norm(actual))
    return 0.0 if scale == 0 else float(np.linalg.norm(expected - actual) / scale)


def model_loss_and_grads(model: SingleProcessModel, micro_batches):
    """Mean loss over all tokens of the micro-batches, gradients accumulated into model.grads."""
    tokens_total = sum(tokens.size for tokens, _ in micro_batches)
    model.grads.data[...] = 0.0
    loss_sum = 0.0
    for tokens, targets in micro_batches:
        part, saved = model.forward(tokens, targets)
        model.backward(saved, 1.0 / tokens_total)
        loss_sum += float(part)
    return loss_sum / tokens_total, {name: view.copy() for name, view in model.grads.named_views()}


def assert_parity(cfg, weights, loss, grads, tokens, targets):
    ref_loss, ref_grads = ref.loss_and_grads(cfg, weights, tokens, targets)
    assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    errors = {name: rel_err(ref_grads[name], grads[name]) for name in grads}
    bad = {name: err for name, err in errors.items() if not err < GRAD_RTOL}
    assert not bad, f"gradients differ from torch autograd (relative error per tensor): {bad}"
    zero = [name for name, g in ref_grads.items() if not np.any(g)]
    assert not zero, f"tensors with an all-zero gradient do not test anything: {zero}"


@pytest.mark.parametrize("name,t", [("gpt2", 12), ("gpt2", 7), ("llama-gqa", 12), ("llama-gqa", 7),
                                    ("llama-mqa", 12), ("llama-mha", 12)])
def test_loss_and_every_gradient_match_torch(name, t):
    model = tiny_model(name)
    tokens, targets = batch(model.cfg, t)
    loss, grads = model_loss_and_grads(model, [(tokens, targets)])
    if t < model.cfg.seq_len and "embed.wpe" in grads:  # positions past the sequence get no gradient
        assert not np.any(grads["embed.wpe"][t:])
    assert_parity(model.cfg, weights_of(model), loss, grads, tokens, targets)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(name):
    model = tiny_model(name)
    tokens, targets = batch(model.cfg, 12, seed=2)
    loss, grads = model_loss_and_grads(model, [(tokens[:1], targets[:1]), (tokens[1:], targets[1:])])
    assert_parity(model.cfg, weights_of(model), loss, grads, tokens, targets)


def test_model_does_not_change_its_parameters():
    model = tiny_model("gpt2")
    before = model.params.data.copy()
    model_loss_and_grads(model, [batch(model.cfg, 12)])
    np.testing.assert_array_equal(model.params.data, before)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_logits_match_torch(name):
    model = tiny_model(name)
    tokens, _ = batch(model.cfg, 12)
    expected = ref.logits(model.cfg, ref.to_torch(weights_of(model)), tokens).detach().numpy()[:, -1]
    assert rel_err(expected, model.last_logits(tokens)) < 1e-12


@pytest.mark.parametrize("name,tied", [("gpt2", True), ("llama-gqa", False)])
def test_gpt2_head_is_tied_to_the_token_embedding(name, tied):
    """Token j never appears in the input, so row j of embed.wte reaches the logits only through a tied head."""
    model = tiny_model(name)
    j = 17
    tokens, targets = batch(model.cfg, 12, exclude=[j])
    names = dict(model.params.named_views())
    assert ("head.w_lm" not in names) == tied
    before = model.last_logits(tokens).copy()
    names["embed.wte"][j] += 0.5
    after = model.last_logits(tokens)
    others = np.arange(model.cfg.vocab_size) != j
    np.testing.assert_allclose(after[:, others], before[:, others], rtol=1e-13, atol=1e-15)
    assert np.all(np.abs(after[:, j] - before[:, j]) > 1e-6) == tied
    _, grads = model_loss_and_grads(model, [(tokens, targets)])
    assert bool(np.any(grads["embed.wte"][j])) == tied  # the head's gradient flows into the embedding table


# ----------------------------------------------------------------------------- the reference itself
def test_reference_pieces_match_torch_builtins():
    """The plain-math reference agrees with torch's own layers, so a parity failure points at mpitrain."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    w, b = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    torch.testing.assert_close(ref.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (8,), w, b, 1e-5))
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-5), F.rms_norm(x, (8,), w, 1e-5))
    torch.testing.assert_close(ref.gelu_tanh(x), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(ref.silu(x), F.silu(x))
    q = torch.randn(2, 4, 5, 6, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 5, 6, generator=g, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(ref.causal_attention(q, k, v),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    # RoPE, rotate-half form == complex rotation of the pairs (x[i], x[i + D/2}) by position * theta^(-2i/D)
    y = ref.rope(q, 500.0)
    angles = torch.arange(5, dtype=torch.float64)[:, None] * 500.0 ** (-torch.arange(0, 6, 2, dtype=torch.float64) / 6)
    z = torch.complex(q[..., :3], q[..., 3:]) * torch.polar(torch.ones_like(angles), angles)
    torch.testing.assert_close(y, torch.cat([z.real, z.imag], dim=-1))


def test_reference_refuses_unused_weights():
    model = tiny_model("llama-gqa")
    weights = weights_of(model)
    weights["blocks.0.bq"] = np.zeros(32)  # llama has no biases: a reference that ignores it must say so
    with pytest.raises(AssertionError, match="not used"):
        ref.logits(model.cfg, ref.to_torch(weights), batch(model.cfg, 4)[0])
