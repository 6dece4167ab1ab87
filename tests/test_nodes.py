"""Node layout (comm/nodes.py), the node-aware mesh (placement line, tp/ep inside a node) and the restarted attempt's
first line (resilience/restart.py). Pure functions, plus one MPI run; the same on a real two-node SLURM cluster is in
tests/test_slurm.py."""
from __future__ import annotations

import json

import pytest

from mpitrain.comm.mesh import (
    Degrees,
    all_groups_of,
    check_fast_groups_in_node,
    check_node_splits,
    group_members,
    groups_crossing_nodes,
)
from mpitrain.comm.nodes import NodeLayout, fake_node_count, split_by_node
from mpitrain.errors import LayoutError
from mpitrain.resilience.restart import restart_banner
from tests.mpi_helpers import describe, run_python_mpi


def two_nodes(rank: int = 0, per_node: int = 2) -> NodeLayout:
    """2 x per_node ranks, node by node (SLURM's block distribution), names as on the CI cluster."""
    leaders = [0] * per_node + [per_node] * per_node
    return NodeLayout.from_leaders(rank, leaders, ["node1"] * per_node + ["node2"] * per_node)


def test_layout_from_each_ranks_node_leader():
    # ranks 0 and 2 share node "b" (leader 0); 1 and 3 share "a" (leader 1): nodes numbered by their lowest rank
    layout = NodeLayout.from_leaders(3, [0, 1, 0, 1], ["b", "a", "b", "a"])
    assert layout.node_of_rank == (0, 1, 0, 1) and layout.names == ("b", "a")
    assert (layout.n_nodes, layout.node, layout.node_name, layout.node_local_rank, layout.ranks_per_node) == \
        (2, 1, "a", 1, 2)
    assert layout.ranks_on(0) == [0, 2] and layout.nodes_of([3, 0, 1]) == [1, 0]
    assert layout.describe() == "2 nodes: b ranks 0,2, a ranks 1,3"
    assert two_nodes(per_node=3).describe() == "2 nodes: node1 ranks 0-2, node2 ranks 3-5"
    assert NodeLayout.single(4, 2, "vm").describe() == "1 node: vm ranks 0-3"


def test_all_groups_of_is_group_members():
    for degrees in (Degrees(dp=2, tp=2), Degrees(dp=4, pp=2, ep=2), Degrees(dp=2, tp=2, pp=2, cp=2, ep=2)):
        for kind in ("world", "dp", "tp", "pp", "cp", "ep", "expert_dp", "dp_cp"):
            groups = all_groups_of(kind, degrees)
            assert sorted(rank for group in groups for rank in group) == list(range(degrees.world_size)), kind
            for group in groups:
                assert all(group_members(kind, rank, degrees) == group for rank in group), (kind, group)


def test_which_groups_cross_nodes():
    assert groups_crossing_nodes(Degrees(dp=2, tp=2), two_nodes()) == ["world", "dp", "expert_dp", "dp_cp"]
    assert groups_crossing_nodes(Degrees(tp=4), two_nodes()) == ["world", "tp"]
    assert groups_crossing_nodes(Degrees(dp=2, tp=2), NodeLayout.single(4)) == []


def test_tensor_and_expert_groups_across_nodes_are_refused_unless_allowed():
    check_fast_groups_in_node(Degrees(dp=2, tp=2), two_nodes())  # tp pairs inside each node
    with pytest.raises(LayoutError) as refused:
        check_fast_groups_in_node(Degrees(tp=4), two_nodes())
    message = str(refused.value)
    assert message.startswith("parallel.tp = 4 puts tp group [0, 1, 2, 3] on several nodes (node1, node2): tp "
                              "exchanges activations inside every layer and needs the fast links inside a node")
    assert "parallel.allow_cross_node_tp = true" in message and "\n" not in message
    with pytest.raises(LayoutError, match=r"parallel.tp = 2 puts tp group \[0, 1\] on several nodes"):
        check_fast_groups_in_node(Degrees(tp=2), two_nodes(per_node=1))
    with pytest.raises(LayoutError, match=r"parallel.ep = 4 puts ep group \[0, 1, 2, 3\] on several nodes"):
        check_fast_groups_in_node(Degrees(dp=4, ep=4), two_nodes())
    check_fast_groups_in_node(Degrees(dp=4, ep=2), two_nodes())  # expert pairs inside a node; expert_dp crosses
    check_fast_groups_in_node(Degrees(tp=4), two_nodes(), allow_cross_node_tp=True)


MESH_ON_NODES = """
from mpi4py import MPI
from mpitrain.comm import Mesh, abort_on_error
from mpitrain.comm.nodes import NodeLayout, discover_nodes
from mpitrain.errors import LayoutError

world = MPI.COMM_WORLD
with abort_on_error(world):
    r = world.rank
    here = discover_nodes(world)  # one machine: one node
    assert here.n_nodes == 1 and here.node_local_rank == r and here.ranks_per_node == 4, here
    mesh = Mesh(world, dp=2, tp=2)
    assert mesh.nodes == here
    assert mesh.describe_placement().startswith(f"placement: 1 node: {here.node_name} ranks 0-3; groups crossing "
                                                "nodes: none; inside one node: dp, tp")
    # the same ranks as if on two nodes (what a shared-memory split reports on a cluster)
    pretend = NodeLayout.from_leaders(r, [0, 0, 2, 2], ["node1", "node1", "node2", "node2"])
    mesh = Mesh(world, dp=2, tp=2, nodes=pretend)
    assert mesh.describe_placement() == ("placement: 2 nodes: node1 ranks 0-1, node2 ranks 2-3; groups crossing "
                                         "nodes: dp; inside one node: tp"), mesh.describe_placement()
    assert mesh.describe_layout() == "dp=2 tp=2 pp=1 cp=1 ep=1 on 2 nodes: node1 ranks 0-1, node2 ranks 2-3"
    try:
        Mesh(world, tp=4, nodes=pretend)
        raise AssertionError("tp across nodes accepted")
    except LayoutError as exc:
        assert "allow_cross_node_tp" in str(exc)
    Mesh(world, tp=4, nodes=pretend, allow_cross_node_tp=True)
    # two-level groups of dp (4 ranks on 2 nodes): inside {0,1},{2,3}; across {0,2},{1,3}
    mesh = Mesh(world, dp=4, nodes=pretend, split_by_node=("dp",))
    inside, across = mesh.inside_node["dp"], mesh.across_nodes["dp"]
    assert (inside.size, inside.rank, across.size, across.rank) == (2, r % 2, 2, r // 2), (inside, across)
    assert inside.all_reduce_scalar(float(r)) == (1.0 if r < 2 else 5.0)
    assert across.all_reduce_scalar(float(r)) == (2.0 if r % 2 == 0 else 4.0)
    assert len(mesh.all_groups()) == 10
    if r == 0:
        print("OK", flush=True)
"""


def test_split_by_node_gives_both_levels_of_a_group():
    layout = NodeLayout.blocks(8, 5, 2)  # ranks 0-3 on fakenode0, 4-7 on fakenode1
    assert layout.names == ("fakenode0", "fakenode1") and layout.node == 1
    assert split_by_node(list(range(8)), layout, 5) == ([4, 5, 6, 7], [1, 5])
    assert split_by_node([1, 3, 5, 7], layout, 7) == ([5, 7], [3, 7])  # a strided group: position 1 on each node
    assert split_by_node([0, 1], layout, 1) == ([0, 1], [1])  # all on one node: across is the rank alone
    with pytest.raises(LayoutError, match=r"different number of ranks on each node \(fakenode0: 3, fakenode1: 1\)"):
        split_by_node([0, 1, 2, 4], layout, 4)
    assert fake_node_count(8, {}) == 0 and fake_node_count(8, {"MPITRAIN_FAKE_NODES": "2"}) == 2
    with pytest.raises(LayoutError, match="MPITRAIN_FAKE_NODES='3' must be a node count that divides the 8 ranks"):
        fake_node_count(8, {"MPITRAIN_FAKE_NODES": "3"})


def test_every_rank_refuses_an_unbalanced_node_split_even_of_a_group_it_is_not_in():
    """dp 3 x tp 2 with rank 5 alone on a node: dp group [1, 3, 5] has 2 + 1 ranks per node; rank 0, whose group
    [0, 2, 4] is on one node, refuses too (else it would wait in the next Split for ranks that stopped)."""
    nodes = NodeLayout.from_leaders(0, [0, 0, 0, 0, 0, 5], ["a"] * 5 + ["b"])
    with pytest.raises(LayoutError, match=r"the dp group.s two levels .*: group \[1, 3, 5\] has a different number"):
        check_node_splits(("tp", "dp"), Degrees(dp=3, tp=2), nodes)
    check_node_splits(("tp",), Degrees(dp=3, tp=2), nodes)  # tp pairs: each on one node


def test_mesh_learns_nodes_and_names_the_groups_that_cross_them():
    result = run_python_mpi(4, MESH_ON_NODES, timeout=120)
    assert result.returncode == 0 and "OK" in result.stdout, describe(result)


def test_restart_banner(tmp_path):
    checkpoint = tmp_path / "step_00000010"
    checkpoint.mkdir()
    (checkpoint / "index.json").write_text(json.dumps({"step": 10, "created": 1000.0}))
    layout = "dp=1 tp=2 pp=1 cp=1 ep=1 on 1 node: node1 ranks 0-1"
    assert restart_banner(checkpoint, layout, {}, 1012.5) is None  # a first attempt says nothing
    assert restart_banner(checkpoint, layout, {"MPITRAIN_ATTEMPT": "0"}, 1012.5) is None
    line = restart_banner(checkpoint, layout, {"MPITRAIN_ATTEMPT": "1", "MPITRAIN_LEFT_OUT": "node2"}, 1012.5)
    assert line.startswith(f"restart (attempt 1): left out node node2; resuming from {checkpoint} (step 10) on "
                           f"{layout}; time lost so far 12.5 s (from the save of step 10 at "), line
    line = restart_banner(tmp_path / "missing", layout, {"MPITRAIN_ATTEMPT": "2"}, 1012.5)
    assert "no node left out" in line and "time lost not known" in line
