"""Hybrid context parallelism (parallel.cp_kind = "hybrid"): Ulysses inside a node, the ring across nodes.

Megatron's hierarchical cp (USP, "unified sequence parallelism"). The cp group of c = a r ranks has two levels
(comm/mesh.py split_by_node): the a cp ranks on this node (`hybrid.inside`) and the r ranks at this rank's position
on every node (`hybrid.across`). Rank j a + i (node j, position i) holds the zig-zag chunks j a + i and
2c-1-(j a + i) of 2c (parallel/context.py hybrid_levels), so:

1. Ulysses' all-to-all over the node (layers/ulysses_attention.heads_for_tokens) hands position i the node's tokens
   of H/a query heads and the K/V heads they use (replicated where a exceeds the K/V heads). The node's tokens
   arrive in sequence order, and they are the ring's two chunks j and 2r-1-j of 2r: the ring's causal balance.
2. Ring attention over the nodes (layers/ring_attention.forward) on those (B, H/a, T/r, D) blocks: K/V travel to
   the rank at the same position on the next node; the packed documents' masks come from the whole rows as there.
3. The second all-to-all hands every rank its own tokens of all heads back. Backward is the transpose: dO goes like
   the queries, the ring's backward, dQ/dK/dV come back like the output.

With one node (r = 1) this is Ulysses with its core cut into chunk pairs; with one cp rank per node (a = 1) it is
the ring (the all-to-alls move nothing). Bytes per attention block and micro-batch (parallel/context.py
cp_bytes_per_block): Ulysses' over a ranks (all_to_all on the cp_inside group) plus the ring's over r ranks of blocks
of H/a heads (cp_ring on cp_across).
"""
from __future__ import annotations

from mpitrain.layers import ring_attention, ulysses_attention


def forward(hybrid, q, k, v, documents=None):
    """(out, saved): causal attention of this rank's tokens. q: (B, H, 2m, D) holding its two zig-zag chunks; k, v:
    (B, Hkv, 2m, D) likewise; documents: None, or the whole rows' (ids, positions). out: (B, H, 2m, D), q's dtype."""
    node_q, node_k, node_v = ulysses_attention.heads_for_tokens(hybrid.inside, q, k, v)
    out, ring_saved = ring_attention.forward(hybrid.across, node_q, node_k, node_v, documents)
    out = ulysses_attention.tokens_for_heads(hybrid.inside, out.astype(q.dtype, copy=False))
    return out, (ring_saved, k.shape[1])


def backward(hybrid, saved, dout):
    """(dq, dk, dv) of this rank's tokens, the shapes and dtype of forward's q, k, v."""
    ring_saved, kv_heads = saved
    node_dout = ulysses_attention.queries_for_tokens(hybrid.inside, dout)
    grads = ring_attention.backward(hybrid.across, ring_saved, node_dout)
    dq, dk, dv = (grad.astype(dout.dtype, copy=False) for grad in grads)
    return ulysses_attention.grads_for_tokens(hybrid.inside, dq, dk, dv, kv_heads)


def saved_arrays(batch: int, heads: int, kv_heads: int, local_len: int, head_dim: int, inside: int, dtype) -> list:
    """(shape, dtype) of what forward keeps: the ring's q, k, v, output and log-sum-exp over the node's tokens
    (inside * local_len) of this rank's H/a query heads and the K/V heads they use."""
    b, h, t, d = batch, heads // inside, local_len * inside, head_dim
    kv = ulysses_attention.kv_heads_per_rank(kv_heads, inside)
    return [((b, h, t, d), dtype), ((b, kv, t, d), dtype), ((b, kv, t, d), dtype), ((b, h, t, d), dtype),
            ((b, h, t), ring_attention.lse_dtype(dtype))]

