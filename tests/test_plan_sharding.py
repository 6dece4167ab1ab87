"""The planner's terms for hierarchical data parallelism, quantized ZeRO and hybrid cp (plan/cost_sharding.py) are
each feature's own formula: the bytes that cross nodes are state/hierarchical.py's cross_node_bytes and
state/hierarchical_quantized.py's cross_node_step_bytes, hybrid cp's bytes on each link parallel/context.py's
cp_bytes_per_step, and the ranks per node the training code's node split. tests/test_plan_dryrun.py checks the
memory rows of node-sharded ZeRO against the state the training code builds."""
from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from mpitrain.cli import main
from mpitrain.comm.mesh import Degrees, split_by_node_members
from mpitrain.comm.nodes import NodeLayout
from mpitrain.config import Config, load_config, resolve_layout
from mpitrain.errors import ConfigError, LayoutError
from mpitrain.layers import hybrid_attention
from mpitrain.layers.cp_cores import RingCore
from mpitrain.parallel.context import cp_bytes_per_step
from mpitrain.plan.clusters import Link, load_cluster
from mpitrain.plan.cost import Layout, estimate
from mpitrain.plan.cost_sharding import QUANTIZED_COMM, ranks_per_node, sharding_rings
from mpitrain.plan.layout import layout_for, parse_layout
from mpitrain.plan.memory import memory_report, rank_param_count
from mpitrain.plan.presets import model_config
from mpitrain.plan.search import candidate_layouts
from mpitrain.state.hierarchical import cross_node_bytes
from mpitrain.state.hierarchical_quantized import cross_node_step_bytes
from mpitrain.state.zero_quantized import QuantizedComm
from tests.test_plan_features import LATENCY_ONLY, cp_messages_per_block

FREE = Link(bandwidth=1e30, efficiency=1.0, latency=0.0)  # seconds ~ 0
ONE_BYTE_PER_S = Link(bandwidth=1.0, efficiency=1.0, latency=0.0)  # seconds = bytes


def test_ranks_per_node_is_the_training_codes_node_split():
    checked = 0
    for gpus_per_node in (4, 8):
        for tp in (1, 2, 4, 8, 16):
            for dp in (1, 2, 3, 4, 6, 8):
                degrees = Degrees(dp=dp, tp=tp, pp=2)
                if degrees.world_size % gpus_per_node:
                    continue
                nodes = NodeLayout.blocks(degrees.world_size, 0, degrees.world_size // gpus_per_node)
                try:
                    inside = len(split_by_node_members("dp", 0, degrees, nodes)[0])
                except LayoutError:
                    with pytest.raises(ConfigError, match="unevenly"):
                        ranks_per_node(dp, tp, gpus_per_node)
                    continue
                assert ranks_per_node(dp, tp, gpus_per_node) == inside, (dp, tp, gpus_per_node)
                checked += 1
    assert checked > 20


def sync_config(zero: int, dp_reduce: str = "flat", zero_shard: str = "world", grad: str = "exact",
                gather: str = "same", tp: int = 1) -> Config:
    cfg = Config()
    p = cfg.parallel
    p.zero, p.dp_reduce, p.zero_shard, p.zero_grad_reduce, p.zero_gather_dtype, p.tp = \
        zero, dp_reduce, zero_shard, grad, gather, tp
    p.zero_quant_block = 256
    return cfg


def across_bytes(cfg: Config, elements: int, ranks: int, gpus_per_node: int, element_bytes: int, micro_batches: int):
    """Bytes one rank sends across nodes per step through sharding_rings, in the order plan/cost.py's
    gradient_sync_seconds issues ZeRO's collectives (the inter-node link at 1 byte/s, the node's free)."""
    cluster = replace(load_cluster("h100"), intra=FREE, inter=ONE_BYTE_PER_S, gpus_per_node=gpus_per_node)
    rings = sharding_rings(cfg, cluster, [(elements, ranks)])
    zero, m = cfg.parallel.zero, micro_batches
    if zero == 0:
        return rings("all_reduce", element_bytes)
    gathers = rings("all_gather", element_bytes, 2 * m) if zero == 3 else rings("all_gather", element_bytes)
    return gathers + rings("reduce_scatter", element_bytes, 1 if zero == 1 else m)


@pytest.mark.parametrize("zero, mode", [(0, "two_level"), (1, "two_level"), (2, "two_level"), (3, "two_level"),
                                        (1, "node"), (2, "node"), (3, "node")])
def test_cross_node_bytes_are_state_hierarchical(zero, mode):
    k, n, m, e = 4, 3, 5, 2
    elements = k * n * 1000
    cfg = sync_config(zero, dp_reduce="two_level" if mode == "two_level" else "flat",
                      zero_shard="node" if mode == "node" else "world", tp=2)
    sent = across_bytes(cfg, elements, k * n, gpus_per_node=2 * k, element_bytes=e, micro_batches=m)
    expected = cross_node_bytes(zero, "node" if mode == "node" else "world", elements * e, k, n, m)
    assert sent == pytest.approx(float(expected), rel=1e-12) and sent > 0


@pytest.mark.parametrize("zero, mode, grad, gather", [
    (1, "two_level", "int8", "same"), (2, "two_level", "int4", "same"), (3, "two_level", "int8", "int8"),
    (3, "two_level", "exact", "fp8"), (1, "node", "int4", "same"), (3, "node", "int8", "int8")])
def test_quantized_cross_node_bytes_are_zero_plus_plus(zero, mode, grad, gather):
    """Codes and fp32 scales on the wire, each level quantizing its own sum: cross_node_step_bytes."""
    k, n, m, e, block = 4, 2, 3, 2, 256
    elements = k * n * block * 3
    cfg = sync_config(zero, dp_reduce="two_level" if mode == "two_level" else "flat",
                      zero_shard="node" if mode == "node" else "world", grad=grad, gather=gather)
    sent = across_bytes(cfg, elements, k * n, gpus_per_node=k, element_bytes=e, micro_batches=m)
    shard = elements // (k * n) if mode == "two_level" else elements // k  # of the group ZeRO shards over
    expected = cross_node_step_bytes(zero, "node" if mode == "node" else "world", [shard], n, e, e,
                                     QuantizedComm(gather, grad, block), m)
    assert sent == pytest.approx(float(sum(expected.values())), rel=1e-12) and sent > 0


def test_flat_quantized_reduction_sends_codes_and_scales():
    elements, ranks, block = 8 * 512, 8, 256
    cfg = sync_config(2, grad="int4")
    cluster = replace(load_cluster("h100"), intra=ONE_BYTE_PER_S, inter=ONE_BYTE_PER_S, gpus_per_node=8)
    sent = sharding_rings(cfg, cluster, [(elements, ranks)])("reduce_scatter", 4)
    shard = elements // ranks
    assert sent == (ranks - 1) * (shard // 2 + 4 * shard // block)  # int4 codes, one fp32 scale per block


def long_context_llama():
    cfg, _ = model_config("llama3-8b")  # 32 query heads, 8 K/V heads
    cfg.model.seq_len, cfg.train.global_batch = 32768, 8
    return cfg


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_hybrid_cp_bytes_on_each_link_are_context_cp_bytes_per_step(recompute):
    """tp 2 x cp 8 on nodes of 8: a = 4 cp ranks per node (Ulysses on the node's link), the ring over 2 nodes."""
    cfg = long_context_llama()
    layout = Layout(dp=1, tp=2, pp=1, cp=8, zero=1, recompute=recompute, cp_kind="hybrid")
    base = replace(load_cluster("h100"), comm_overlap=0.0)  # nothing hidden: the part is the bytes
    sent = cp_bytes_per_step("hybrid", 1, 32768, 16, 4, 128, 2, 8, inside=4, blocks=32, recompute=recompute)
    assert sent["cp_ring"] > 0 and sent["all_to_all"] > 0
    for intra, inter, counter in ((FREE, ONE_BYTE_PER_S, "cp_ring"), (ONE_BYTE_PER_S, FREE, "all_to_all")):
        result = estimate(cfg, layout, replace(base, intra=intra, inter=inter))
        assert result["parts"]["cp_ring"] == pytest.approx(result["micro_batches"] * sent[counter], rel=1e-9)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_hybrid_cp_latency_steps_are_the_models_messages(recompute):
    """cp 4 as 2 cp ranks on each of 2 nodes: the all-to-alls inside the node (4 per block, 6 under full
    recomputation) and the ring's hops across, as many as a block's forward and backward send."""
    counted = cp_messages_per_block("hybrid", recompute, 4, inside=2)
    cfg, _ = model_config("llama3-8b")
    layout = Layout(dp=1, tp=1, pp=1, cp=4, zero=1, recompute=recompute, cp_kind="hybrid")
    base = replace(load_cluster("h100"), gpus_per_node=2, comm_overlap=0.0)
    for intra, inter, steps in ((LATENCY_ONLY, FREE, counted["all_to_all"] * (2 - 1)),
                                (FREE, LATENCY_ONLY, counted["cp_ring"])):
        result = estimate(cfg, layout, replace(base, intra=intra, inter=inter))
        assert result["parts"]["cp_ring"] == pytest.approx(result["micro_batches"] * cfg.model.n_layer * steps,
                                                           rel=1e-12)


def test_new_parts_add_up_and_node_shards_hold_more():
    cfg, _ = model_config("llama3-70b")
    cluster = load_cluster("h100")
    plain = Layout(dp=16, tp=4, pp=1, zero=3, micro_batch=1, recompute="full")
    results = {extras: estimate(cfg, Layout(**{**plain.__dict__, **dict(extras)}), cluster) for extras in (
        (), (("dp_reduce", "two_level"),), (("zero_shard", "node"),),
        (("zero_grad_reduce", "int4"), ("zero_gather_dtype", "fp8"), ("dp_reduce", "two_level")))}
    results["hybrid"] = estimate(long_context_llama(), Layout(dp=1, tp=2, pp=2, cp=8, cp_kind="hybrid", zero=1,
                                                              recompute="full"), cluster)
    for result in results.values():
        assert sum(result["parts"].values()) == pytest.approx(result["step_s"], rel=1e-12)
    flat, node = results[()], results[(("zero_shard", "node"),)]
    assert node["memory"]["rows"]["optimizer"] == pytest.approx(8 * flat["memory"]["rows"]["optimizer"])  # 16 -> 2
    quantized = results[(("zero_grad_reduce", "int4"), ("zero_gather_dtype", "fp8"), ("dp_reduce", "two_level"))]
    assert quantized["parts"]["quantize"] > 0 and flat["parts"]["quantize"] == 0


def test_the_search_tries_node_aware_sync_where_dp_crosses_nodes_and_quantized_only_when_asked():
    cfg, _ = model_config("gpt3-350m")  # 16 heads, 24 layers
    cfg.train.global_batch = 32
    cluster = load_cluster("h100")

    def extras(allow=()):
        return {(layout.tp, layout.pp, layout.zero, layout.dp_reduce, layout.zero_shard, layout.zero_grad_reduce,
                 layout.zero_gather_dtype) for group in candidate_layouts(cfg, 32, cluster, allow) for layout in group}
    plain, allowed = extras(), extras((QUANTIZED_COMM,))
    assert {(e[3], e[4]) for e in plain if e[0] == 2 and e[1] == 1 and e[2] == 3} == \
        {("flat", "world"), ("two_level", "world"), ("flat", "node")}  # dp 16 over 4 nodes
    assert all(e[3:5] == ("flat", "world") for e in plain if e[0] * e[1] >= 8 * 4)  # dp within a node
    assert all(e[5:] == ("exact", "same") for e in plain)
    assert {e[5] for e in allowed} == {"exact", "int8", "int4"} and {e[6] for e in allowed if e[2] == 3} == \
        {"same", "int8"} and all(e[5] == "exact" for e in allowed if e[2] == 0)


def test_the_search_tries_hybrid_cp_where_cp_crosses_nodes():
    cfg = long_context_llama()
    kinds = {(layout.tp, layout.cp, layout.cp_kind) for group in candidate_layouts(copy.deepcopy(cfg), 32,
                                                                                    load_cluster("h100"))
             for layout in group}
    assert (2, 8, "hybrid") in kinds and (4, 4, "hybrid") in kinds
    assert not any(kind == "hybrid" and tp * cp <= 8 for tp, cp, kind in kinds)  # inside a node: Ulysses


def test_hybrid_activations_are_the_rings_where_the_kv_heads_divide_over_a_node():
    """The planner's rank model counts hybrid cp as the ring (its groups are unknown there); the search tries hybrid
    only where a node's a cp ranks divide a tp rank's K/V heads, where the two save the same bytes."""
    def nbytes(arrays):
        return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in arrays)
    for heads, kv_heads, inside in ((32, 8, 2), (32, 8, 8), (16, 4, 4), (64, 8, 4), (32, 2, 8)):
        ring = nbytes(RingCore(None).saved_arrays(2, heads, kv_heads, 512, 128, np.float16))
        hybrid = nbytes(hybrid_attention.saved_arrays(2, heads, kv_heads, 512, 128, inside, np.float16))
        assert hybrid == ring if kv_heads % inside == 0 else hybrid > ring  # replicated K/V heads: more


@pytest.mark.parametrize("text, key", [("dp16 zero1 gather-int8", "parallel.zero_gather_dtype"),
                                       ("dp16 zero0 grad-int8", "parallel.zero_grad_reduce"),
                                       ("dp16 zero0 shard-node", "parallel.zero_shard")])
def test_a_layout_mpitrain_refuses_is_refused_by_the_estimate_naming_the_key(text, key):
    cfg, _ = model_config("llama3-8b")
    with pytest.raises(ConfigError, match=key):
        estimate(cfg, layout_for(parse_layout(text), 16)[0], load_cluster("h100"))


NODE_SHARDED = ["memory", "configs/tiny.toml", "-n", "8", "--set", "parallel.zero=1", "--set",
                "parallel.zero_shard=node", "--set", "train.global_batch=32"]


def test_memory_command_counts_node_shards_with_the_node_size_and_refuses_without_one():
    """`mpitrain memory` under zero_shard = node: the optimizer row sharded over a node's ranks (--gpus-per-node, or
    MPITRAIN_FAKE_NODES as the dry run and the training code split the world), never silently over the world."""
    runner = CliRunner()
    refused = runner.invoke(main, NODE_SHARDED, env={"MPITRAIN_FAKE_NODES": None})
    assert refused.exit_code == 1 and "--gpus-per-node" in refused.output and \
        len(refused.output.strip().splitlines()) == 1, refused.output
    uneven = runner.invoke(main, [*NODE_SHARDED, "--gpus-per-node", "3"], env={"MPITRAIN_FAKE_NODES": None})
    assert uneven.exit_code == 1 and "--gpus-per-node 3" in uneven.output, uneven.output
    cfg = load_config("configs/tiny.toml", ["parallel.zero=1", "parallel.zero_shard=node", "train.global_batch=32"])
    resolve_layout(cfg, 8)
    node, world = (memory_report(cfg, rank_param_count(cfg), gpus_per_node=k)["bytes"]["optimizer"] for k in (4, 8))
    assert node == 2 * world  # dp 8: shards over the 4 ranks of a node hold twice the world's
    row = f"  optimizer    {node / 2**20:>10.2f} MiB"
    for args, env in ((["--gpus-per-node", "4"], {"MPITRAIN_FAKE_NODES": None}), ([], {"MPITRAIN_FAKE_NODES": "2"})):
        done = runner.invoke(main, [*NODE_SHARDED, *args, "--dry-run"], env=env)
        assert done.exit_code == 0, done.output
        assert "N = 4 (ZeRO sharded inside nodes of 4 GPUs)" in done.output and row in done.output, done.output
        dry = done.output.split("dry run")[1].splitlines()[1:]
        assert len(dry) == 3 and all(line.endswith("equal") for line in dry), done.output
