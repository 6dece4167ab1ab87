"""Context parallelism: the zig-zag split of a sequence over the cp ranks and the ring the K/V blocks travel.

Zig-zag (load-balanced) split. The sequence of T tokens is cut into 2c chunks of m = T/(2c); cp rank r holds chunks
r and 2c-1-r, in that order. Under causal attention a query at position i sees i+1 keys, so a rank holding an early
chunk and the mirrored late one does the same work as every other: sum over its positions of (i + 1) =
m^2 (2c-1) + m (m+1) on every rank, where the contiguous split (rank r holds chunk r of c) costs rank c-1 about
2c-1 times rank 0's (`attention_pairs_per_rank` counts both).

The ring. Every cp rank sends its K/V block (both chunks, packed in one buffer) to the next rank and receives the
previous rank's, c-1 times in forward, non-blocking, while it computes attention against the block it holds. Backward
runs the same ring for K/V again plus a travelling dK/dV accumulator: the accumulator for rank j's block starts at
rank j+1 (one hop after j) and returns to j after c-1 hops. With F = the K/V bytes of the full sequence of one
micro-batch for one block (2 B Hkv T D e on this tp rank), each rank sends per block and micro-batch:

    forward   (c-1)/c F               K/V, c-1 hops of F/c
    backward  2 (c-1)/c F             K/V again, c-1 hops, and dK/dV, c-1 hops (same size)

counted on the cp group under the kind "cp_ring" (comm/counters.py). Full recomputation repeats the forward's.
`cp_bytes_per_block` and `cp_bytes_per_step` give these bytes for every parallel.cp_kind (ring, Ulysses' all-to-alls,
hybrid's both), by counter, for the planner; `hybrid_levels` why hybrid's two levels keep the zig-zag.

Everything here is about positions and messages; the attention math is in mpitrain/layers/ (ring_attention.py,
ulysses_attention.py, hybrid_attention.py).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from mpitrain.backend import array_module, wire_view
from mpitrain.comm.mesh import all_groups_of
from mpitrain.errors import ConfigError, LayoutError
from mpitrain.layers.recompute import forward_runs
from mpitrain.layers.ring_attention import visible_pairs
from mpitrain.layers.ulysses_attention import bytes_per_block as ulysses_bytes_per_block
from mpitrain.layers.ulysses_attention import kv_heads_per_rank
from mpitrain.state.params import UnitLayout

RING_KIND = "cp_ring"
KV_TAG, GRAD_TAG = 71, 72  # MPI tags: the K/V blocks and the dK/dV accumulators travel on separate channels


def zigzag_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2c) rank `cp_rank` holds, in the order it holds them."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Absolute positions of this rank's tokens (its two chunks, in order)."""
    m = seq_len // (2 * cp_size)
    return np.concatenate([np.arange(c * m, (c + 1) * m) for c in zigzag_chunks(cp_size, cp_rank)])


def contiguous_positions(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Positions under the plain split (rank r holds the r-th of c chunks): the unbalanced baseline."""
    m = seq_len // cp_size
    return np.arange(cp_rank * m, (cp_rank + 1) * m)


def split_sequence(array, cp_size: int, cp_rank: int):
    """This rank's tokens of a (batch, T, ...) array: its two zig-zag chunks, contiguous."""
    if cp_size == 1:
        return array
    return np.ascontiguousarray(array[:, zigzag_positions(array.shape[1], cp_size, cp_rank)])


def attention_pairs_per_rank(seq_len: int, cp_size: int, layout: str = "zigzag") -> list[int]:
    """(query, key) pairs each rank's causal attention computes: sum of (position + 1) over its queries. Attention
    FLOPs per rank are 4 D H times this (QK^T and PV, 2 FLOPs per multiply-add) in forward."""
    positions = zigzag_positions if layout == "zigzag" else contiguous_positions
    return [int((positions(seq_len, cp_size, r) + 1).sum()) for r in range(cp_size)]


def attention_flops_per_rank(seq_len: int, cp_size: int, heads: int, head_dim: int,
                             layout: str = "zigzag") -> list[int]:
    """Forward attention FLOPs of each rank with a causal mask applied exactly: 2 matmuls (QK^T, PV) of 2 FLOPs per
    multiply-add for every visible (query, key) pair and head."""
    return [4 * heads * head_dim * pairs for pairs in attention_pairs_per_rank(seq_len, cp_size, layout)]


def ring_pairs_computed(cp_size: int) -> list[int]:
    """(query chunk, key chunk) pairs each rank's ring attention runs over a step's c ring steps (m x m blocks; a
    diagonal pair is computed whole and masked): 2c+1 on every rank under zig-zag, the masked pairs skipped."""
    counts = []
    for rank in range(cp_size):
        mine = zigzag_chunks(cp_size, rank)
        counts.append(sum(len(visible_pairs(mine, zigzag_chunks(cp_size, source), 1, np.float64))
                          for source in range(cp_size)))
    return counts


def ring_bytes_per_block(kv_full_bytes: int, cp_size: int) -> dict[str, float]:
    """Bytes one rank sends on the ring for one attention block and micro-batch (module docstring)."""
    share = (cp_size - 1) / cp_size * kv_full_bytes
    return {"forward": share, "backward": 2 * share}


def cp_bytes_per_block(kind: str, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                       element_bytes: int, cp_size: int, inside: int = 1) -> dict[str, dict[str, float]]:
    """Bytes one rank sends per attention block and micro-batch under parallel.cp_kind `kind`, by the comm counter
    they are counted under: {"cp_ring": {"forward", "backward"}, "all_to_all": {...}}. heads, kv_heads: a tp rank's;
    seq_len: the whole sequence T; inside: hybrid's cp ranks per node (a; the ring runs over c/a nodes).

        ring     cp_ring     forward (c-1)/c F, backward 2 (c-1)/c F        F = 2 B Hkv T D e
        ulysses  all_to_all  forward = backward = (c-1)/c (2 Q + 2 K')     Q = B H (T/c) D e, K' = B Hkv' (T/c) D e
        hybrid   both: Ulysses over a ranks, the ring over r = c/a ranks with F = 2 B Hkv'(a) T D e

    Hkv' = Hkv split, or c (one replicated head to each rank; Hkv'(a): 1 head) where c exceeds Hkv. Full
    recomputation repeats the forward's bytes."""
    per_head = batch * seq_len // cp_size * head_dim * element_bytes  # one head of this rank's tokens
    a = {"ring": 1, "ulysses": cp_size, "hybrid": inside}[kind]
    zero = {"forward": 0.0, "backward": 0.0}
    all_to_all = ulysses_bytes_per_block(heads * per_head, kv_heads * per_head, kv_heads, a) if a > 1 else zero
    ring_kv_heads = kv_heads if a == 1 else kv_heads_per_rank(kv_heads, a)
    ring = ring_bytes_per_block(2 * batch * ring_kv_heads * seq_len * head_dim * element_bytes, cp_size // a) \
        if cp_size > a else zero
    return {"cp_ring": ring, "all_to_all": all_to_all}


def ring_messages(recompute: str, cp: int) -> int:
    """Messages one rank sends per attention block and micro-batch on a ring of cp ranks (those of
    cp_bytes_per_block): K/V c - 1 hops in forward, K/V and the dK/dV accumulator c - 1 hops each in backward, the
    forward's again under memory.recompute = full."""
    return (forward_runs(recompute) + 2) * (cp - 1)


def ulysses_all_to_alls(recompute: str) -> int:
    """All-to-alls one attention block runs per micro-batch under Ulysses (those of cp_bytes_per_block): Q/K/V and
    the output in forward, dO and dQ/dK/dV in backward, and the forward's two again under memory.recompute = full."""
    return 2 * forward_runs(recompute) + 2


def cp_bytes_per_step(kind: str, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                      element_bytes: int, cp_size: int, inside: int = 1, blocks: int = 1, micro_batches: int = 1,
                      recompute: str = "none") -> dict[str, float]:
    """Bytes one rank sends per step on the cp groups, by counter: blocks (this rank's attention blocks) x
    micro_batches x (forward + backward, the forward twice under full recomputation) of cp_bytes_per_block."""
    runs = forward_runs(recompute)
    return {counter: blocks * micro_batches * (runs * sent["forward"] + sent["backward"])
            for counter, sent in cp_bytes_per_block(kind, batch, seq_len, heads, kv_heads, head_dim, element_bytes,
                                                    cp_size, inside).items()}


def hybrid_levels(cp, inside, across):
    """(inside, across) ContextParallels of a hybrid cp group from its two node levels (comm Groups). The zig-zag
    split over c = a r ranks (a per node, r nodes) is the ring's over the r nodes, refined: cp rank j a + i (node j,
    position i on it) holds chunks j a + i and 2c-1-(j a + i), so node j holds the ring chunks j and 2r-1-j, and in
    the node's own order its position i holds chunks i and 2a-1-i: Ulysses' zig-zag over the node. Hence the cp
    rank must be the across rank times a plus the inside rank. Without groups (shapes only) all ranks are ring."""
    if inside is None:
        return ContextParallel(None, size=1, kind="ulysses"), ContextParallel(None, size=cp.size, kind="ring")
    if cp.rank != across.rank * inside.size + inside.rank or inside.size * across.size != cp.size:
        raise LayoutError(f"parallel.cp_kind = 'hybrid' needs each node's cp ranks consecutive in the cp group: cp "
                          f"rank {cp.rank} is position {inside.rank} of {inside.size} on its node and {across.rank} "
                          f"of {across.size} across nodes; place ranks on nodes in blocks or use cp_kind 'ring'")
    return ContextParallel(inside, kind="ulysses"), ContextParallel(across, kind="ring")


def check_cp_blocks_on_nodes(mesh) -> None:
    """hybrid_levels' condition for every cp group of `mesh`, the same on every rank: each node's cp ranks
    consecutive in the cp group (so no rank goes on into a collective that a refusing peer never reaches)."""
    for members in all_groups_of("cp", mesh.degrees):
        nodes = [mesh.nodes.node_of_rank[member] for member in members]
        per_node = nodes.count(nodes[0])
        if any(node != nodes[i - i % per_node] for i, node in enumerate(nodes)):
            raise LayoutError(f"parallel.cp_kind = 'hybrid' needs each node's cp ranks consecutive in the cp group: "
                              f"cp group {members} runs on nodes {nodes}; place ranks on nodes in blocks or use "
                              f"cp_kind 'ring'")


class ContextParallel:
    """The cp group of one rank, what the model needs of it: positions, the sequence split and the ring.

    group: a comm Group over the cp ranks (ring order = group rank order); None with `size` for a layout without
    communication (mpitrain memory counts shapes only). kind: parallel.cp_kind, "ring" (layers/ring_attention.py),
    "ulysses" (layers/ulysses_attention.py: heads exchanged for tokens by all-to-all) or "hybrid"
    (layers/hybrid_attention.py): `inside` and `across` are then the ContextParallels of the group's two levels,
    Ulysses over the cp ranks on this node, the ring over one cp rank per node (`hybrid_levels`).
    """

    def __init__(self, group, size: int | None = None, kind: str = "ring", inside=None, across=None):
        self.group, self.kind = group, kind
        self.size, self.rank = (group.size, group.rank) if group is not None else (size, 0)
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.inside, self.across = None, None
        if kind == "hybrid":
            self.inside, self.across = hybrid_levels(self, inside, across)

    @classmethod
    def of_mesh(cls, mesh, kind: str) -> ContextParallel:
        """The rank's cp group of `mesh` (comm.Mesh), with its two node levels under kind "hybrid"."""
        if kind != "hybrid" or mesh.cp.size == 1:
            return cls(mesh.cp, kind=kind)
        check_cp_blocks_on_nodes(mesh)
        return cls(mesh.cp, kind=kind, inside=mesh.inside_node["cp"], across=mesh.across_nodes["cp"])

    def positions(self, local_len: int) -> np.ndarray:
        """Absolute positions of a rank's `local_len` tokens (the full sequence is size * local_len)."""
        return zigzag_positions(local_len * self.size, self.size, self.rank)

    def chunks_of(self, cp_rank: int) -> tuple[int, int]:
        return zigzag_chunks(self.size, cp_rank)

    def source(self, step: int) -> int:
        """Whose K/V block this rank holds at ring step `step` (0: its own)."""
        return (self.rank - step) % self.size

    def pass_kv(self, send):
        """Send this K/V buffer (contiguous) to the next rank and receive the previous rank's into a new buffer,
        both non-blocking: (received buffer, [handles]); wait on the handles before reading it."""
        received = array_module(send).empty_like(send)  # a device buffer for device arrays
        return received, [self.group.irecv(received, self.prev, KV_TAG),
                          self.group.isend(send, self.next, KV_TAG, kind=RING_KIND)]

    def send_grads(self, send) -> list:
        """Pass a dK/dV accumulator on to the next rank: [handle]."""
        return [self.group.isend(send, self.next, GRAD_TAG, kind=RING_KIND)]

    def receive_grads(self, like):
        """Post the receive of the previous rank's dK/dV accumulator: (buffer, [handle])."""
        received = array_module(like).empty_like(like)
        return received, [self.group.irecv(received, self.prev, GRAD_TAG)]

    def exchange(self, send):
        """Ulysses' all-to-all: block r of `send` (c blocks on the first axis) goes to cp rank r; the result's block
        s came from rank s."""
        received = array_module(send).empty_like(send)
        self.group.all_to_all(wire_view(send), wire_view(received))  # a copy: bf16 may travel as its bits
        return received


def apply_context_parallel(model, cp: ContextParallel) -> None:
    """Make `model` (a GPT) a cp rank's model: ring, Ulysses or hybrid attention in every block, positions of its
    zig-zag chunks, and every gradient that data parallelism reduces over dp reduced over dp x cp (each cp rank saw
    other tokens of the same sequences). Call before the state is built from model.layouts."""
    if cp.size == 1:
        return
    model.context_parallel = cp
    for unit in model.units:
        for layer in unit.sublayers:
            if hasattr(layer, "use_context_parallel"):  # the attention core: the core of cp's kind
                if cp.kind in ("ulysses", "hybrid"):
                    check_heads_split(cp, layer.heads, layer.kv_heads)
                layer.use_context_parallel(cp)
            elif hasattr(layer, "ring"):  # the learned-position table
                layer.ring = cp
        unit.layout = UnitLayout(unit.layout.name, [replace(spec, reduce_over="dp_cp") if spec.reduce_over == "dp"
                                                    else spec for spec in unit.layout.specs])
    model.layouts = [unit.layout for unit in model.units]


def check_heads_split(cp: ContextParallel, heads: int, kv_heads: int) -> None:
    """The all-to-all gives each of `a` ranks (the cp group, or its ranks on one node under hybrid) H/a of a tp
    rank's heads: refused with the keys to change when they do not split. Under hybrid `a` is known only once the
    node layout is (config validation checks Ulysses' a = cp)."""
    a = cp.size if cp.kind == "ulysses" else cp.inside.size
    where = "parallel.cp" if cp.kind == "ulysses" else f"the {a} cp ranks per node"
    if heads % a or not (kv_heads % a == 0 or a % kv_heads == 0):
        raise ConfigError(f"parallel.cp_kind = {cp.kind!r}: the {heads} query and {kv_heads} key/value heads per tp "
                          f"rank do not split over {where} = {a} (query heads must divide evenly, key/value heads "
                          f"divide or be divided); change model.n_head / n_kv_head, parallel.tp or cp_kind 'ring'")
