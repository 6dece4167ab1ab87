"""The units of a decoder-only transformer, composed of the sublayers of mpitrain/layers: embedding, block, head.

A unit is what the parameter state stores as one piece: it has a `layout` (its tensors, global name "embed",
"blocks.3", "head") and the pair

    forward(params, x, ctx) -> (y, saved)        backward(params, grads, saved, dy, deferred) -> dx

where `params` and `grads` are dicts of parameter and gradient views handed in by the caller. Units own no arrays,
so the same unit code runs with parameters from a flat buffer, from a ZeRO-3 all-gather or on a pipeline stage.

Two flavours, chosen by `model.arch`:
  gpt2:  learned positions, LayerNorm with bias, GELU (tanh), biases on linears, head tied to the token embedding.
  llama: RoPE, RMSNorm, SwiGLU, grouped-query attention (n_kv_head), no biases, separate head.

Tensor and sequence parallelism live in the sublayers and their linears (mpitrain/layers/linear.py); a unit only
all-reduces, once, the gradients of replicated tensors that each rank computes part of (`partial_grads`: norm gains
under sequence parallelism, replicated K/V weights). With one rank every split is the whole tensor and every
collective a no-op: the same code is the serial model.

Split backward (zb1p): `backward(..., deferred=work)` computes the input gradient and the cheap gradients at once
and leaves each weight-gradient matmul in `work` as (name, x, dy); `backward_weight(grads, work)` runs them later, with
the gradient views looked up again then. x and dy stay alive until then: the activation memory a deferred W costs.

Saved activations are declared once per sublayer (`saved_arrays(batch, seq_len, dtype)`: the shapes and dtypes of
what its forward saves); `saved_arrays` of a unit sums them, and `mpitrain memory` counts with it.
"""
from __future__ import annotations

from mpitrain.config import ModelConfig
from mpitrain.layers import recompute
from mpitrain.layers.attention import Attention
from mpitrain.layers.embedding import TokenEmbedding
from mpitrain.layers.head import LMHead
from mpitrain.layers.linear import run_weight_grads
from mpitrain.layers.lora import SUFFIXES as LORA_SUFFIXES
from mpitrain.layers.moe import make_mlp
from mpitrain.layers.norm import Norm
from mpitrain.layers.tensor_parallel import PartialGrads, TensorParallel
from mpitrain.state.params import UnitLayout

DEFERRED_PARTIALS = ("wk", "wv")  # tp-partial gradients that are weight matmuls (replicated K/V heads): reduced in W


def deferred_partial(name: str) -> bool:
    """A tp-partial gradient a split backward computes in W: replicated K/V weights' and LoRA adapters'."""
    return name in DEFERRED_PARTIALS or name.endswith(LORA_SUFFIXES)


class Unit:
    """What every unit shares: a layout from its sublayers' tensors, their saved arrays, one partial-gradient
    all-reduce per backward (B) and per W pass."""

    def __init__(self, name: str, tp: TensorParallel, sublayers: list):
        self.tp, self.sublayers = tp, sublayers
        self.layout = UnitLayout(name, [spec for layer in sublayers for spec in layer.specs])
        self.partial_grads = [name for layer in sublayers for name in layer.partial_grads]
        self.borrows: dict[str, str] = {}  # local name -> global name of a tensor of another unit it reads
        self.frozen = False  # every tensor frozen, adapters aside (LoRA: mpitrain/layers/lora.py)

    def saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        return [array for layer in self.sublayers for array in layer.saved_arrays(batch, seq_len, dtype)]

    def partial(self, grads, deferred) -> PartialGrads:
        """The partial gradients reduced in B: all of them, or in a split backward all but the deferred matmuls'."""
        names = [n for n in self.partial_grads if deferred is None or not deferred_partial(n)]
        return PartialGrads(self.tp, grads, names)

    def weight_views(self, grads) -> dict:
        """The gradient views the deferred work items name."""
        return grads

    def backward_weight(self, grads, deferred) -> None:
        partial = PartialGrads(self.tp, grads, [n for n in self.partial_grads if deferred_partial(n)])
        run_weight_grads(deferred, self.weight_views(partial.grads))
        partial.reduce()


class Embedding(Unit):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        self.embedding = TokenEmbedding(cfg, tp)
        super().__init__("embed", tp, [self.embedding])

    def forward(self, params, tokens, ctx):
        return self.embedding.forward(params, tokens, ctx)

    def backward(self, params, grads, ids, dx, deferred=None) -> None:
        if not self.frozen:  # frozen: the table's gradient is not even scattered
            self.embedding.backward(params, grads, ids, dx)


class Block(Unit):
    """Pre-norm transformer block: x + attention(norm1(x)), then + mlp(norm2(.))."""

    def __init__(self, cfg: ModelConfig, index: int, tp: TensorParallel, ep=None):
        """ep: the ExpertParallel of MoE blocks (mpitrain/layers/moe.py picks MoE or the dense MLP)."""
        kind = "layernorm" if cfg.arch == "gpt2" else "rmsnorm"
        self.norm1, self.attention = Norm(kind, "norm1", cfg.d_model, cfg.norm_eps, tp), Attention(cfg, tp)
        self.norm2, self.mlp = Norm(kind, "norm2", cfg.d_model, cfg.norm_eps, tp), make_mlp(cfg, index, tp, ep)
        super().__init__(f"blocks.{index}", tp, [self.norm1, self.attention, self.norm2, self.mlp])
        self.recompute = "none"  # none | selective | full: mpitrain/layers/recompute.py

    def forward(self, params, x, ctx):
        if self.recompute != "none":
            return recompute.forward(self, params, x, ctx)
        return self.forward_all(params, x, ctx)

    def forward_all(self, params, x, ctx):
        """The forward that saves everything its backward reads."""
        h1, norm1 = self.norm1.forward(params, x)
        attention, attention_saved = self.attention.forward(params, h1, ctx)
        x1 = x + attention
        h2, norm2 = self.norm2.forward(params, x1)
        mlp, mlp_saved = self.mlp.forward(params, h2, ctx)
        return x1 + mlp, {"norm1": norm1, "attention": attention_saved, "norm2": norm2, "mlp": mlp_saved}

    def decode(self, params, x, ctx, cache):
        """Generation: the new positions against `cache` (this block's keys and values), nothing saved."""
        x1 = x + self.attention.decode(params, self.norm1.forward(params, x)[0], ctx, cache)
        return x1 + self.mlp.forward(params, self.norm2.forward(params, x1)[0], ctx)[0]

    def backward(self, params, grads, saved, dy, deferred=None):
        if self.recompute != "none":
            saved = recompute.restore(self, params, saved)
        partial = self.partial(grads, deferred)
        grads = partial.grads  # the partial ones are zeroed temporaries until partial.reduce()
        d_h2 = self.mlp.backward(params, grads, saved["mlp"], dy, deferred)
        dx1 = self.norm2.backward(params, grads, saved["norm2"], d_h2, residual=dy)
        d_h1 = self.attention.backward(params, grads, saved["attention"], dx1, deferred)
        dx = self.norm1.backward(params, grads, saved["norm1"], d_h1, residual=dx1)
        partial.reduce()
        return dx

    def saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        if self.recompute != "none":
            return recompute.saved_arrays(self, batch, seq_len, dtype)
        return super().saved_arrays(batch, seq_len, dtype)

    def weight_views(self, grads) -> dict:
        return self.attention.local(grads)


class Head(Unit):
    """Final norm, output projection (tied to the token embedding for gpt2) and the summed cross-entropy."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        self.head = LMHead(cfg, tp)
        super().__init__("head", tp, [self.head])
        self.tied, self.borrows = self.head.tied, dict(self.head.borrows)

    def logits(self, params, x):
        return self.head.logits(params, x)

    def forward(self, params, x, ctx):
        return self.head.forward(params, x, ctx)

    def backward(self, params, grads, saved, dloss, deferred=None):
        partial = self.partial(grads, deferred)
        dx = self.head.backward(params, partial.grads, saved, dloss, deferred)
        partial.reduce()
        return dx

    def weight_views(self, grads) -> dict:
        return self.head.local(grads)
