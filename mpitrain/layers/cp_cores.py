"""The attention core of each context-parallel kind, one class per kind with the same methods, chosen once per
Attention (`core_for`, from the rank's ContextParallel that parallel/context.apply_context_parallel hands it):

    heads(x, n)                 the (B, n, T, D) layout the core takes q, k, v and dO in
    forward(q, k, v, ctx)       (out, saved): out (B, H, T, D) in q's dtype
    backward(saved, dout)       (dq, dk, dv) in dout's dtype
    saved_arrays(b, h, kv, t, d, dtype)      (shape, dtype) of forward's saved (t: this rank's tokens)
    keep(saved, projected)      what selective recomputation keeps (projected: the output projection's input)
    restore(kept, ctx)          (saved, projected) from keep's arrays
    kept_arrays(core, projected)             (shape, dtype) of keep's arrays, from those of saved and projected

A new kind is a class here and a line in CORES.
"""
from __future__ import annotations

from mpitrain.backend import array_module
from mpitrain.layers import hybrid_attention, ops, ring_attention, ulysses_attention
from mpitrain.layers.heads import head_view, merge_heads, split_heads


class LocalCore:
    """No context parallelism: the one-process core (ops.attention_forward) on this rank's whole sequence, under
    the model's causal or packed-documents mask ctx["bias"]. Keeps q, k, v and the probabilities; selective
    recomputation keeps q, k, v (after RoPE) and runs the core again (the same operations on the same inputs:
    bitwise the forward's)."""
    kind, cp = None, None

    def heads(self, x, n_heads: int):
        return head_view(x, n_heads)

    def forward(self, q, k, v, ctx):
        (out, _), saved = ops.attention_forward(q, k, v, ctx["bias"])
        return out, saved

    def backward(self, saved, dout):
        return ops.attention_backward(saved, dout)

    def saved_arrays(self, b: int, h: int, kv: int, t: int, d: int, dtype) -> list:
        return [((b, h, t, d), dtype), ((b, kv, t, d), dtype), ((b, kv, t, d), dtype),
                ((b, kv, h // kv * t, t), dtype)]

    def keep(self, saved, projected) -> tuple:
        return saved[:3]

    def restore(self, kept, ctx) -> tuple:
        (out, _), saved = ops.attention_forward(*kept, ctx["bias"])
        return saved, merge_heads(out)

    def kept_arrays(self, core: list, projected: list) -> list:
        return core[:3]


class RingCore:
    """Ring attention (layers/ring_attention.py) on this rank's two zig-zag chunks, K/V blocks passed round the cp
    ring (contiguous heads: they are sent). Keeps q, k, v, its output and log-sum-exp instead of the probabilities
    (recomputed block by block in backward); selective recomputation keeps that whole core."""
    kind = "ring"

    def __init__(self, cp):
        self.cp = cp

    def heads(self, x, n_heads: int):
        return split_heads(x, n_heads)

    def forward(self, q, k, v, ctx):
        out, saved = ring_attention.forward(self.cp, q, k, v, ctx.get("documents"))
        return out.astype(q.dtype, copy=False), saved

    def backward(self, saved, dout):
        return tuple(grad.astype(dout.dtype, copy=False) for grad in ring_attention.backward(self.cp, saved, dout))

    def saved_arrays(self, b: int, h: int, kv: int, t: int, d: int, dtype) -> list:
        return [((b, h, t, d), dtype), ((b, kv, t, d), dtype), ((b, kv, t, d), dtype), ((b, h, t, d), dtype),
                ((b, h, t), ring_attention.lse_dtype(dtype))]

    def keep(self, saved, projected) -> tuple:
        return saved

    def restore(self, kept, ctx) -> tuple:
        return kept, merge_heads(kept[3])  # the ring's output in the input's dtype, as handed to the projection

    def kept_arrays(self, core: list, projected: list) -> list:
        return core


class UlyssesCore:
    """Ulysses attention (layers/ulysses_attention.py): an all-to-all trades heads for tokens, the one-process core
    runs on whole sequences of H/c heads, a second all-to-all trades them back. Keeps that core's arrays of its heads
    over the whole sequence; selective recomputation keeps its q, k, v and the exchanged output (recomputing that
    would repeat the all-to-all)."""
    kind = "ulysses"

    def __init__(self, cp):
        self.cp = cp

    def heads(self, x, n_heads: int):
        return head_view(x, n_heads)

    def forward(self, q, k, v, ctx):
        return ulysses_attention.forward(self.cp, q, k, v, ctx.get("documents"))

    def backward(self, saved, dout):
        return ulysses_attention.backward(self.cp, saved, dout)

    def saved_arrays(self, b: int, h: int, kv: int, t: int, d: int, dtype) -> list:
        return ulysses_attention.saved_arrays(b, h, kv, t, d, self.cp.size, dtype)

    def keep(self, saved, projected) -> tuple:
        return (*saved[0][:3], saved[1], projected)

    def restore(self, kept, ctx) -> tuple:
        q, k, v, kv_heads, projected = kept
        mask = ulysses_attention.whole_mask(q.shape[2], q.dtype, array_module(q), ctx.get("documents"))
        return (ops.attention_forward(q, k, v, mask)[1], kv_heads), projected

    def kept_arrays(self, core: list, projected: list) -> list:
        return core[:3] + projected


class HybridCore:
    """Hybrid (layers/hybrid_attention.py): Ulysses' all-to-all inside a node, the ring across nodes. Keeps the
    ring's arrays over its node's tokens; selective recomputation keeps that whole core and the exchanged output."""
    kind = "hybrid"

    def __init__(self, cp):
        self.cp = cp

    def heads(self, x, n_heads: int):
        return head_view(x, n_heads)

    def forward(self, q, k, v, ctx):
        return hybrid_attention.forward(self.cp, q, k, v, ctx.get("documents"))

    def backward(self, saved, dout):
        return hybrid_attention.backward(self.cp, saved, dout)

    def saved_arrays(self, b: int, h: int, kv: int, t: int, d: int, dtype) -> list:
        return hybrid_attention.saved_arrays(b, h, kv, t, d, self.cp.inside.size, dtype)

    def keep(self, saved, projected) -> tuple:
        return saved, projected

    def restore(self, kept, ctx) -> tuple:
        return kept

    def kept_arrays(self, core: list, projected: list) -> list:
        return core + projected


CORES = {"ring": RingCore, "ulysses": UlyssesCore, "hybrid": HybridCore}


def core_for(cp):
    """The core for `cp` (a ContextParallel of parallel.cp_kind, or None without context parallelism)."""
    return LocalCore() if cp is None else CORES[cp.kind](cp)
