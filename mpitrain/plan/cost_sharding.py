"""The planner's terms for collectives split by node or shrunk on the wire: hierarchical data parallelism
(parallel.dp_reduce = "two_level", parallel.zero_shard = "node"), quantized ZeRO (ZeRO++: parallel.zero_gather_dtype,
zero_grad_reduce, zero_quant_block) and hybrid context parallelism (parallel.cp_kind = "hybrid"). plan/cost.py
calls these where a layout uses one of them; the other layouts keep its flat rings. Every byte count is the
feature's own formula (named below), so that the planner and the training code cannot drift apart.

Where ranks sit: mesh order pp, dp, cp, tp (tp fastest), a node holding gpus_per_node consecutive ranks. A group of
`size` ranks `stride` apart then has `ranks_per_node` of them on each node (k), and spans size / k nodes (n).

Hierarchical data parallelism (state/hierarchical.py, comm/two_level.py) over the group the gradients are summed
over (dp x cp, stride tp), B the bytes of a buffer:

    two_level  all_reduce      reduce-scatter inside (k-1)/k B, all-reduce across 2(n-1)/n B/k, all-gather inside
               reduce_scatter  inside (k-1)/k B, then across (n-1)/n B/k; all_gather: across, then inside
    node       ZeRO shards over the k ranks of a node, one copy per node: reduce_scatter = inside (k-1)/k B, then an
               all-reduce across of the shard, 2(n-1)/n B/k; all_gather inside only (k-1)/k B

The levels run one after the other (comm/two_level.py's Sequencer), so their seconds add; the across level's bytes
per step are state/hierarchical.py cross_node_bytes (tests/test_plan_sharding.py). Under zero_shard = node the
memory rows and the optimizer's passes shard over k instead of dp x cp (`node_shares`).

Quantized ZeRO: a quantized gradient reduce-scatter (ZeRO 1-3) or ZeRO-3 gather puts each element's code and one
fp32 scale per zero_quant_block elements on the wire (comm/quantized.py wire_nbytes) instead of the element; every
level of a hierarchical reduction quantizes its own partial sum (state/hierarchical_quantized.py
cross_node_step_bytes). Making and reading the codes are elementwise passes over HBM (`quantize_seconds`): a
reduction encodes the gradients (read them, write codes) and decodes the pieces it receives into a float32 sum
(read codes, write and read the sum), at each level on what that level holds; a gather decodes every rank's
message into the gathered weights.

Hybrid context parallelism (layers/hybrid_attention.py): Ulysses' all-to-alls over the a cp ranks of a node on the
intra-node link, the ring over the r = cp / a nodes on the inter-node link, bytes by parallel/context.py
cp_bytes_per_step(kind="hybrid", inside=a). Four all-to-alls per block and micro-batch (two in forward, two in
backward; the forward's again under full recomputation) of a - 1 steps, exposed; the ring's K/V passes (forward,
backward, and the dK/dV accumulator) of r - 1 hops hide behind the attention they feed as far as comm_overlap lets
them, as the plain ring's do.
"""
from __future__ import annotations

import math

from mpitrain.comm.quantized import wire_nbytes
from mpitrain.errors import ConfigError
from mpitrain.parallel.context import cp_bytes_per_step, ring_messages, ulysses_all_to_alls

FLOAT32_BYTES = 4  # the partial sums a quantized reduction decodes into


def ranks_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """How many of a group's `size` ranks, `stride` apart, share one node of gpus_per_node consecutive ranks: the
    group's inside level (comm/nodes.py split_by_node). ConfigError where nodes would hold different numbers of them,
    which the training code's two levels refuse too."""
    if size == 1 or stride >= gpus_per_node:
        return 1
    span = size * stride
    if gpus_per_node % stride or (span > gpus_per_node and span % gpus_per_node) or \
            (span < gpus_per_node and gpus_per_node % span):
        raise ConfigError(f"a group of {size} ranks {stride} apart is split unevenly over nodes of {gpus_per_node} "
                          "GPUs: its two levels (inside a node, across nodes) need the same number on each node")
    return min(size, gpus_per_node // stride)


def dp_levels(parallel, gpus_per_node: int) -> tuple[int, int]:
    """(k, n): the gradient group's (dp x cp, stride tp) ranks per node and the nodes it spans."""
    size = parallel.dp * parallel.cp
    k = ranks_per_node(size, parallel.tp, gpus_per_node)
    return k, size // k


def shards_by_node(parallel) -> bool:
    """parallel.zero_shard = 'node' with ZeRO on: the state shards over one node's ranks."""
    return parallel.zero_shard == "node" and parallel.zero >= 1


def node_shares(cfg, shares: list, gpus_per_node: int) -> list:
    """plan/memory.py reduction_shares with the dense share's ZeRO group cut to one node's ranks under
    zero_shard = node (gpus_per_node 0: nodes unknown, the whole group on one node)."""
    p = cfg.parallel
    if not shards_by_node(p) or not gpus_per_node or not shares:
        return shares
    (count, ranks), rest = shares[0], shares[1:]
    return [(count, ranks_per_node(ranks, p.tp, gpus_per_node))] + list(rest)


def wire_bytes_per_element(codec: str, piece: float, block: int, exact_bytes: float) -> float:
    """Bytes per element of a message of `piece` elements: exact_bytes, or codes and fp32 scales (comm/quantized.py
    wire_nbytes) under codec int8 / int4 / fp8."""
    if codec in ("same", "exact"):
        return exact_bytes
    elements = max(1, math.ceil(piece))
    return wire_nbytes(codec, elements, block) / elements


def _ring(op: str, elements: float, ranks: int, bytes_at) -> tuple[float, int]:
    """(bytes one rank sends, latency steps) of one ring collective (or the quantized all-to-all, the same count) of
    `elements` over `ranks`; bytes_at(piece): wire bytes per element of a message of `piece` elements."""
    if ranks <= 1 or elements <= 0:
        return 0.0, 0
    per_element = bytes_at(elements / ranks)
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks * elements * per_element, 2 * (ranks - 1)
    return (ranks - 1) / ranks * elements * per_element, ranks - 1


def level_transfers(op: str, mode: str, elements: float, k: int, n: int, bytes_at) -> list[tuple[str, float, int]]:
    """[(level "intra" | "inter", bytes one rank sends, latency steps)] of one collective of `elements` over a group of
    k ranks per node on n nodes (module docstring): mode "flat" (one ring, across nodes where n > 1), "two_level" or
    "node"."""
    if mode == "flat":
        return [("inter" if n > 1 else "intra", *_ring(op, elements, k * n, bytes_at))]
    piece = elements / k  # what each rank holds after the inside level: the across level's buffer
    if mode == "node" and op == "all_gather":
        return [("intra", *_ring(op, elements, k, bytes_at))]
    if op == "all_reduce" and mode == "two_level":
        return [("intra", *_ring("reduce_scatter", elements, k, bytes_at)),
                ("inter", *_ring("all_reduce", piece, n, bytes_at)),
                ("intra", *_ring("all_gather", elements, k, bytes_at))]
    across_op = "all_reduce" if mode == "node" else op  # node: the shard summed over its copies
    return [("intra", *_ring(op, elements, k, bytes_at)), ("inter", *_ring(across_op, piece, n, bytes_at))]


def _codec(parallel, op: str) -> str:
    """What a ZeRO collective puts on the wire: zero_grad_reduce for the gradient reduction (ZeRO 1-3),
    zero_gather_dtype for ZeRO-3's gathers (ZeRO-1/2 gather the updated parameters in the compute dtype)."""
    if parallel.zero >= 1 and op in ("reduce_scatter", "all_reduce"):
        return parallel.zero_grad_reduce
    return parallel.zero_gather_dtype if parallel.zero == 3 and op == "all_gather" else "same"


def uses_sharding_terms(parallel) -> bool:
    """Whether a layout's gradient sync needs this module (else plan/cost.py's flat rings are the same)."""
    quantized = parallel.zero >= 1 and (parallel.zero_grad_reduce != "exact" or
                                        (parallel.zero == 3 and parallel.zero_gather_dtype != "same"))
    return quantized or parallel.dp_reduce == "two_level" or shards_by_node(parallel)


def sharding_rings(cfg, cluster, shares: list):
    """rings(op, bytes_per_param, times) as plan/cost.py reduction_rings gives them, for layouts that reduce in two
    levels or quantize ZeRO's wire; None for the others. shares: plan/memory.py reduction_shares (the dense share
    over dp x cp ranks tp apart, the experts' over expert_dp, which stays flat)."""
    p = cfg.parallel
    if not uses_sharding_terms(p):
        return None
    mode = "node" if shards_by_node(p) else p.dp_reduce if p.dp_reduce == "two_level" else "flat"
    links = {"intra": cluster.intra, "inter": cluster.inter}
    groups = []
    for index, ((count, ranks), stride) in enumerate(zip(shares, (p.tp, (p.etp or p.tp) * p.ep))):
        if index == 0 and mode != "flat":
            k = ranks_per_node(ranks, stride, cluster.gpus_per_node)
            groups.append((count, mode, k, ranks // k))
        else:  # a flat ring: across nodes where its ranks span more than one
            crosses = ranks > 1 and ranks * stride > cluster.gpus_per_node
            groups.append((count, "flat", 1 if crosses else ranks, ranks if crosses else 1))

    def rings(op: str, bytes_per_param: float, times: float = 1.0) -> float:
        codec = _codec(p, op)

        def bytes_at(piece):
            return wire_bytes_per_element(codec, piece, p.zero_quant_block, bytes_per_param)
        return sum(times * links[level].seconds(nbytes, steps) for count, group_mode, k, n in groups
                   for level, nbytes, steps in level_transfers(op, group_mode, count, k, n, bytes_at))
    return rings


def quantize_seconds(cfg, cluster, shares: list, micro_batches: int, element_bytes: int) -> float:
    """Seconds per step of the elementwise passes that make and read quantized ZeRO messages (module docstring), at
    HBM bandwidth; 0 without quantized ZeRO communication."""
    p = cfg.parallel
    if p.zero == 0:
        return 0.0
    elements, ranks = sum(count for count, _ in shares), max(shares[0][1], 1) if shares else 1
    level_share = 1.0  # what each level quantizes: the whole buffer inside, the node's 1/k piece across
    if p.dp_reduce == "two_level" or shards_by_node(p):
        k = dp_levels(p, cluster.gpus_per_node)[0]
        level_share += (2 if shards_by_node(p) else 1) / k  # node: the across all-reduce's two quantized halves
    moved = 0.0
    if p.zero_grad_reduce != "exact":
        w = wire_bytes_per_element(p.zero_grad_reduce, elements / ranks, p.zero_quant_block, element_bytes)
        reductions = 1 if p.zero == 1 else micro_batches
        # encode: read the gradients, write codes; decode: read codes, write the float32 sum and read it back
        moved += reductions * level_share * elements * (element_bytes + w + w + 2 * FLOAT32_BYTES)
    if p.zero == 3 and p.zero_gather_dtype != "same":
        w = wire_bytes_per_element(p.zero_gather_dtype, elements / ranks, p.zero_quant_block, element_bytes)
        gathers = micro_batches * (2 if p.reshard_after_forward else 1)
        moved += gathers * elements * (w + element_bytes) * (1 + 1 / ranks)  # decode every message, encode one's own
    return moved / cluster.hbm_bandwidth


def cp_ranks_per_node(parallel, gpus_per_node: int) -> int:
    """a: the cp ranks (tp apart) on one node, Ulysses' level of hybrid cp; the ring runs over cp / a nodes."""
    return ranks_per_node(parallel.cp, parallel.tp, gpus_per_node)


def hybrid_cp_bytes(cfg, element_bytes: int, layers: int, inside: int) -> dict:
    """Bytes one rank sends per micro-batch on hybrid cp's two levels, by counter ({"all_to_all": inside the node,
    "cp_ring": across}): parallel/context.py cp_bytes_per_step over this rank's `layers` blocks. ConfigError where
    a tp rank's heads do not split over the `inside` ranks (parallel/context.py check_heads_split's rule)."""
    m, p = cfg.model, cfg.parallel
    heads, kv_heads = m.n_head // p.tp, m.kv_heads // p.tp if m.kv_heads % p.tp == 0 else 1
    if heads % inside or not (kv_heads % inside == 0 or inside % kv_heads == 0):
        raise ConfigError(f"parallel.cp_kind = 'hybrid': the {heads} query and {kv_heads} key/value heads per tp rank "
                          f"do not split over the {inside} cp ranks per node; change parallel.tp or cp_kind 'ring'")
    return cp_bytes_per_step("hybrid", cfg.train.micro_batch, m.seq_len, heads, kv_heads, m.head_dim, element_bytes,
                             p.cp, inside=inside, blocks=layers, recompute=cfg.memory.recompute)


def hybrid_cp_seconds(cfg, cluster, element_bytes: int, layers: int, attention_s: float) -> float:
    """Exposed seconds per micro-batch of hybrid cp (module docstring): the all-to-alls inside the node, and the
    ring across nodes beyond the attention_s seconds of attention it hides behind (at comm_overlap)."""
    p = cfg.parallel
    inside = cp_ranks_per_node(p, cluster.gpus_per_node)
    across = p.cp // inside
    sent = hybrid_cp_bytes(cfg, element_bytes, layers, inside)
    recompute = cfg.memory.recompute
    all_to_all = cluster.intra.seconds(sent["all_to_all"], layers * ulysses_all_to_alls(recompute) * (inside - 1))
    ring_link = cluster.inter if across > 1 else cluster.intra
    ring_s = ring_link.seconds(sent["cp_ring"], layers * ring_messages(recompute, across))
    return all_to_all + max(0.0, ring_s - cluster.comm_overlap * attention_s)


# ---- what the search tries (plan/search.py) --------------------------------------------------------------------------
QUANTIZED_COMM = "quantized-comm"  # `mpitrain plan --allow quantized-comm`: ZeRO++'s wire dtypes change the numerics


def sync_settings(cfg, mesh, gpus_per_node: int, zero: int, allow: tuple = ()) -> list[dict]:
    """The Layout fields of the gradient sync to try at ZeRO stage `zero` on `mesh`: flat always; where the dp x cp
    group spans nodes with more than one of its ranks on each, two_level (any stage) and node sharding (ZeRO >= 1,
    experts not on their own mesh: mpitrain's checks refuse the rest); with `allow` naming QUANTIZED_COMM, int8 and
    int4 gradient reductions (ZeRO >= 1) and int8 ZeRO-3 gathers (fp8's bytes and passes are int8's)."""
    try:
        k, n = dp_levels(mesh, gpus_per_node)  # a Layout has the degrees a config's parallel section has
    except ConfigError:  # nodes holding different numbers of the group's ranks: only the flat ring runs
        k, n = 1, 1
    modes = [{}]
    if k > 1 and n > 1:
        modes.append({"dp_reduce": "two_level"})
        if zero >= 1 and mesh.ep == 1 and mesh.etp in (0, mesh.tp):
            modes.append({"zero_shard": "node"})
    if QUANTIZED_COMM not in allow or zero == 0:
        return modes
    wires = [{}, {"zero_grad_reduce": "int8"}, {"zero_grad_reduce": "int4"}]
    if zero == 3:
        wires += [{"zero_gather_dtype": "int8"}, {"zero_gather_dtype": "int8", "zero_grad_reduce": "int8"}]
    return [{**mode, **wire} for mode in modes for wire in wires]


def hybrid_cp_worth_trying(cfg, mesh, gpus_per_node: int) -> bool:
    """Hybrid cp where the cp group spans nodes with more than one of its ranks on each (else it is the ring, or
    Ulysses) and a tp rank's query and K/V heads split over a node's cp ranks (where a exceeds the K/V heads the
    replicated K/V heads are not in the planner's activations)."""
    m = cfg.model
    if mesh.cp == 1 or m.n_head % mesh.tp or m.kv_heads % mesh.tp:
        return False
    try:
        inside = cp_ranks_per_node(mesh, gpus_per_node)
    except ConfigError:
        return False
    return 1 < inside < mesh.cp and (m.n_head // mesh.tp) % inside == 0 and (m.kv_heads // mesh.tp) % inside == 0

