"""An independent PyTorch (autograd) implementation of mpitrain's two model flavours, the gradient reference.

Written plainly from the math, sharing no code with mpitrain.model: weights come in as a dict of numpy arrays keyed
like `GPT.params.named_views()` ("embed.wte", "blocks.0.wq", "head.norm_w", ...), linear weights stored
(in_features, out_features) so y = x @ W + b.

  gpt2:  x = wte[tokens] + wpe[0..T-1]; pre-norm blocks with LayerNorm (biased, eps = cfg.norm_eps), causal softmax
         attention with scale 1/sqrt(head_dim), GELU (tanh) MLP, biases on q, v, o, fc, proj (and on k only if given:
         mpitrain drops it, softmax being blind to it); final LayerNorm; logits = h @ wte^T.
  llama: x = wte[tokens]; RMSNorm, RoPE ("rotate half", theta = cfg.rope_theta) on q and k, grouped-query attention
         (query head h reads key/value head h // (n_head / n_kv_head)), SwiGLU MLP (silu(h W_gate) * (h W_up)) W_down,
         no biases; final RMSNorm; logits = h @ w_lm with w_lm stored (d_model, vocab).
"""
from __future__ import annotations

import math

import numpy as np
import torch


def to_torch(weights: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """float64 leaf tensors with requires_grad, one per named weight (copies: the numpy arrays stay untouched)."""
    return {name: torch.tensor(np.array(w, dtype=np.float64), dtype=torch.float64, requires_grad=True)
            for name, w in weights.items()}


class _Weights:
    """Dict access that records which weights were used, so a reference that forgets one fails loudly."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors, self.used = tensors, set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"the reference needs weight {name!r}; given: {sorted(self.tensors)}")
        self.used.add(name)
        return self.tensors[name]


# ----------------------------------------------------------------------------- pieces
def layer_norm(x, w, b, eps):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # biased variance, like torch.nn.LayerNorm
    return (x - mean) / torch.sqrt(var + eps) * w + b


def rms_norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x):
    return x * torch.sigmoid(x)


def rope(x, theta):
    """Rotate-half RoPE (HF Llama) on x: (B, H, T, D), positions 0..T-1."""
    t, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # (D/2,)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (T, D/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(D), causal) v; q: (B, H, T, D), k/v: (B, Hkv, T, D) repeated to H heads."""
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)  # heads [kv0, kv0, kv1, kv1, ...]: query head h -> kv head h // n_rep
    v = v.repeat_interleave(n_rep, dim=1)
    t, d = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def split_heads(x, n):
    b, t, c = x.shape
    return x.reshape(b, t, n, c // n).transpose(1, 2)


def merge_heads(x):
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


# ----------------------------------------------------------------------------- the model
def logits(cfg, tensors: dict[str, torch.Tensor], tokens) -> torch.Tensor:
    """(B, T, vocab) logits of `tokens` (B, T) under weights `tensors` (see `to_torch`)."""
    w = _Weights(tensors)
    out = _logits(cfg, w, torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    unused = set(tensors) - w.used
    if unused:
        raise AssertionError(f"weights not used by the {cfg.arch} reference: {sorted(unused)}")
    return out


def _logits(cfg, w: _Weights, tokens):
    gpt2 = cfg.arch == "gpt2"
    n_kv = cfg.n_kv_head or cfg.n_head
    t = tokens.shape[1]

    def norm(x, prefix):
        if gpt2:
            return layer_norm(x, w[prefix + "_w"], w[prefix + "_b"], cfg.norm_eps)
        return rms_norm(x, w[prefix + "_w"], cfg.norm_eps)

    def linear(x, name, bias=None):
        y = x @ w[name]
        return y + w[bias] if gpt2 and bias else y

    x = w["embed.wte"][tokens]
    if gpt2:
        x = x + w["embed.wpe"][:t]
    for layer in range(cfg.n_layer):
        p = f"blocks.{layer}."
        h = norm(x, p + "norm1")
        q = split_heads(linear(h, p + "wq", p + "bq"), cfg.n_head)
        # gpt2 has no key bias (adding q.b_k to a whole row of scores leaves softmax unchanged, so its gradient is
        # exactly zero); one is applied only if the weights have it.
        k = split_heads(linear(h, p + "wk", p + "bk" if p + "bk" in w.tensors else None), n_kv)
        v = split_heads(linear(h, p + "wv", p + "bv"), n_kv)
        if not gpt2:
            q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
        x = x + linear(merge_heads(causal_attention(q, k, v)), p + "wo", p + "bo")
        h = norm(x, p + "norm2")
        if gpt2:
            mlp = linear(gelu_tanh(linear(h, p + "w_fc", p + "b_fc")), p + "w_proj", p + "b_proj")
        else:
            mlp = linear(silu(linear(h, p + "w_gate")) * linear(h, p + "w_up"), p + "w_down")
        x = x + mlp
    h = norm(x, "head.norm")
    return h @ (w["embed.wte"].T if gpt2 else w["head.w_lm"])


def mean_loss(cfg, tensors: dict[str, torch.Tensor], tokens, targets) -> torch.Tensor:
    """Mean over all tokens of -log softmax(logits)[target]."""
    out = logits(cfg, tensors, tokens)
    logp = torch.log_softmax(out, dim=-1)
    targets = torch.as_tensor(np.asarray(targets), dtype=torch.long)
    return -logp.gather(-1, targets[..., None]).mean()


def loss_and_grads(cfg, weights: dict[str, np.ndarray], tokens, targets) -> tuple[float, dict[str, np.ndarray]]:
    """Mean loss and the gradient of it w.r.t. every weight, as numpy float64."""
    tensors = to_torch(weights)
    loss = mean_loss(cfg, tensors, tokens, targets)
    loss.backward()
    grads = {}
    for name, tensor in tensors.items():
        grads[name] = np.zeros(tensor.shape) if tensor.grad is None else tensor.grad.detach().numpy().copy()
    return float(loss.detach()), grads
