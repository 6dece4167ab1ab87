"""`mpitrain plan` times ZeRO's collectives and optimizer shard per reduction group: under expert parallelism the
experts are reduced and sharded over expert_dp (dp / ep ranks), the rest over dp x cp (state/zero.py
split_by_reduction), as plan/memory.py counts their bytes."""
from __future__ import annotations

import dataclasses

import pytest

from mpitrain.config import load_config
from mpitrain.plan.clusters import load_cluster
from mpitrain.plan.cost import ADAM_BYTES_PER_PARAM, Layout, estimate, layout_config, ring
from mpitrain.plan.memory import split_rank_layouts

MOE = ["model.moe={experts = 4, top_k = 2}", "precision.compute=float64", "train.global_batch=8",
       "train.micro_batch=2", "data.synthetic=true"]


@pytest.mark.parametrize("dp, ep", [(2, 2), (4, 2)], ids=["ep=dp", "expert_dp=2"])
def test_zero_1_gathers_and_shards_experts_over_expert_dp(dp, ep):
    """No overlap, so ZeRO-1's parameter all-gather is all exposed: the dense tensors gathered over dp, the experts
    over expert_dp (at ep = dp: one copy, nothing to gather); the optimizer runs over the two shards."""
    base = load_config("configs/tiny.toml", MOE)
    cluster = dataclasses.replace(load_cluster("h100"), compute="float64", comm_overlap=0.0)
    layout = Layout(dp=dp, tp=1, pp=1, ep=ep, zero=1)
    trainable, _ = split_rank_layouts(layout_config(base, layout, "float64"))
    specs = [spec for unit in trainable for spec in unit.specs]
    experts = sum(spec.size for spec in specs if spec.reduce_over == "expert_dp")
    dense = sum(spec.size for spec in specs) - experts
    assert experts > 0 and dense > 0
    parts = estimate(base, layout, cluster)["parts"]
    gathers = ring(cluster.intra, "all_gather", dense * 8, dp) + \
        ring(cluster.intra, "all_gather", experts * 8, dp // ep)
    assert parts["zero_exposed"] == pytest.approx(gathers, rel=1e-12)
    shard = dense / dp + experts / (dp // ep)
    assert parts["optimizer"] == pytest.approx(shard * ADAM_BYTES_PER_PARAM / cluster.optimizer_bytes_per_s, rel=1e-12)
