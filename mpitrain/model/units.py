"""The units of a decoder-only transformer: embedding, block, head (the order the data flows).

Each unit has a `layout` (its tensors) and `forward(p, x, ctx) -> (y, saved)` / `backward(p, g, saved, dy) -> dx`,
where `p` and `g` are dicts of parameter and gradient views handed in by the caller. Units own no arrays, so the same
unit code runs with parameters from a flat buffer, from a ZeRO-3 all-gather or on a pipeline stage.

Two flavours, chosen by `model.arch`:
  gpt2:  learned positions, LayerNorm with bias, GELU (tanh), biases on linears, head tied to the token embedding.
  llama: RoPE, RMSNorm, SwiGLU, grouped-query attention (n_kv_head), no biases, separate head.
"""
from __future__ import annotations

import math

from mpitrain.backend import array_module
from mpitrain.config import ModelConfig
from mpitrain.model import ops
from mpitrain.model.params import ParamSpec, UnitLayout


def _matrix(name, rows, cols, std):
    return ParamSpec(name, (rows, cols), "normal", std)


class Embedding:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        specs = [_matrix("wte", cfg.vocab_size, cfg.d_model, cfg.init_std)]
        if cfg.arch == "gpt2":
            specs.append(_matrix("wpe", cfg.seq_len, cfg.d_model, cfg.init_std))
        self.layout = UnitLayout("embed", specs)

    def forward(self, p, tokens, ctx):
        x, ids = ops.embedding_forward(p["wte"], tokens)
        if "wpe" in p:
            x += p["wpe"][ctx["positions"]]
        return x, ids

    def backward(self, p, g, ids, dx):
        ops.embedding_backward(ids, dx, g["wte"])
        if "wpe" in g:
            g["wpe"][: dx.shape[1]] += dx.sum(axis=0)  # positions are 0..T-1 without context parallelism
        return None


class Block:
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: ModelConfig, index: int):
        self.cfg = cfg
        c, d, f = cfg.d_model, cfg.head_dim, cfg.ff_dim
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layer)  # GPT-2's scaled residual init
        gpt2 = cfg.arch == "gpt2"
        specs = [_matrix("wq", c, cfg.n_head * d, std), _matrix("wk", c, cfg.kv_heads * d, std),
                 _matrix("wv", c, cfg.kv_heads * d, std), _matrix("wo", cfg.n_head * d, c, out_std)]
        if gpt2:
            specs += [_matrix("w_fc", c, f, std), _matrix("w_proj", f, c, out_std)]
        else:
            specs += [_matrix("w_gate", c, f, std), _matrix("w_up", c, f, std), _matrix("w_down", f, c, out_std)]
        specs += [ParamSpec("norm1_w", (c,), "ones"), ParamSpec("norm2_w", (c,), "ones")]
        if gpt2:
            # No key bias: softmax is invariant to adding q.b_k to a whole row of scores, so its gradient is exactly
            # zero and it would train only on rounding noise, which Adam amplifies to full-size steps.
            specs += [ParamSpec(n, (s,), "zeros") for n, s in
                      [("norm1_b", c), ("norm2_b", c), ("bq", cfg.n_head * d), ("bv", cfg.kv_heads * d),
                       ("bo", c), ("b_fc", f), ("b_proj", c)]]
        self.layout = UnitLayout(f"blocks.{index}", specs)
        self.gpt2 = gpt2

    # -- helpers shared by forward and backward
    def _norm(self, p, x, which):
        if self.gpt2:
            return ops.layernorm_forward(x, p[f"norm{which}_w"], p[f"norm{which}_b"], self.cfg.norm_eps)
        return ops.rmsnorm_forward(x, p[f"norm{which}_w"], self.cfg.norm_eps)

    def _norm_backward(self, p, g, saved, dy, which):
        if self.gpt2:
            return ops.layernorm_backward(saved, p[f"norm{which}_w"], dy, g[f"norm{which}_w"], g[f"norm{which}_b"])
        return ops.rmsnorm_backward(saved, p[f"norm{which}_w"], dy, g[f"norm{which}_w"])

    @staticmethod
    def _split_heads(x, n_heads, xp):
        b, t, _ = x.shape
        return xp.ascontiguousarray(x.reshape(b, t, n_heads, -1).transpose(0, 2, 1, 3))

    @staticmethod
    def _merge_heads(x, xp):
        b, h, t, d = x.shape
        return xp.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(b, t, h * d)

    def forward(self, p, x, ctx):
        xp, cfg = ctx["xp"], self.cfg
        h1, norm1 = self._norm(p, x, 1)
        q = self._split_heads(ops.linear_forward(h1, p["wq"], p.get("bq"))[0], cfg.n_head, xp)
        k = self._split_heads(ops.linear_forward(h1, p["wk"], p.get("bk"))[0], cfg.kv_heads, xp)
        v = self._split_heads(ops.linear_forward(h1, p["wv"], p.get("bv"))[0], cfg.kv_heads, xp)
        if not self.gpt2:
            q = ops.rope_forward(q, ctx["cos"], ctx["sin"])
            k = ops.rope_forward(k, ctx["cos"], ctx["sin"])
        attn, attention = ops.attention_forward(q, k, v, ctx["bias"])
        attn = self._merge_heads(attn, xp)
        x1 = x + ops.linear_forward(attn, p["wo"], p.get("bo"))[0]
        h2, norm2 = self._norm(p, x1, 2)
        if self.gpt2:
            up = ops.linear_forward(h2, p["w_fc"], p["b_fc"])[0]
            act, _ = ops.gelu_forward(up)
            mlp_saved = (up,)
        else:
            gate = ops.linear_forward(h2, p["w_gate"])[0]
            up = ops.linear_forward(h2, p["w_up"])[0]
            act, _ = ops.swiglu_forward(gate, up)
            mlp_saved = (gate, up)
        y = x1 + ops.linear_forward(act, p["w_proj" if self.gpt2 else "w_down"], p.get("b_proj"))[0]
        saved = {"norm1": norm1, "h1": h1, "attention": attention, "attn": attn, "norm2": norm2, "h2": h2,
                 "mlp": mlp_saved, "act": act}
        if not self.gpt2:
            saved["rope"] = (ctx["cos"], ctx["sin"])  # shared tables, not per-micro-batch memory
        return y, saved

    def backward(self, p, g, s, dy):
        xp, cfg = array_module(dy), self.cfg
        # MLP branch
        w_out = "w_proj" if self.gpt2 else "w_down"
        d_act = ops.linear_backward(s["act"], p[w_out], dy, g[w_out], g.get("b_proj"))
        if self.gpt2:
            d_up = ops.gelu_backward(s["mlp"][0], d_act)
            d_h2 = ops.linear_backward(s["h2"], p["w_fc"], d_up, g["w_fc"], g["b_fc"])
        else:
            d_gate, d_up = ops.swiglu_backward(s["mlp"], d_act)
            d_h2 = ops.linear_backward(s["h2"], p["w_gate"], d_gate, g["w_gate"])
            d_h2 += ops.linear_backward(s["h2"], p["w_up"], d_up, g["w_up"])
        dx1 = dy + self._norm_backward(p, g, s["norm2"], d_h2, 2)
        # attention branch
        d_attn = ops.linear_backward(s["attn"], p["wo"], dx1, g["wo"], g.get("bo"))
        dq, dk, dv = ops.attention_backward(s["attention"], self._split_heads(d_attn, cfg.n_head, xp))
        if not self.gpt2:
            cos, sin = s["rope"]
            dq = ops.rope_backward(dq, cos, sin)
            dk = ops.rope_backward(dk, cos, sin)
        h1 = s["h1"]
        d_h1 = ops.linear_backward(h1, p["wq"], self._merge_heads(dq, xp), g["wq"], g.get("bq"))
        d_h1 += ops.linear_backward(h1, p["wk"], self._merge_heads(dk, xp), g["wk"], g.get("bk"))
        d_h1 += ops.linear_backward(h1, p["wv"], self._merge_heads(dv, xp), g["wv"], g.get("bv"))
        return dx1 + self._norm_backward(p, g, s["norm1"], d_h1, 1)


class Head:
    """Final norm, output projection (tied to the token embedding for gpt2) and the mean cross-entropy loss."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.tied = cfg.arch == "gpt2"
        specs = [ParamSpec("norm_w", (cfg.d_model,), "ones")]
        if self.tied:
            specs.append(ParamSpec("norm_b", (cfg.d_model,), "zeros"))
        else:
            specs.append(_matrix("w_lm", cfg.d_model, cfg.vocab_size, cfg.init_std))
        self.layout = UnitLayout("head", specs)

    def _norm(self, p, x):
        if self.tied:
            return ops.layernorm_forward(x, p["norm_w"], p["norm_b"], self.cfg.norm_eps)
        return ops.rmsnorm_forward(x, p["norm_w"], self.cfg.norm_eps)

    @staticmethod
    def _weight(p):
        """(d_model, vocab) view of the output projection: the transposed token embedding when tied."""
        return p["wte"].T if "wte" in p else p["w_lm"]

    def logits(self, p, x):
        h, _ = self._norm(p, x)
        return ops.linear_forward(h, self._weight(p))[0]

    def forward(self, p, x, targets):
        h, norm = self._norm(p, x)
        logits = ops.linear_forward(h, self._weight(p))[0]
        loss_sum, loss = ops.cross_entropy_forward(logits, targets)
        return loss_sum, {"norm": norm, "h": h, "loss": loss}

    def backward(self, p, g, s, dloss):
        dlogits = ops.cross_entropy_backward(s["loss"], dloss)
        dh = ops.linear_backward(s["h"], self._weight(p), dlogits, self._weight(g))
        if self.tied:
            return ops.layernorm_backward(s["norm"], p["norm_w"], dh, g["norm_w"], g["norm_b"])
        return ops.rmsnorm_backward(s["norm"], p["norm_w"], dh, g["norm_w"])
