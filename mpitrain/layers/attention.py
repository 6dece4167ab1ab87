"""Causal self-attention as a sublayer, on the normalised input: Q/K/V column-parallel by heads, RoPE (llama),
the attention core, the output projection row-parallel.

Tensor parallelism: rank r holds query heads [r H/t, (r+1) H/t). Grouped-query K/V heads are split too when n_kv_head
is a multiple of t; otherwise t is a multiple of n_kv_head (config rule), every rank's query heads share ONE K/V
head, and the K/V weights are replicated on every rank, each rank computing only the head it needs (a column slice
of the weights); their gradients are then partial sums over the ranks (each back-propagates its own query heads),
named in `partial_grads` for the unit to all-reduce.

The core (ops.attention_forward) takes a block of queries against a block of keys with the causal mask of their
positions and returns each query row's log-sum-exp with the output. Under context parallelism (`ring` set by
mpitrain/parallel/context.apply_context_parallel) the core is ring attention instead (layers/ring_attention.py): it
runs on this rank's two zig-zag chunks, K/V blocks travel around the cp ring, partial outputs merge by log-sum-exp.
With parallel.cp_kind = "ulysses" (`ulysses` set instead) it is layers/ulysses_attention.py: an all-to-all trades
heads for tokens, the core above runs on whole sequences of H/c heads, a second all-to-all trades them back; with
"hybrid" (`hybrid`) layers/hybrid_attention.py: that all-to-all inside a node, the ring across nodes.

Packed documents (data.document_mask, mpitrain/data/documents.py): the model's per-micro-batch context carries a
(B, T, T) mask that also hides other documents (`ctx["bias"]`), rotary tables of each token's position in its
document, one per batch row ((B, T, D/2): `rotate`), and for the ring the whole row's document ids and positions
(`ctx["documents"]`).
"""
from __future__ import annotations

import math

from mpitrain.backend import array_module
from mpitrain.config import ModelConfig
from mpitrain.layers import hybrid_attention, ops, ring_attention, ulysses_attention
from mpitrain.layers.linear import ColumnParallelLinear, RowParallelLinear
from mpitrain.layers.tensor_parallel import TensorParallel, split_spec
from mpitrain.state.params import ParamSpec

KV_TENSORS = ("wk", "wv", "bv")


def split_heads(x, n_heads: int):
    """(B, T, n_heads * D) -> contiguous (B, n_heads, T, D)."""
    b, t, _ = x.shape
    return array_module(x).ascontiguousarray(x.reshape(b, t, n_heads, -1).transpose(0, 2, 1, 3))


def head_view(x, n_heads: int):
    """(B, T, n_heads * D) -> a (B, n_heads, T, D) view, no copy: the numpy attention core takes strided heads (its
    products read rows with a stride) and writes its results in this layout, so merge_heads copies nothing either."""
    if array_module(x).__name__ != "numpy":
        return split_heads(x, n_heads)  # CuPy's batched products want contiguous heads
    b, t, _ = x.shape
    return x.reshape(b, t, n_heads, -1).transpose(0, 2, 1, 3)


def rotate(rope_op, x, cos, sin):
    """rope_op (ops.rope_forward or rope_backward) of x (B, H, T, D) with the model's (T, D/2) tables, or with one
    table per batch row, (B, T, D/2) (positions inside packed documents): the rows then lie end to end along time,
    x as (H, B*T, D) against one (B*T, D/2) table, the layout the op (and its GPU kernel) indexes."""
    if cos.ndim == 2:
        return rope_op(x, cos, sin)
    b, h, t, d = x.shape
    rows = x.swapaxes(0, 1).reshape(h, b * t, d)
    y = rope_op(rows, cos.reshape(b * t, -1), sin.reshape(b * t, -1))
    return y.reshape(h, b, t, d).swapaxes(0, 1)


def merge_heads(x):
    """(B, H, T, D) -> (B, T, H * D); a view when x is a head_view-like layout (the attention core's outputs, also
    its dq/dk/dv, which sit side by side in one buffer for the QKV linear's one product), else a copy."""
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)


class Attention:
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        c, d, t = cfg.d_model, cfg.head_dim, tp.size
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layer)  # GPT-2's scaled residual init
        self.heads, self.head_dim, self.rope = cfg.n_head // t, d, cfg.arch == "llama"
        biases = cfg.arch == "gpt2"
        kv_split = cfg.kv_heads % t == 0
        if kv_split:
            self.kv_heads, self.kv_columns = cfg.kv_heads // t, None
        else:  # all of this rank's query heads use K/V head `kv`
            kv = tp.rank * cfg.kv_heads // t
            self.kv_heads, self.kv_columns = 1, slice(kv * d, (kv + 1) * d)

        def column(name, cols, init="normal"):  # a column-parallel weight, or its bias
            return split_spec(name, (c, cols) if init == "normal" else (cols,), -1, tp, init, std)

        def kv_tensor(name, init="normal"):
            if kv_split:
                return column(name, cfg.kv_heads * d, init)
            shape = (c, cfg.kv_heads * d) if init == "normal" else (cfg.kv_heads * d,)
            return ParamSpec(name, shape, init, std)

        self.specs = [column("wq", cfg.n_head * d), kv_tensor("wk"), kv_tensor("wv"),
                      split_spec("wo", (cfg.n_head * d, c), 0, tp, "normal", out_std)]
        if biases:
            # No key bias: softmax is invariant to adding q.b_k to a whole row of scores, so its gradient is exactly
            # zero and it would train only on rounding noise, which Adam amplifies to full-size steps.
            self.specs += [column("bq", cfg.n_head * d, "zeros"), kv_tensor("bv", "zeros"),
                           ParamSpec("bo", (c,), "zeros")]
        self.qkv = ColumnParallelLinear(tp, c, ["wq", "wk", "wv"], ["bq", None, "bv"] if biases else None)
        self.out = RowParallelLinear(tp, self.heads * d, "wo", "bo" if biases else None)
        self.partial_grads = [] if kv_split else [s.name for s in self.specs if s.name in KV_TENSORS]
        self.ring = None  # the rank's ContextParallel under parallel.cp > 1
        self.ulysses = None  # ... instead, under parallel.cp_kind = "ulysses"
        self.hybrid = None  # ... or "hybrid" (Ulysses inside a node, the ring across nodes)

    def local(self, tensors: dict) -> dict:
        """The views the linears use: with replicated K/V weights, the columns of this rank's K/V head."""
        if self.kv_columns is None:
            return tensors
        views = dict(tensors)
        for name in KV_TENSORS:
            if name in views:
                views[name] = views[name][..., self.kv_columns]
        return views

    def forward(self, params, x, ctx):
        params = self.local(params)
        (q, k, v), h = self.qkv.forward(params, x)
        heads = split_heads if self.ring is not None else head_view  # the ring sends K/V blocks: contiguous
        q, k, v = heads(q, self.heads), heads(k, self.kv_heads), heads(v, self.kv_heads)
        if self.rope:
            cos, sin = ctx["cos"], ctx["sin"]
            q, k = rotate(ops.rope_forward, q, cos, sin), rotate(ops.rope_forward, k, cos, sin)
        if self.ring is not None:
            out, core = ring_attention.forward(self.ring, q, k, v, ctx.get("documents"))
            out = out.astype(q.dtype, copy=False)
        elif self.ulysses is not None:
            out, core = ulysses_attention.forward(self.ulysses, q, k, v, ctx.get("documents"))
        elif self.hybrid is not None:
            out, core = hybrid_attention.forward(self.hybrid, q, k, v, ctx.get("documents"))
        else:
            (out, _), core = ops.attention_forward(q, k, v, ctx["bias"])
        y, merged = self.out.forward(params, merge_heads(out))
        saved = {"qkv": h, "core": core, "out": merged}
        if self.rope:
            saved["rope"] = (ctx["cos"], ctx["sin"])  # shared tables (per micro-batch with packed documents)
        return y, saved

    def decode(self, params, x, ctx, cache):
        """Generation (forward only, nothing saved): x holds the new positions ctx["positions"] (the ones after
        `cache`, this block's layers/kv_cache.LayerCache); their keys and values are appended to it and their
        queries attend to every cached position, causally among themselves."""
        params = self.local(params)
        (q, k, v), _ = self.qkv.forward(params, x)
        q, k, v = head_view(q, self.heads), head_view(k, self.kv_heads), head_view(v, self.kv_heads)
        if self.rope:  # keys are cached rotated: a position's angle depends on that position only
            q, k = ops.rope_forward(q, ctx["cos"], ctx["sin"]), ops.rope_forward(k, ctx["cos"], ctx["sin"])
        past = cache.length
        keys, values = cache.append(k, v)
        bias = ops.causal_bias(q.shape[2], past + q.shape[2], ctx["xp"], q.dtype, offset=past)
        (out, _), _ = ops.attention_forward(q, keys, values, bias)
        return self.out.forward(params, merge_heads(out))[0]

    def backward(self, params, grads, saved, dy, deferred=None):
        params, grads = self.local(params), self.local(grads)
        d_out = self.out.backward(params, grads, saved["out"], dy, deferred)
        if self.ring is not None:
            dtype = d_out.dtype
            dq, dk, dv = (grad.astype(dtype, copy=False)
                          for grad in ring_attention.backward(self.ring, saved["core"], split_heads(d_out, self.heads)))
        elif self.ulysses is not None:
            dq, dk, dv = ulysses_attention.backward(self.ulysses, saved["core"], head_view(d_out, self.heads))
        elif self.hybrid is not None:
            dq, dk, dv = hybrid_attention.backward(self.hybrid, saved["core"], head_view(d_out, self.heads))
        else:
            dq, dk, dv = ops.attention_backward(saved["core"], head_view(d_out, self.heads))
        if self.rope:
            cos, sin = saved["rope"]
            dq, dk = rotate(ops.rope_backward, dq, cos, sin), rotate(ops.rope_backward, dk, cos, sin)
        d_qkv = [merge_heads(dq), merge_heads(dk), merge_heads(dv)]
        return self.qkv.backward(params, grads, saved["qkv"], d_qkv, deferred)

    def saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        """The entered input, q, k, v, the probabilities and the merged output (the rope tables are the model's).
        Ring attention (seq_len: this cp rank's tokens) keeps q, k, v, its output and log-sum-exp instead of the
        probabilities (recomputed block by block in backward). Ulysses keeps the one-process core's arrays of its
        heads over the whole sequence, hybrid the ring's over its node's tokens."""
        b, t = batch, seq_len
        return self.qkv.saved_arrays(b, t, dtype) + self._core_arrays(b, t, dtype) + self.out.saved_arrays(b, t, dtype)

    def _core_arrays(self, b: int, t: int, dtype) -> list:
        d, h, kv = self.head_dim, self.heads, self.kv_heads
        core = [((b, h, t, d), dtype), ((b, kv, t, d), dtype), ((b, kv, t, d), dtype), ((b, kv, h // kv * t, t), dtype)]
        if self.ring is not None:
            core[3:] = [((b, h, t, d), dtype), ((b, h, t), ring_attention.lse_dtype(dtype))]
        if self.ulysses is not None:
            core = ulysses_attention.saved_arrays(b, h, kv, t, d, self.ulysses.size, dtype)
        if self.hybrid is not None:
            core = hybrid_attention.saved_arrays(b, h, kv, t, d, self.hybrid.inside.size, dtype)
        return core

    # ---- selective recomputation (layers/recompute.py): what is kept of the core, and the core restored from it
    def keep_selective(self, saved) -> tuple:
        """q, k, v (after RoPE); the ring its whole core (it saves no probabilities); Ulysses its heads' q, k, v over
        the whole sequence and the exchanged output (recomputing it would repeat the all-to-all); hybrid its ring's
        whole core and the exchanged output."""
        core = saved["core"]
        if self.ring is not None:
            return core
        if self.ulysses is not None:
            return (*core[0][:3], core[1], saved["out"])
        if self.hybrid is not None:
            return core, saved["out"]
        return core[:3]

    def restore_selective(self, kept, ctx) -> tuple:
        """(core, the output projection's input) from keep_selective's arrays: the one-process core run again (the
        same operations on the same inputs: bitwise the forward's)."""
        if self.ring is not None:
            return kept, merge_heads(kept[3])  # the ring's output in the input's dtype, as handed to the projection
        if self.hybrid is not None:
            return kept
        if self.ulysses is not None:
            q, k, v, kv_heads, merged = kept
            mask = ulysses_attention.whole_mask(q.shape[2], q.dtype, array_module(q), ctx.get("documents"))
            return (ops.attention_forward(q, k, v, mask)[1], kv_heads), merged
        (out, _), core = ops.attention_forward(*kept, ctx["bias"])
        return core, merge_heads(out)

    def selective_saved_arrays(self, b: int, t: int, dtype) -> list:
        """(shape, dtype) of keep_selective's arrays."""
        core = self._core_arrays(b, t, dtype)
        if self.ring is not None:
            return core
        if self.ulysses is not None:
            return core[:3] + self.out.saved_arrays(b, t, dtype)
        if self.hybrid is not None:
            return core + self.out.saved_arrays(b, t, dtype)
        return core[:3]
