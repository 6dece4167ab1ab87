"""Experts on their own mesh (parallel folding): attention tp x cp x dp, experts etp x ep x edp over the same ranks of
a pipeline stage. ep drawn from dp x cp (and from the tp ranks' token shares at etp = 1), MoE under context
parallelism, whole experts beside tensor parallelism; every layout against one process in float64."""
from __future__ import annotations

import numpy as np
import pytest

from mpitrain.comm.mesh import Degrees, expert_coordinates, group_members, validate_degrees
from mpitrain.config import load_config, resolve_layout
from mpitrain.errors import ConfigError, LayoutError
from tests.test_moe import assert_same_run, train_run

GPT2 = ["model.moe={experts = 4, top_k = 1}", "model.arch=gpt2"]
LLAMA = ["model.moe={experts = 8, top_k = 2, every = 2}", "model.arch=llama", "model.n_kv_head=2"]


# ---- the expert mesh, no MPI -------------------------------------------------------------------------------------
def test_ep_is_drawn_from_cp_and_dp_on_consecutive_ranks():
    d = validate_degrees(4, dp=2, cp=2, ep=2)
    assert group_members("cp", 0, d) == [0, 1] and group_members("dp", 0, d) == [0, 2]
    assert group_members("ep", 0, d) == [0, 1]  # the two cp ranks of dp rank 0: ep drawn from cp
    assert group_members("expert_dp", 0, d) == [0, 2]  # experts 0-1 on dp rank 0 and 1
    d4 = validate_degrees(4, dp=2, cp=2, ep=4)
    assert group_members("ep", 3, d4) == [0, 1, 2, 3] and group_members("expert_dp", 3, d4) == [3]
    assert d4.expert_dp == 1 and d.expert_dp == 2


def test_whole_experts_beside_tp_draw_ep_from_the_token_shares():
    """tp 2 x dp 2 with etp 1: the tp ranks hold the same tokens, each routes its half, so the tp pair is the first
    thing ep is drawn from; with etp = tp the experts split over tp and ep comes from dp (the earlier layout)."""
    whole = validate_degrees(4, dp=2, tp=2, ep=2, etp=1)
    assert group_members("ep", 2, whole) == [2, 3] and group_members("expert_dp", 2, whole) == [0, 2]
    assert expert_coordinates(3, whole) == (0, 1, 1, 0)  # (pp, edp, ep, etp)
    split = validate_degrees(4, dp=2, tp=2, ep=2)
    assert group_members("ep", 1, split) == [1, 3] and group_members("expert_dp", 1, split) == [1]
    assert whole.describe_meshes() == "attention tp2 x cp1 x dp2, experts etp1 x ep2 x edp2"
    assert split.describe_meshes() == "attention tp2 x cp1 x dp2, experts etp2 x ep2 x edp1"
    for degrees in (whole, split, Degrees(dp=3, tp=2, pp=2, cp=2, ep=3, etp=1)):
        for kind in ("ep", "expert_dp"):  # each kind partitions the world, one pipeline stage at a time
            groups = {tuple(group_members(kind, rank, degrees)) for rank in range(degrees.world_size)}
            assert sorted(r for g in groups for r in g) == list(range(degrees.world_size))
            assert all(len({r // (degrees.world_size // degrees.pp) for r in g}) == 1 for g in groups)


def test_expert_mesh_refusals_say_why():
    with pytest.raises(LayoutError, match=r"parallel\.ep=3 does not divide parallel\.dp=2 x cp=2 x tp/etp=1 = 4"):
        validate_degrees(4, dp=2, cp=2, ep=3)
    with pytest.raises(LayoutError, match=r"parallel\.etp=2 must be 1 \(whole experts\) or parallel\.tp=4"):
        validate_degrees(4, tp=4, etp=2)
    with pytest.raises(ConfigError, match="parallel.etp = 3 must be 1"):
        load_config(None, [*GPT2, "parallel.tp=4", "parallel.etp=3"])
    with pytest.raises(ConfigError, match="parallel.etp = 1 needs experts"):
        load_config(None, ["parallel.tp=2", "parallel.etp=1"])
    # capacity is first come first served in the whole sequence's token order: no cp rank sees that order
    with pytest.raises(ConfigError, match="capacity_factor = 1.0 with parallel.cp = 2.*first come first served"):
        load_config(None, ["model.moe={experts = 4, capacity_factor = 1.0}", "parallel.cp=2"])


def test_memory_plan_shows_both_meshes_and_shards_experts_over_edp():
    from mpitrain.plan.memory import memory_report, rank_param_count, reduction_shares
    cfg = load_config("configs/tiny.toml", [*GPT2, "parallel.cp=2", "parallel.ep=2", "parallel.zero=1"])
    resolve_layout(cfg, 4)
    report = memory_report(cfg, rank_param_count(cfg))
    assert "meshes per stage: attention tp1 x cp2 x dp2, experts etp1 x ep2 x edp2" in report["formulas"]["params"]
    (_, dense_ranks), (experts, expert_ranks) = reduction_shares(cfg)
    assert (dense_ranks, expert_ranks) == (4, 2) and experts == 2 * 2 * 2 * 32 * 128  # 2 blocks x 2 of 4 x fc, proj
    whole = load_config("configs/tiny.toml", [*GPT2, "parallel.tp=2", "parallel.etp=1"])
    resolve_layout(whole, 2)
    assert reduction_shares(whole)[1][1] == 2  # whole experts on both tp ranks: reduced over the pair


PLACEMENT = """
import json
from mpi4py import MPI
from mpitrain.comm.mesh import Mesh
from mpitrain.layers.expert_parallel import ExpertParallel
world = MPI.COMM_WORLD
mesh = Mesh(world, dp=2, tp=2, ep=4, etp=1)
experts = ExpertParallel.of_mesh(mesh, 8)
mine = {"placement": mesh.describe_placement(), "ep": mesh.ep.size, "edp": mesh.expert_dp.size,
        "first": experts.first, "share": [experts.share, experts.shares], "etp": experts.etp_size}
everyone = world.gather(mine)
if world.rank == 0:
    print("RESULTS " + json.dumps(everyone))
"""


def test_the_placement_line_and_the_ranks_show_the_expert_mesh():
    """dp 2 x tp 2 with whole experts and ep 4: every rank of the stage is one ep rank with 2 of the 8 experts, each tp
    rank routes its half of the tokens, and the start-up placement line names both meshes."""
    from tests.mpi_helpers import run_python_mpi_results
    ranks = run_python_mpi_results(4, PLACEMENT)
    assert [r["first"] for r in ranks] == [0, 2, 4, 6] and [r["share"] for r in ranks] == [[0, 2], [1, 2]] * 2
    assert all(r["ep"] == 4 and r["edp"] == 1 and r["etp"] == 1 for r in ranks)
    assert ranks[0]["placement"].endswith("; meshes per stage: attention tp2 x cp1 x dp2, experts etp1 x ep4 x edp1")
    assert "inside one node: dp, tp, ep" in ranks[0]["placement"]


# ---- training runs: float64 parity with one process, every step ----------------------------------------------------
@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {name: train_run(1, tmp_path_factory.mktemp(name), *settings)
            for name, settings in (("gpt2", GPT2), ("llama", LLAMA))}


@pytest.mark.parametrize("case, ranks, layout", [
    ("gpt2", 2, ["parallel.cp=2", "parallel.ep=2"]),  # ep drawn from cp alone
    ("gpt2", 4, ["parallel.cp=2", "parallel.ep=2"]),  # dp 2 x cp 2: ep from cp, experts reduced over dp
    ("llama", 4, ["parallel.cp=2", "parallel.ep=4"]),  # ep over all of dp x cp: one expert pair per rank
    ("llama", 4, ["parallel.cp=2", "parallel.zero=2"]),  # ep 1 under cp: experts reduced over dp x cp like the rest
    ("gpt2", 2, ["parallel.tp=2", "parallel.etp=1"]),  # whole experts, each tp rank routes half the tokens
    ("llama", 2, ["parallel.tp=2", "parallel.etp=1", "parallel.ep=2"]),  # ... and ep drawn from the tp pair
    ("gpt2", 2, ["parallel.tp=2", "parallel.etp=1", "parallel.zero=3"]),  # dp 1: experts sharded over the tp pair
    ("llama", 4, ["parallel.tp=2", "parallel.etp=2", "parallel.ep=2", "parallel.sequence_parallel=true"]),
    ("llama", 4, ["parallel.tp=2", "parallel.cp=2", "parallel.ep=2"]),  # experts split over tp, ep from cp
])
def test_folded_layouts_match_one_process(tmp_path, references, case, ranks, layout):
    run = train_run(ranks, tmp_path / "run", *(GPT2 if case == "gpt2" else LLAMA), *layout)
    assert_same_run(references[case], run)
    assert run[0][-1]["moe_balance"] == pytest.approx(references[case][0][-1]["moe_balance"], rel=1e-10)


def test_tp_with_whole_experts_and_ep_across_cp_matches_one_process(tmp_path, references):
    """tp 2 x cp 2 with etp 1 and ep 4: ep drawn from the tp pair's token shares and the cp ranks."""
    run = train_run(4, tmp_path / "run", *LLAMA, "parallel.tp=2", "parallel.cp=2", "parallel.etp=1",
                    "parallel.ep=4")
    assert_same_run(references["llama"], run)


def test_a_dp2_cp2_ep2_run_resumes_on_dp2_ep2_and_in_one_process(tmp_path, references):
    """Steps 1-2 on dp 2 x cp 2 with ep 2 from cp (experts written once per expert_dp pair), 3-4 on dp 2 with ep 2
    from dp, 5-6 in one process: the one-process run's losses and weights."""
    train_run(4, tmp_path, *LLAMA, "parallel.cp=2", "parallel.ep=2", "train.stop_at=2", expect=75)
    train_run(2, tmp_path, *LLAMA, "parallel.ep=2", "train.stop_at=4", resume="auto", expect=75)
    resumed = train_run(1, tmp_path, *LLAMA, resume="auto")
    assert_same_run(references["llama"], resumed)
    assert np.isfinite(resumed[0][-1]["loss"])


def test_plan_searches_etp_and_ep_drawn_from_dp_x_cp():
    from mpitrain.plan.clusters import load_cluster
    from mpitrain.plan.cost import Layout, estimate
    from mpitrain.plan.search import candidate_layouts
    cfg = load_config("configs/tiny.toml", ["model.moe={experts = 8, top_k = 2}", "model.seq_len=16384"])
    cluster = load_cluster("h100")
    meshes = {(lay.dp, lay.tp, lay.cp, lay.ep, lay.etp) for group in candidate_layouts(cfg, 8, cluster)
              for lay in group}
    assert (1, 2, 4, 8, 1) in meshes  # ep 8 from the tp pair's token shares and cp 4
    assert (2, 1, 4, 8, 1) in meshes and (2, 2, 2, 4, 2) in meshes  # ep beyond dp, from dp x cp
    whole = Layout(dp=2, tp=2, pp=1, ep=4, etp=1)
    assert whole.describe().startswith("dp2 tp2 pp1 ep4 etp1")
    assert estimate(load_config("configs/tiny.toml", ["model.moe={experts = 8, top_k = 2}"]), whole,
                    cluster)["fits"]


def test_cp_ranks_send_their_own_tokens_to_the_experts(tmp_path):
    """cp 2 with ep 2 drawn from it, 2 experts, top-2: each cp rank's 2 x 16 tokens of a micro-batch each pick both
    experts, so each sends all of its tokens to the other rank's expert and gets them back: 4 crossings (dispatch and
    combine, forward and backward) of tokens x d_model bfloat16 values per MoE layer and micro-batch. Exactly that."""
    metrics, _ = train_run(2, tmp_path / "run", "model.moe={experts = 2, top_k = 2}", "parallel.cp=2",
                           "parallel.ep=2", "precision.compute=bfloat16", steps=2)
    tokens, d_model, layers, micro_batches = 2 * 32 // 2, 32, 2, 8 // 2
    for record in metrics:
        assert record["comm_bytes"]["all_to_all"] == 4 * tokens * d_model * 2 * layers * micro_batches
        assert np.isfinite(record["loss"]) and 0.9 < record["moe_balance"] < 1.5
