"""Causal self-attention as a sublayer, on the normalised input: Q/K/V column-parallel by heads, RoPE (llama),
the attention core, the output projection row-parallel.

Tensor parallelism: rank r holds query heads [r H/t, (r+1) H/t). Grouped-query K/V heads are split too when n_kv_head
is a multiple of t; otherwise t is a multiple of n_kv_head (config rule), every rank's query heads share ONE K/V
head, and the K/V weights are replicated on every rank, each rank computing only the head it needs (a column slice
of the weights); their gradients are then partial sums over the ranks (each back-propagates its own query heads),
named in `partial_grads` for the unit to all-reduce.

The core (ops.attention_forward) takes a block of queries against a block of keys with the causal mask of their
positions and returns each query row's log-sum-exp with the output. Under context parallelism
(mpitrain/parallel/context.apply_context_parallel calls `use_context_parallel`) the core is the one of
parallel.cp_kind, chosen once (layers/cp_cores.py): ring attention (layers/ring_attention.py) runs on this rank's
two zig-zag chunks, K/V blocks travel around the cp ring, partial outputs merge by log-sum-exp; "ulysses"
(layers/ulysses_attention.py) trades heads for tokens by an all-to-all, runs the core above on whole sequences of
H/c heads and trades them back; "hybrid" (layers/hybrid_attention.py) runs that all-to-all inside a node, the ring
across nodes.

Packed documents (data.document_mask, mpitrain/data/documents.py): the model's per-micro-batch context carries a
(B, T, T) mask that also hides other documents (`ctx["bias"]`), rotary tables of each token's position in its
document, one per batch row ((B, T, D/2): `rotate`), and for the ring the whole row's document ids and positions
(`ctx["documents"]`).
"""
from __future__ import annotations

import math

from mpitrain.config import ModelConfig
from mpitrain.layers import ops
from mpitrain.layers.cp_cores import core_for
from mpitrain.layers.heads import head_view, merge_heads
from mpitrain.layers.linear import ColumnParallelLinear, RowParallelLinear
from mpitrain.layers.tensor_parallel import TensorParallel, split_spec
from mpitrain.state.params import ParamSpec

KV_TENSORS = ("wk", "wv", "bv")


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
        self.core = core_for(None)  # the attention core of the context-parallel kind (layers/cp_cores.py)

    def use_context_parallel(self, cp) -> None:
        """Run the core of `cp`'s kind (a ContextParallel of parallel.cp > 1: ring, Ulysses or hybrid)."""
        self.core = core_for(cp)

    # the rank's ContextParallel where the core is of that kind, else None
    ring = property(lambda self: self.core.cp if self.core.kind == "ring" else None)
    ulysses = property(lambda self: self.core.cp if self.core.kind == "ulysses" else None)
    hybrid = property(lambda self: self.core.cp if self.core.kind == "hybrid" else None)

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
        q, k, v = self.core.heads(q, self.heads), self.core.heads(k, self.kv_heads), self.core.heads(v, self.kv_heads)
        if self.rope:
            cos, sin = ctx["cos"], ctx["sin"]
            q, k = rotate(ops.rope_forward, q, cos, sin), rotate(ops.rope_forward, k, cos, sin)
        out, core = self.core.forward(q, k, v, ctx)
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
        dq, dk, dv = self.core.backward(saved["core"], self.core.heads(d_out, self.heads))
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
        return self.core.saved_arrays(b, self.heads, self.kv_heads, t, self.head_dim, dtype)

    # ---- selective recomputation (layers/recompute.py): what is kept of the core, and the core restored from it
    def keep_selective(self, saved) -> tuple:
        """q, k, v (after RoPE); the ring its whole core (it saves no probabilities); Ulysses its heads' q, k, v over
        the whole sequence and the exchanged output (recomputing it would repeat the all-to-all); hybrid its ring's
        whole core and the exchanged output."""
        return self.core.keep(saved["core"], saved["out"])

    def restore_selective(self, kept, ctx) -> tuple:
        """(core, the output projection's input) from keep_selective's arrays: the one-process core run again (the
        same operations on the same inputs: bitwise the forward's)."""
        return self.core.restore(kept, ctx)

    def selective_saved_arrays(self, b: int, t: int, dtype) -> list:
        """(shape, dtype) of keep_selective's arrays."""
        return self.core.kept_arrays(self._core_arrays(b, t, dtype), self.out.saved_arrays(b, t, dtype))
