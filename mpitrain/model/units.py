"""The units of a decoder-only transformer: embedding, block, head (the order the data flows).

Each unit has a `layout` (its tensors) and `forward(p, x, ctx) -> (y, saved)` / `backward(p, g, saved, dy) -> dx`,
where `p` and `g` are dicts of parameter and gradient views handed in by the caller. Units own no arrays, so the same
unit code runs with parameters from a flat buffer, from a ZeRO-3 all-gather or on a pipeline stage.

Two flavours, chosen by `model.arch`:
  gpt2:  learned positions, LayerNorm with bias, GELU (tanh), biases on linears, head tied to the token embedding.
  llama: RoPE, RMSNorm, SwiGLU, grouped-query attention (n_kv_head), no biases, separate head.

Tensor parallelism (Megatron style; each unit receives a `TensorParallel`, see mpitrain/layers/tensor_parallel.py): a rank
holds a block of each split weight, and the unit's `layout` says which (ParamSpec shape / global_shape / offset).

  attention   Q/K/V column-parallel by heads (rank r: query heads [r H/t, (r+1) H/t)), output projection
              row-parallel. Grouped-query K/V heads are split too when n_kv_head is a multiple of t; otherwise t is a
              multiple of n_kv_head (config rule), every rank's query heads share ONE K/V head, and the K/V weights
              are replicated on every rank, each rank computing only the head it needs; their gradients are then
              partial sums over the ranks (each back-propagates its own query heads) and are all-reduced.
  MLP         fc (gpt2) or gate and up (llama) column-parallel, proj/down row-parallel.
  biases      of column-parallel linears split with their columns; of row-parallel linears replicated, added
              once after the reduction. Norm weights replicated.
  vocabulary  the token embedding and the head's projection split by vocabulary rows, ceil(V/t) per rank (the
              overhang of the last ranks is zero padding, masked to -inf in the logits); the cross-entropy is
              computed without gathering the logits.
  sequence    with sequence parallelism the norm, residual and bias regions between the tensor-parallel regions
              hold 1/t of the sequence; learned positions add this rank's chunk; the norms' weight gradients are
              partial (each rank saw its chunk) and are all-reduced. The inputs of the column-parallel linears are
              saved gathered (the whole sequence), which keeps the traffic at 8 b s h (t-1)/t per block; Megatron
              instead saves them split and gathers them again in backward (1/t memory, one more all-gather each).
With one rank every split is the whole tensor and every collective a no-op: the same code is the serial model.

Split backward (zb1p). `backward(p, g, saved, dy, deferred)` with a list `deferred` computes the input gradient and
the cheap gradients (biases, norm gains, the embedding's rows) at once, and appends each weight-gradient matmul
dW += x^T dy as (weight name, x, dy) instead of running it; `backward_weight(g, deferred)` runs them later. The
gradient views are looked up again then (under ZeRO-2/3 a unit's full gradient is a fresh buffer after each
reduce-scatter), and x and dy stay alive until then: they are the activation memory a deferred W costs.
"""
from __future__ import annotations

import math

from mpitrain.backend import array_module
from mpitrain.config import ModelConfig
from mpitrain.layers import ops
from mpitrain.layers import tensor_parallel as tensor
from mpitrain.layers.tensor_parallel import TensorParallel, VocabShardSpec
from mpitrain.state.params import ParamSpec, UnitLayout


def _rows(x):
    return x.reshape(-1, x.shape[-1])


def _add_bias_grad(db, dy) -> None:
    if db is not None:
        db += _rows(dy).sum(axis=0)


def column_backward(tp: TensorParallel, x, weights, output_grads, weight_grads, bias_grads, deferred, names):
    """tensor.column_parallel_backward, or with a `deferred` list its input gradient alone: the bias gradients are
    added now, and each weight's x^T dy is appended to `deferred` as (names[i], x, dy) for backward_weight."""
    if deferred is None:
        return tensor.column_parallel_backward(tp, x, weights, output_grads, weight_grads, bias_grads)
    dx = _rows(output_grads[0]) @ weights[0].T
    for w, dy in zip(weights[1:], output_grads[1:]):
        dx += _rows(dy) @ w.T
    pending = tp.start_enter_backward(dx.reshape(x.shape))
    for name, dy, db in zip(names, output_grads, bias_grads or [None] * len(weights)):
        _add_bias_grad(db, dy)
        deferred.append((name, x, dy))
    return pending.wait()


def row_backward(tp: TensorParallel, x, w, dy, dw, db, deferred, name):
    """tensor.row_parallel_backward, or with a `deferred` list its input gradient and bias gradient alone."""
    if deferred is None:
        return tensor.row_parallel_backward(tp, x, w, dy, dw, db)
    dy = tp.exit_backward(dy)
    _add_bias_grad(db, dy)
    deferred.append((name, x, dy))
    return (_rows(dy) @ w.T).reshape(*dy.shape[:-1], w.shape[0])


DEFERRED_PARTIALS = ("wk", "wv")  # tp-partial gradients that are weight matmuls (replicated K/V heads): reduced in W


def run_weight_grads(deferred, grad_of) -> None:
    """The W pass: dW += x^T dy for every (name, x, dy) a split backward deferred; grad_of(name) is the view."""
    for name, x, dy in deferred:
        dw = grad_of(name)
        dw += _rows(x).T @ _rows(dy)


def _matrix(name, rows, cols, std):
    return ParamSpec(name, (rows, cols), "normal", std)


def _split(name, global_shape, axis, tp: TensorParallel, init="normal", std=0.0, per_rank=None):
    """This tp rank's block of a tensor split along `axis`: per_rank (default: an equal share) consecutive slices.
    A block that hangs over the tensor's end (vocabulary padding) is a VocabShardSpec. One rank: the whole tensor."""
    global_shape = tuple(global_shape)
    if tp.size == 1:
        return ParamSpec(name, global_shape, init, std)
    per_rank = per_rank or global_shape[axis] // tp.size
    shape, offset = list(global_shape), [0] * len(global_shape)
    shape[axis], offset[axis] = per_rank, tp.rank * per_rank
    kind = ParamSpec if per_rank * tp.size == global_shape[axis] else VocabShardSpec
    return kind(name, tuple(shape), init, std, global_shape, tuple(offset), tp_replicated=False)


class Embedding:
    """Token embedding, split over tp by vocabulary rows (plus learned positions for gpt2, replicated)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        self.cfg, self.tp = cfg, tp
        self.vocab_first, rows, _ = tensor.vocab_shard(cfg.vocab_size, tp)
        specs = [_split("wte", (cfg.vocab_size, cfg.d_model), 0, tp, "normal", cfg.init_std, per_rank=rows)]
        if cfg.arch == "gpt2":
            specs.append(_matrix("wpe", cfg.seq_len, cfg.d_model, cfg.init_std))
        self.layout = UnitLayout("embed", specs)

    def forward(self, p, tokens, ctx):
        x, ids = tensor.vocab_parallel_embedding_forward(self.tp, p["wte"], tokens, self.vocab_first)
        if "wpe" in p:  # this rank's chunk of the positions under sequence parallelism
            x += p["wpe"][ctx["positions"][self.tp.sequence_chunk(tokens.shape[1])]]
        return x, ids

    def backward(self, p, g, ids, dx, deferred=None):
        """Adds the rows' gradients (a scatter, not a matmul: done at once even in a split backward)."""
        dx = tensor.vocab_parallel_embedding_backward(self.tp, ids, dx, g["wte"])  # dx: the whole sequence now
        if "wpe" in g:
            g["wpe"][: dx.shape[1]] += dx.sum(axis=0)  # positions are 0..T-1 without context parallelism
        return

    def backward_weight(self, g, deferred) -> None:
        assert not deferred, "the embedding defers nothing"


class Block:
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: ModelConfig, index: int, tp: TensorParallel):
        self.cfg, self.tp = cfg, tp
        c, d, f, t = cfg.d_model, cfg.head_dim, cfg.ff_dim, tp.size
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layer)  # GPT-2's scaled residual init
        gpt2 = cfg.arch == "gpt2"
        self.heads = cfg.n_head // t  # query heads on this rank
        kv_split = cfg.kv_heads % t == 0
        if kv_split:
            self.kv_heads, self.kv_columns = cfg.kv_heads // t, slice(None)
        else:  # t is a multiple of n_kv_head: all of this rank's query heads use K/V head `kv`
            kv = tp.rank * cfg.kv_heads // t
            self.kv_heads, self.kv_columns = 1, slice(kv * d, (kv + 1) * d)

        def column(name, cols, init="normal"):  # a column-parallel weight, or its bias
            return _split(name, (c, cols) if init == "normal" else (cols,), -1, tp, init, std)

        def kv_tensor(name, init="normal"):
            if kv_split:
                return column(name, cfg.kv_heads * d, init)
            return ParamSpec(name, (c, cfg.kv_heads * d) if init == "normal" else (cfg.kv_heads * d,), init, std)

        specs = [column("wq", cfg.n_head * d), kv_tensor("wk"), kv_tensor("wv"),
                 _split("wo", (cfg.n_head * d, c), 0, tp, "normal", out_std)]
        if gpt2:
            specs += [column("w_fc", f), _split("w_proj", (f, c), 0, tp, "normal", out_std)]
        else:
            specs += [column("w_gate", f), column("w_up", f), _split("w_down", (f, c), 0, tp, "normal", out_std)]
        specs += [ParamSpec("norm1_w", (c,), "ones"), ParamSpec("norm2_w", (c,), "ones")]
        if gpt2:
            # No key bias: softmax is invariant to adding q.b_k to a whole row of scores, so its gradient is exactly
            # zero and it would train only on rounding noise, which Adam amplifies to full-size steps.
            specs += [ParamSpec("norm1_b", (c,), "zeros"), ParamSpec("norm2_b", (c,), "zeros"),
                      column("bq", cfg.n_head * d, "zeros"), kv_tensor("bv", "zeros"), ParamSpec("bo", (c,), "zeros"),
                      column("b_fc", f, "zeros"), ParamSpec("b_proj", (c,), "zeros")]
        self.layout = UnitLayout(f"blocks.{index}", specs)
        self.gpt2 = gpt2
        # Replicated tensors whose gradient each rank computes only part of (summed over tp in backward).
        self.partial_grads = []
        if tp.sequence_parallel:
            self.partial_grads += ["norm1_w", "norm1_b", "norm2_w", "norm2_b"]
        if not kv_split:
            self.partial_grads += ["wk", "wv", "bk", "bv"]

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

    def _kv(self, tensors, name):
        """The columns of a K/V weight or bias that this rank uses (all of its piece when K/V heads are split)."""
        return tensors[name][..., self.kv_columns] if name in tensors else None

    def forward(self, p, x, ctx):
        xp, tp = ctx["xp"], self.tp
        h1_local, norm1 = self._norm(p, x, 1)
        h1 = tp.enter(h1_local)  # the whole sequence, replicated on the tp ranks
        q = self._split_heads(ops.linear_forward(h1, p["wq"], p.get("bq"))[0], self.heads, xp)
        k = self._split_heads(ops.linear_forward(h1, self._kv(p, "wk"), self._kv(p, "bk"))[0], self.kv_heads, xp)
        v = self._split_heads(ops.linear_forward(h1, self._kv(p, "wv"), self._kv(p, "bv"))[0], self.kv_heads, xp)
        if not self.gpt2:
            q = ops.rope_forward(q, ctx["cos"], ctx["sin"])
            k = ops.rope_forward(k, ctx["cos"], ctx["sin"])
        attn, attention = ops.attention_forward(q, k, v, ctx["bias"])
        attn = self._merge_heads(attn, xp)
        x1 = x + tensor.row_parallel_forward(tp, attn, p["wo"], p.get("bo"))
        h2_local, norm2 = self._norm(p, x1, 2)
        h2 = tp.enter(h2_local)
        if self.gpt2:
            up = ops.linear_forward(h2, p["w_fc"], p["b_fc"])[0]
            act, _ = ops.gelu_forward(up)
            mlp_saved = (up,)
        else:
            gate = ops.linear_forward(h2, p["w_gate"])[0]
            up = ops.linear_forward(h2, p["w_up"])[0]
            act, _ = ops.swiglu_forward(gate, up)
            mlp_saved = (gate, up)
        y = x1 + tensor.row_parallel_forward(tp, act, p["w_proj" if self.gpt2 else "w_down"], p.get("b_proj"))
        saved = {"norm1": norm1, "h1": h1, "attention": attention, "attn": attn, "norm2": norm2, "h2": h2,
                 "mlp": mlp_saved, "act": act}
        if not self.gpt2:
            saved["rope"] = (ctx["cos"], ctx["sin"])  # shared tables, not per-micro-batch memory
        return y, saved

    def _grad(self, g, name):
        """The gradient view a weight or bias name writes into (this rank's K/V columns when they are shared)."""
        return self._kv(g, name) if name in ("wk", "wv", "bk", "bv") else g.get(name)

    def backward(self, p, g, s, dy, deferred=None):
        xp, tp = array_module(dy), self.tp
        # A split backward reduces the partial gradients it computes now; the deferred K/V weights reduce in W.
        partial = tensor.PartialGrads(tp, g, [n for n in self.partial_grads
                                              if deferred is None or n not in DEFERRED_PARTIALS])
        g = partial.grads  # the partial ones are zeroed temporaries until partial.reduce()
        # MLP branch
        w_out = "w_proj" if self.gpt2 else "w_down"
        d_act = row_backward(tp, s["act"], p[w_out], dy, g[w_out], g.get("b_proj"), deferred, w_out)
        if self.gpt2:
            d_up = ops.gelu_backward(s["mlp"][0], d_act)
            d_h2 = column_backward(tp, s["h2"], [p["w_fc"]], [d_up], [g["w_fc"]], [g["b_fc"]], deferred, ["w_fc"])
        else:
            d_gate, d_up = ops.swiglu_backward(s["mlp"], d_act)
            d_h2 = column_backward(tp, s["h2"], [p["w_gate"], p["w_up"]], [d_gate, d_up], [g["w_gate"], g["w_up"]],
                                   None, deferred, ["w_gate", "w_up"])
        dx1 = dy + self._norm_backward(p, g, s["norm2"], d_h2, 2)
        # attention branch
        d_attn = row_backward(tp, s["attn"], p["wo"], dx1, g["wo"], g.get("bo"), deferred, "wo")
        dq, dk, dv = ops.attention_backward(s["attention"], self._split_heads(d_attn, self.heads, xp))
        if not self.gpt2:
            cos, sin = s["rope"]
            dq = ops.rope_backward(dq, cos, sin)
            dk = ops.rope_backward(dk, cos, sin)
        names = ["wq", "wk", "wv"]
        d_h1 = column_backward(
            tp, s["h1"], [p["wq"], self._kv(p, "wk"), self._kv(p, "wv")],
            [self._merge_heads(dq, xp), self._merge_heads(dk, xp), self._merge_heads(dv, xp)],
            [self._grad(g, name) for name in names], [g.get("bq"), self._kv(g, "bk"), self._kv(g, "bv")],
            deferred, names)
        dx = dx1 + self._norm_backward(p, g, s["norm1"], d_h1, 1)
        partial.reduce()
        return dx

    def backward_weight(self, g, deferred) -> None:
        partial = tensor.PartialGrads(self.tp, g, [n for n in self.partial_grads if n in DEFERRED_PARTIALS])
        run_weight_grads(deferred, lambda name: self._grad(partial.grads, name))
        partial.reduce()


class Head:
    """Final norm, output projection (tied to the token embedding for gpt2) and the mean cross-entropy loss.

    The projection is split by vocabulary columns (the tied one uses this rank's rows of `wte`); the loss is the
    vocabulary-parallel cross-entropy, so the full logits never exist on one rank."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        self.cfg, self.tp = cfg, tp
        self.tied = cfg.arch == "gpt2"
        self.vocab_first, rows, self.vocab_real = tensor.vocab_shard(cfg.vocab_size, tp)
        specs = [ParamSpec("norm_w", (cfg.d_model,), "ones")]
        if self.tied:
            specs.append(ParamSpec("norm_b", (cfg.d_model,), "zeros"))
        else:
            specs.append(_split("w_lm", (cfg.d_model, cfg.vocab_size), 1, tp, "normal", cfg.init_std, per_rank=rows))
        self.layout = UnitLayout("head", specs)
        self.partial_grads = ["norm_w", "norm_b"] if tp.sequence_parallel else []

    def _norm(self, p, x):
        if self.tied:
            return ops.layernorm_forward(x, p["norm_w"], p["norm_b"], self.cfg.norm_eps)
        return ops.rmsnorm_forward(x, p["norm_w"], self.cfg.norm_eps)

    @staticmethod
    def _weight(p):
        """(d_model, vocab) view of the output projection: the transposed token embedding when tied."""
        return p["wte"].T if "wte" in p else p["w_lm"]

    def logits(self, p, x):
        """Logits over the whole vocabulary (generation): a single-rank model only."""
        if self.tp.size > 1:
            raise ValueError("generation needs the whole vocabulary on one rank: sample with a tp = 1 model "
                             "(training builds one from the gathered weights at the end)")
        h, _ = self._norm(p, x)
        return ops.linear_forward(h, self._weight(p))[0]

    def forward(self, p, x, targets):
        h_local, norm = self._norm(p, x)
        h = self.tp.enter(h_local)
        logits = tensor.mask_vocab_padding(ops.linear_forward(h, self._weight(p))[0], self.vocab_real)
        loss_sum, loss = tensor.vocab_parallel_cross_entropy_forward(self.tp, logits, targets, self.vocab_first)
        return loss_sum, {"norm": norm, "h": h, "loss": loss}

    def backward(self, p, g, s, dloss, deferred=None):
        partial = tensor.PartialGrads(self.tp, g, self.partial_grads)
        g = partial.grads
        dlogits = tensor.vocab_parallel_cross_entropy_backward(s["loss"], dloss)
        dh = column_backward(self.tp, s["h"], [self._weight(p)], [dlogits], [self._weight(g)], None, deferred,
                             ["projection"])
        if self.tied:
            dx = ops.layernorm_backward(s["norm"], p["norm_w"], dh, g["norm_w"], g["norm_b"])
        else:
            dx = ops.rmsnorm_backward(s["norm"], p["norm_w"], dh, g["norm_w"])
        partial.reduce()
        return dx

    def backward_weight(self, g, deferred) -> None:
        run_weight_grads(deferred, lambda name: self._weight(g))  # the one deferred weight: the projection
