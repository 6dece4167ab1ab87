"""The planner's terms for the newer parallel features are each feature's own formula functions: DualPipeV's bubble,
activations held and pipeline messages (parallel/schedule_costs.py); Ulysses' all-to-all bytes
(parallel/context.py). tests/test_plan_dryrun.py checks the rows the training code builds for the same layouts."""
from __future__ import annotations

import pytest

from mpitrain.parallel import schedule_costs
from mpitrain.parallel.context import cp_bytes_per_step
from mpitrain.plan.clusters import load_cluster
from mpitrain.plan.cost import Layout, estimate, ulysses_bytes_per_micro_batch
from mpitrain.plan.layout import layout_for, parse_layout
from mpitrain.plan.memory import _stage_holdings
from mpitrain.plan.presets import model_config
from mpitrain.plan.search import search


def test_dualpipev_bubble_messages_and_activations_are_the_schedule_formulas():
    cfg, _ = model_config("llama3-8b")
    cluster = load_cluster("h100")
    pp, dp = 4, 2
    runs = {kind: estimate(cfg, Layout(dp=dp, tp=1, pp=pp, zero=1, micro_batch=1, schedule=kind, virtual_stages=v),
                           cluster) for kind, v in (("dualpipev", 2), ("1f1b", 1))}
    m = runs["dualpipev"]["micro_batches"]
    assert m >= 2 * pp and runs["dualpipev"]["bubble"] == float(schedule_costs.bubble("dualpipev", pp, m, 2))
    # each of the p - 1 links carries both chunks each way: twice 1f1b's messages of the same (micro_batch, T, d)
    per_link = {kind: schedule_costs.messages_per_micro_batch(kind, pp, v) / (pp - 1) for kind, v in
                (("dualpipev", 2), ("1f1b", 1))}
    assert per_link == {"dualpipev": 4, "1f1b": 2}
    assert runs["dualpipev"]["parts"]["pp_send"] == pytest.approx(2 * runs["1f1b"]["parts"]["pp_send"], rel=1e-12)
    assert sum(runs["dualpipev"]["parts"].values()) == pytest.approx(runs["dualpipev"]["step_s"], rel=1e-12)
    for p in (2, 3, 4):  # the activations the planner charges: the chunks each rank holds at its peak
        for micro_batches in (2 * p, 3 * p):
            held = [max(saved for saved, _ in rank) for rank in _stage_holdings("dualpipev", p, micro_batches, 2)]
            assert held == schedule_costs.peak_activation_chunks("dualpipev", p, micro_batches, 2)


def test_dualpipev_in_the_search_and_the_layout_text():
    layout_, world = layout_for(parse_layout("dp2 tp4 pp4 dualpipev"), 32)
    assert (layout_.schedule, layout_.virtual_stages, world) == ("dualpipev", 2, 32)
    cfg, _ = model_config("gpt3-350m")
    cfg.train.global_batch = 16
    found = search(cfg, load_cluster("h100"), 8, prune=False)
    evaluated = found["fits"] + found["too_big"]
    dualpipev = [r for r in evaluated if r["layout"]["schedule"] == "dualpipev"]
    assert dualpipev and all(r["micro_batches"] >= 2 * r["layout"]["pp"] for r in dualpipev)
    assert not any("dualpipev" in reason for reason in found["refused"])  # too few micro-batches: never tried



@pytest.mark.parametrize("recompute", ["none", "full"])
def test_ulysses_bytes_are_context_cp_bytes_per_step(recompute):
    cfg, _ = model_config("llama3-8b")  # 32 heads, 8 K/V heads: tp 8 x cp 4 leaves each rank under one K/V head
    cfg.memory.recompute, cfg.train.micro_batch = recompute, 2
    for tp, cp in ((1, 2), (2, 4), (8, 4)):
        cfg.parallel.tp, cfg.parallel.cp = tp, cp
        kv = cfg.model.kv_heads // tp
        expected = cp_bytes_per_step("ulysses", 2, cfg.model.seq_len, cfg.model.n_head // tp, kv, cfg.model.head_dim,
                                     2, cp, blocks=5, recompute=recompute)
        assert expected["cp_ring"] == 0 and ulysses_bytes_per_micro_batch(cfg, 2, 5) == expected["all_to_all"] > 0
