"""The planner's communication terms (plan/cost.py's estimate calls them): where a group runs, what its ring
collectives cost, and the seconds per micro-batch and step of tp, cp, ep, pipeline and gradient traffic.

Collectives are rings, as groups count them: all-reduce moves 2(n-1)/n of the buffer per rank in 2(n-1) latency steps,
all-gather and reduce-scatter (n-1)/n in n-1. A group runs on the intra-node link when all its ranks share a node
(mesh order pp, dp, cp, tp with tp fastest: a group of size n and stride s spans n*s consecutive ranks), else on
the inter-node link. Gradient reduction overlaps the backward of the micro-batch that produces it (as far as the
cluster's comm_overlap lets it: 0 where collectives need the computing cores); tp collectives sit on the critical
path.

Context parallelism, per block and micro-batch on the cp group: the ring passes K/V c - 1 hops in forward and K/V
and the dK/dV accumulator c - 1 hops each in backward (parallel/context.py `ring_messages`,
layers/ring_attention.py), hidden behind the attention they feed (a forward run's Q K^T and P V, backward's four
gradient matmuls). Ulysses runs `ulysses_all_to_alls` all-to-alls of c - 1 steps each, exposed (the attention waits
for its heads): Q/K/V in one buffer and the output back in forward, dO and dQ/dK/dV in backward
(layers/ulysses_attention.py), the forward's again under full recomputation (selective keeps the exchanged arrays,
layers/recompute.py). Their bytes are parallel/context.py cp_bytes_per_step's; hybrid cp is plan/cost_sharding.py's.
"""
from __future__ import annotations

from mpitrain.config import Config
from mpitrain.layers.recompute import forward_runs
from mpitrain.parallel import schedule_costs
from mpitrain.parallel.context import cp_bytes_per_step, ring_messages, ulysses_all_to_alls
from mpitrain.plan.clusters import Cluster, Link
from mpitrain.plan.cost_sharding import hybrid_cp_seconds, sharding_rings
from mpitrain.plan.memory import rank_param_count, reduction_shares

# `work` below is plan/cost.py's RankWork (what one rank does in a step), passed in: cost.py imports this module


def tp_collectives_per_block(recompute: str, sequence_parallel: bool) -> int:
    """tp collectives one block runs per micro-batch, in all-gathers of one (b, T/cp, d) activation (an all-reduce
    counts two): the attention's and the MLP's entry and exit, forward and backward (8); the forward's 4 again under
    memory.recompute = full; under selective with sequence parallelism the qkv and MLP inputs' gathers again (their
    entry into the tp region is recomputed, layers/recompute.py restore: 10). Without sequence parallelism entering is
    a copy, nothing to recompute."""
    if recompute == "full":
        return 12
    return 10 if recompute == "selective" and sequence_parallel else 8


def pp_link_messages(kind: str, pp: int, virtual_stages: int) -> float:
    """Messages per micro-batch, both ways, on each link between neighbouring pipeline ranks: schedule_costs' count
    for the whole pipeline over its links, p - 1 in a line (1f1b: 2; a V: 4, both chunks each way), p where
    interleaving wraps the last rank back to the first."""
    links = pp if kind == "interleaved" and virtual_stages > 1 else pp - 1
    return schedule_costs.messages_per_micro_batch(kind, pp, virtual_stages) / links


def group_link(cluster: Cluster, size: int, stride: int) -> tuple[Link, bool]:
    """The link a group of `size` ranks `stride` apart runs on, and whether it crosses nodes."""
    crosses = size > 1 and size * stride > cluster.gpus_per_node
    return (cluster.inter if crosses else cluster.intra), crosses


def ring(link: Link, op: str, nbytes: float, n: int, times: float = 1.0) -> float:
    """Seconds of `times` ring collectives of an `nbytes` buffer over n ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor, steps = (2 * (n - 1) / n, 2 * (n - 1)) if op == "all_reduce" else ((n - 1) / n, n - 1)
    return times * link.seconds(factor * nbytes, steps)


def communication_seconds(cfg: Config, cluster: Cluster, work) -> tuple[dict, dict]:
    """Seconds per micro-batch of the collectives on the critical path ({"tp", "cp_ring", "ep_all_to_all",
    "pp_send"}), and which groups cross nodes ({"tp", "cp", "ep", "dp", "pp"})."""
    m_cfg, p, t, e, layers = cfg.model, cfg.parallel, cfg.train, work.element_bytes, work.layers
    activation = t.micro_batch * (m_cfg.seq_len // p.cp) * m_cfg.d_model * e  # one micro-batch's (b, T/c, d)
    tp_link, tp_crosses = group_link(cluster, p.tp, 1)
    tp_micro = ring(tp_link, "all_gather", activation, p.tp, work.tp_per_layer * layers)

    cp_crosses = group_link(cluster, p.cp, p.tp)[1]
    cp_micro = cp_seconds(cfg, cluster, work)

    ep_link, ep_crosses = group_link(cluster, p.ep, p.etp or p.tp)  # ep: consecutive holders of other tokens
    ep_micro = 0.0
    if work.moe.experts and p.ep > 1:
        routed = work.rows * work.moe.top_k * m_cfg.d_model * e
        ep_micro = 4 * work.moe_layers * ep_link.seconds((p.ep - 1) / p.ep * routed, p.ep - 1)

    pp_link, pp_crosses = group_link(cluster, p.pp, p.tp * p.cp * p.dp)
    message = activation / (p.tp if p.sequence_parallel else 1)
    pp_messages = pp_link_messages(p.schedule, p.pp, p.virtual_stages) if p.pp > 1 else 0
    pp_micro = pp_messages * pp_link.seconds(message, 1)

    dp_crosses = group_link(cluster, p.dp * p.cp, p.tp)[1]
    crosses = {"tp": tp_crosses, "cp": cp_crosses, "ep": ep_crosses and p.ep > 1, "dp": dp_crosses, "pp": pp_crosses}
    return {"tp": tp_micro, "cp_ring": cp_micro, "ep_all_to_all": ep_micro, "pp_send": pp_micro}, crosses


def cp_seconds(cfg: Config, cluster: Cluster, work) -> float:
    """Exposed seconds per micro-batch of context parallelism's messages (module docstring): Ulysses' all-to-alls,
    the ring's K/V passes beyond the attention they hide behind, or hybrid's both (plan/cost_sharding.py)."""
    m_cfg, p, e, layers, recompute = cfg.model, cfg.parallel, work.element_bytes, work.layers, cfg.memory.recompute
    if p.cp == 1:
        return 0.0
    link = group_link(cluster, p.cp, p.tp)[0]
    if p.cp_kind == "ulysses":  # not hidden: the attention waits for its heads
        steps = layers * ulysses_all_to_alls(recompute) * (p.cp - 1)
        return link.seconds(ulysses_bytes_per_micro_batch(cfg, e, layers), steps)
    # the attention the ring hides behind: Q K^T and P V in each forward run (4 rows T d / tp FLOPs), the four
    # gradient matmuls of backward (8)
    runs = forward_runs(recompute)
    attention_s = layers * (4 * runs + 8) * work.rows * m_cfg.seq_len * m_cfg.d_model / p.tp / \
        (cluster.peak_flops * cluster.matmul_efficiency)
    if p.cp_kind == "hybrid":  # Ulysses inside the node, the ring across (plan/cost_sharding.py)
        return hybrid_cp_seconds(cfg, cluster, e, layers, attention_s)
    kv_heads = m_cfg.kv_heads // p.tp if m_cfg.kv_heads % p.tp == 0 else 1
    sent = cp_bytes_per_step("ring", cfg.train.micro_batch, m_cfg.seq_len, m_cfg.n_head // p.tp, kv_heads,
                             m_cfg.head_dim, e, p.cp, blocks=layers, recompute=recompute)["cp_ring"]
    ring_s = link.seconds(sent, layers * ring_messages(recompute, p.cp))
    return max(0.0, ring_s - cluster.comm_overlap * attention_s)  # hidden behind the attention it feeds


def ulysses_bytes_per_micro_batch(cfg: Config, element_bytes: int, layers: int) -> float:
    """Bytes one rank sends on the cp group's all-to-alls per micro-batch under parallel.cp_kind = 'ulysses':
    parallel/context.py's cp_bytes_per_step over this rank's `layers` attention blocks (Q/K/V and O in forward, dO
    and dQ/dK/dV in backward, each (c-1)/c of this rank's tensors; full recomputation repeats the forward's)."""
    m, p = cfg.model, cfg.parallel
    kv_heads = m.kv_heads // p.tp if m.kv_heads % p.tp == 0 else 1
    sent = cp_bytes_per_step("ulysses", cfg.train.micro_batch, m.seq_len, m.n_head // p.tp, kv_heads, m.head_dim,
                             element_bytes, p.cp, blocks=layers, recompute=cfg.memory.recompute)
    return sent["all_to_all"]


def gradient_sync_seconds(cfg: Config, cluster: Cluster, work, compute_micro: float,
                          transient: float) -> tuple[float, float, float]:
    """(ZeRO's exposed gathers and reduce-scatters per micro-batch, the step's exposed gradient reduction, ZeRO-1/2's
    parameter all-gather), in seconds."""
    p, e = cfg.parallel, work.element_bytes
    reduced = sharding_rings(cfg, cluster, reduction_shares(cfg)) or reduction_rings(cfg, cluster)  # cost_sharding.py
    grad_bytes = 4 if cfg.precision.grad_reduce == "float32" or e > 4 else 2
    grad_bytes = max(grad_bytes, e)
    hidden_micro = cluster.comm_overlap * compute_micro * 2 / 3  # what a micro-batch's backward can hide
    zero_micro = 0.0
    if p.zero == 3:  # gathered in forward and again in backward, hidden behind the compute they precede
        gathers = reduced("all_gather", e, 2)
        zero_micro = max(0.0, gathers - cluster.comm_overlap * compute_micro)
    if p.zero in (2, 3):  # reduce-scatter every micro-batch, behind that micro-batch's backward
        reduce_micro = reduced("reduce_scatter", grad_bytes)
        zero_micro += max(0.0, reduce_micro - hidden_micro)
        reduce_exposed = min(reduce_micro, hidden_micro) * 0.05  # the last bucket
    else:
        reduce_s = reduced("all_reduce" if p.zero == 0 else "reduce_scatter", grad_bytes)
        reduce_exposed = max(0.0, reduce_s - hidden_micro) + \
            cluster.comm_overlap * reduce_s * min(1.0, transient / max(rank_param_count(cfg) * e, 1))  # last bucket
    # ZeRO-1/2's updated parameters are gathered bucket by bucket ahead of the next step's first forward (Megatron's
    # --overlap-param-gather), hidden behind that micro-batch's forward as far as comm_overlap lets
    gather_params = max(0.0, reduced("all_gather", e) - cluster.comm_overlap * compute_micro / 3) \
        if p.zero in (1, 2) else 0.0
    return zero_micro, reduce_exposed, gather_params


def reduction_rings(cfg: Config, cluster: Cluster):
    """rings(op, bytes_per_param, times=1): seconds of ring collectives over this rank's gradients or parameters,
    each share over its own group (plan/memory.py reduction_shares): the dense ones over dp x cp, experts under
    ep > 1 over expert_dp (the expert mesh's outer axis: ranks etp * ep apart)."""
    p = cfg.parallel
    strides = (p.tp, (p.etp or p.tp) * p.ep)  # the dense share first, then the experts'
    shares = [(count, ranks, group_link(cluster, ranks, stride)[0])
              for (count, ranks), stride in zip(reduction_shares(cfg), strides)]

    def rings(op: str, bytes_per_param: float, times: float = 1.0) -> float:
        return sum(ring(link, op, count * bytes_per_param, ranks, times) for count, ranks, link in shares)
    return rings


