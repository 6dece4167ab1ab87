"""`mpitrain plan MODEL CLUSTER --layout ...`: one layout evaluated alone. Its parts add up to the step it prints,
a bad token or key is named in a one-line error, and the nearest faster layout says which parts shrink."""
from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from mpitrain.errors import ConfigError
from mpitrain.plan.clusters import load_cluster
from mpitrain.plan.command import plan_command
from mpitrain.plan.cost import Layout, estimate
from mpitrain.plan.layout import layout_for, nearest_better, parse_layout, shrinking_parts
from mpitrain.plan.presets import model_config


def test_layout_text_and_set_keys_give_the_same_layout():
    text = parse_layout("dp64 tp8 pp16 zero1 mb2 interleaved/v4 rc-selective offload-none")
    sets = parse_layout("", ("parallel.dp=64", "parallel.tp=8", "parallel.pp=16", "parallel.zero=1",
                             "train.micro_batch=2", "parallel.schedule=interleaved", "parallel.virtual_stages=4",
                             "memory.recompute='selective'"))
    assert layout_for(text, None) == layout_for(sets, 8192)
    layout, world = layout_for(text, None)
    assert world == 8192 and layout == Layout(dp=64, tp=8, pp=16, zero=1, micro_batch=2, schedule="interleaved",
                                              virtual_stages=4, recompute="selective", etp=8)
    assert layout_for(parse_layout("tp8 pp2"), 64)[0].dp == 4  # dp fills the GPUs



def test_the_settings_beyond_the_mesh_read_back_from_their_names_and_keys():
    layout = Layout(dp=8, tp=4, pp=2, cp=2, cp_kind="hybrid", dp_reduce="two_level", zero_shard="node",
                    zero_gather_dtype="fp8", zero_grad_reduce="int4", tp_overlap=True, fp8="mxfp8", etp=4)
    assert layout_for(parse_layout(layout.describe()), None)[0] == layout  # the table's names parse back
    sets = ("parallel.dp=8", "parallel.tp=4", "parallel.pp=2", "parallel.cp=2", "parallel.cp_kind=hybrid",
            "parallel.dp_reduce=two_level", "parallel.zero_shard=node", "parallel.zero_gather_dtype=fp8",
            "parallel.zero_grad_reduce=int4", "parallel.tp_overlap=true", "precision.fp8=mxfp8")
    assert layout_for(parse_layout("", sets), None)[0] == layout
    with pytest.raises(ConfigError, match="grad-int2"):
        parse_layout("dp8 grad-int2")

@pytest.mark.parametrize("text, sets, named", [
    ("dp64 tp8 pp16 zer01", (), "'zer01'"), ("dp2 rc-some", (), "'rc-some'"),
    ("dp2", ("parallel.tpp=2",), "parallel.tpp"), ("dp2", ("memory.recompute=most",), "'most'"),
    ("dp2", ("parallel.tp=two",), "'two'")])
def test_a_bad_token_or_key_is_named(text, sets, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        parse_layout(text, sets)


def test_gpus_that_disagree_with_the_layout_are_refused():
    with pytest.raises(ConfigError, match="--gpus 16"):
        layout_for(parse_layout("dp4 tp8"), 16)


def test_the_printed_parts_add_up_to_the_printed_step():
    result = CliRunner().invoke(plan_command, ["llama3-8b", "h100", "--gpus", "16", "--layout",
                                               "dp2 tp4 pp2 zero1 mb1 1f1b rc-selective"])
    assert result.exit_code == 0, result.output
    parts = [float(m.group(1)) for m in re.finditer(r"^  (?!step).{42} +([0-9.]+) s ", result.output, re.M)]
    step = float(re.search(r"step \(the sum\) +([0-9.]+) s", result.output).group(1))
    assert len(parts) >= 4 and sum(parts) == pytest.approx(step, abs=1e-3 * len(parts))
    assert "MFU" in result.output and "memory per rank" in result.output and "nearest faster layout" in result.output
    bad = CliRunner().invoke(plan_command, ["llama3-8b", "h100", "--layout", "dp2 tp4 pq2"])
    assert bad.exit_code == 1 and "'pq2'" in bad.output and "Traceback" not in bad.output


def test_estimate_parts_sum_to_the_step_for_every_kind_of_layout():
    cfg, _ = model_config("llama3-8b")
    cluster = load_cluster("h100")
    for layout in (Layout(dp=16, tp=1, pp=1, zero=3, micro_batch=1, recompute="full"),
                   Layout(dp=2, tp=4, pp=2, zero=1, schedule="interleaved", virtual_stages=2),
                   Layout(dp=1, tp=8, pp=2, zero=2, schedule="zb1p", recompute="selective")):
        result = estimate(cfg, layout, cluster)
        assert sum(result["parts"].values()) == pytest.approx(result["step_s"], rel=1e-12)


def test_nearest_faster_layout_changes_fewest_fields_and_names_the_shrinking_part():
    cfg, _ = model_config("llama3-8b")
    cluster = load_cluster("h100")
    cfg.train.global_batch = 16  # 8 micro-batches on 2 stages: a bubble worth interleaving away
    slow = estimate(cfg, Layout(dp=2, tp=4, pp=2, zero=1, etp=4), cluster)
    candidates = [estimate(cfg, layout, cluster) for layout in (
        Layout(dp=2, tp=4, pp=2, zero=1, schedule="interleaved", virtual_stages=2, etp=4),  # one field: bubble
        Layout(dp=16, tp=1, pp=1, zero=1, recompute="full", etp=1))]
    better = nearest_better(slow, [r for r in candidates if r["step_s"] < slow["step_s"]])
    assert better["layout"]["schedule"] == "interleaved"
    assert shrinking_parts(slow, better).startswith("pipeline bubble -")


def test_the_search_lower_bound_never_exceeds_the_estimate():
    """The search skips layouts by step_lower_bound: it must stay below the step estimate() gives each layout."""
    from mpitrain.plan.cost import step_lower_bound
    from mpitrain.plan.search import candidate_layouts
    for model, gpus in (("llama3-8b", 16), ("mixtral-8x7b", 16)):
        cfg, _ = model_config(model)
        cluster = load_cluster("h100")
        checked = 0
        for group in list(candidate_layouts(cfg, gpus, cluster))[::61]:
            for layout in group:
                try:
                    result = estimate(cfg, layout, cluster)
                except ConfigError:
                    continue
                assert step_lower_bound(cfg, layout, cluster) <= result["step_s"] * (1 + 1e-9), layout
                checked += 1
        assert checked > 8


@pytest.mark.parametrize("option", [["--fp8", "tensor"], ["--allow", "quantized-comm"]])
def test_the_search_options_beside_a_layout_are_refused_not_ignored(option):
    result = CliRunner().invoke(plan_command, ["llama3-8b", "h100", "--layout", "dp8 tp2", *option])
    assert result.exit_code == 2 and "fp8-tensor" in result.output and "Traceback" not in result.output
