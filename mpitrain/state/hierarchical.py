"""Hierarchical data parallelism: the gradient reduction (and ZeRO's sharding) in two levels, inside a node and
across nodes, so that the slow links between nodes carry 1/k of the bytes (k = data-parallel ranks per node).

    parallel.dp_reduce = "two_level"   the same shards as a flat ring, each collective in two levels
                                       (comm/two_level.py TwoLevelGroup); plain data parallelism and ZeRO-1/2/3
    parallel.zero_shard = "node"       hybrid sharding (FSDP's HYBRID_SHARD, DeepSpeed's hpZ / MiCS): ZeRO shards
                                       over the k ranks of a node, one copy per node (NodeShardGroup): parameters
                                       gathered inside the node only, gradients reduce-scattered inside, then
                                       all-reduced across nodes on the shard. ZeRO-1/2/3; at stages 1 and 2 it
                                       shards the optimizer state (and gradients) over k ranks instead of N

The two levels are those of the group the gradients are summed over: dp, or dp_cp when cp > 1 (context-parallel
ranks hold other tokens of the same sequences, so their gradients are summed with the dp ranks' and ZeRO shards
over dp x cp): splitting dp alone would leave the cp part of that sum flat. Experts under parallel.ep > 1 (summed
over expert_dp) stay flat.

Bytes crossing nodes per rank and step (ring algorithms, as the groups count them; Psi = the bytes of the
gradients, padded; n nodes; m micro-batches; g = ZeRO-3's gathers per micro-batch, 2, or 1 when parameters are
kept from forward to backward):

    layout                           crosses nodes                     a flat ring over N = n k ranks sends
    zero 0, two_level                2 (n-1)/n Psi/k                   2 (N-1)/N Psi
    zero 1, two_level                2 (n-1)/n Psi/k                   2 (N-1)/N Psi
    zero 2, two_level                (m + 1) (n-1)/n Psi/k             (m + 1) (N-1)/N Psi
    zero 3, two_level                (g + 1) m (n-1)/n Psi/k           (g + 1) m (N-1)/N Psi
    zero 1, zero_shard node          2 (n-1)/n Psi/k                   (gathers stay inside the node)
    zero 2 or 3, zero_shard node     2 m (n-1)/n Psi/k

`cross_node_bytes` and `flat_bytes` say the same as functions (the planner's and the tests').
"""
from __future__ import annotations

from fractions import Fraction

from mpitrain.comm.nodes import split_by_node
from mpitrain.comm.two_level import NodeShardGroup, TwoLevelGroup, node_major_order
from mpitrain.layout_checks import dp_split_kind


def hierarchical_group(parallel, mesh, group):
    """The group a state reduces over and shards by: `group` (flat), its two-level form (dp_reduce = two_level) or
    the node's part of it (zero_shard = node, ZeRO only)."""
    node_shard = parallel.zero_shard == "node" and parallel.zero > 0
    if not node_shard and parallel.dp_reduce == "flat":
        return group
    kind = dp_split_kind(parallel)
    inside, across = mesh.inside_node[kind], mesh.across_nodes[kind]
    members = group.world_ranks  # the two levels must be those of the reduction group itself
    assert split_by_node(members, mesh.nodes, mesh.rank) == (inside.world_ranks, across.world_ranks), kind
    if node_shard:
        return NodeShardGroup(inside, across)
    return TwoLevelGroup(group, inside, across, node_major_order(members, mesh.nodes))


def _exchanges(zero: int, zero_shard: str, micro_batches: int, reshard_after_forward: bool) -> tuple[int, int]:
    """(all-reduces, reduce-scatters + all-gathers) of the gradient geometry a rank takes part in per step."""
    if zero == 0:
        return 1, 0
    reductions = 1 if zero == 1 else micro_batches
    if zero_shard == "node":
        return reductions, 0  # the all-gathers stay inside the node
    gathers = micro_batches * (2 if reshard_after_forward else 1) if zero == 3 else 1
    return 0, reductions + gathers


def cross_node_bytes(zero: int, zero_shard: str, psi_bytes: int, ranks_per_node: int, nodes: int,
                     micro_batches: int = 1, reshard_after_forward: bool = True) -> Fraction:
    """Bytes one rank sends across nodes per step with hierarchical data parallelism (module table): each
    collective's across-node level runs on Psi / k among n ranks."""
    all_reduces, halves = _exchanges(zero, zero_shard, micro_batches, reshard_after_forward)
    piece = Fraction(psi_bytes, ranks_per_node)
    return (2 * all_reduces + halves) * Fraction(nodes - 1, nodes) * piece


def flat_bytes(zero: int, psi_bytes: int, ranks: int, micro_batches: int = 1,
               reshard_after_forward: bool = True) -> Fraction:
    """Bytes one rank sends per step over a flat ring of `ranks` data-parallel ranks (every byte on the ring,
    which crosses nodes at every node boundary)."""
    all_reduces, halves = _exchanges(zero, "world", micro_batches, reshard_after_forward)
    return (2 * all_reduces + halves) * Fraction(ranks - 1, ranks) * psi_bytes
