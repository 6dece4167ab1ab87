"""The GPU cost model against the published record (configs/clusters/record/published.toml, plan/record.py): the
calibration runs it was fitted to stay fitted (A100 and H100 apart), each held-out run's published layout is
predicted within 15% on average, the pipeline's busiest-rank loads (plan/pipeline_cost.py) are the stage models'
weights, and for Llama 3 405B on 8,192 H100 the planner's top layout is the published one or one it explains as
faster, naming the part of the step that shrinks (and is no longer ZeRO-3 over 1,024 data-parallel ranks)."""
from __future__ import annotations

import pytest

from mpitrain.config import load_config
from mpitrain.parallel.instructions import placement_of
from mpitrain.plan.clusters import load_cluster
from mpitrain.plan.cost import Layout, layout_config
from mpitrain.plan.layout import nearest_better, shrinking_parts
from mpitrain.plan.memory import rank_param_count
from mpitrain.plan.pipeline_cost import pipeline_imbalance, rank_loads, stage_imbalance
from mpitrain.plan.record import load_record, megatron_core_flops_per_step, predict, run_config
from mpitrain.plan.search import search

RECORD = load_record()


def test_every_run_names_its_source_and_one_published_figure():
    for run in RECORD["calibration"] + RECORD["held_out"]:
        assert run["source"] in ("narayanan-t1", "narayanan-t2", "megatron-lm-readme", "llama3-t4"), run["name"]
        assert ("tflops" in run) != ("mfu" in run), run["name"]
    names = {run["name"] for run in RECORD["calibration"]}
    assert not names & {run["name"] for run in RECORD["held_out"]}  # held-out runs are not fitted to


@pytest.mark.parametrize("cluster, bound", [("a100", 0.06), ("h100", 0.09)])
def test_calibration_runs_stay_fitted(cluster, bound):
    """Each cluster's calibration runs stay within the mean error its fit reached (docs/planning.md: A100 4.6%, H100
    7.3%); no run beyond 22% (the H100 1.7B, over-predicted by 20%, is the worst)."""
    errors = [predict(run)["error"] for run in RECORD["calibration"] if run["cluster"] == cluster]
    assert len(errors) >= 9
    assert sum(abs(e) for e in errors) / len(errors) < bound
    assert max(abs(e) for e in errors) < 0.22


def test_megatron_readme_rows_are_the_sizes_they_are_named():
    """The transcribed H100 table's shapes give the parameter counts its first column names (untied embedding and
    head: 12 l h^2 + 2 V h), and Megatron-Core's FLOP count is its GPT-3 closed form, 72 B s l h^2 (1 + s/6h +
    V/12lh)."""
    rows = [run for run in RECORD["calibration"] if run["source"] == "megatron-lm-readme"]
    assert len(rows) == 9
    for run in rows:
        m = run["model"]
        params = 12 * m["n_layer"] * m["d_model"] ** 2 + 2 * m["vocab_size"] * m["d_model"]
        assert params / 1e9 == pytest.approx(float(run["name"].split("-")[-1].rstrip("b")), rel=0.03), run["name"]
        cfg = run_config(run)
        s, h, layers, v, b = m["seq_len"], m["d_model"], m["n_layer"], m["vocab_size"], run["global_batch"]
        closed = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
        assert megatron_core_flops_per_step(cfg) == pytest.approx(closed, rel=1e-12)


def test_held_out_runs_within_15_percent_on_average():
    found = [predict(run) for run in RECORD["held_out"]]
    assert sum(abs(f["error"]) for f in found) / len(found) < 0.15, [(f["name"], f["error"]) for f in found]
    for f in found:  # the layout predicted is the published one: its tp, pp and dp
        run = next(r for r in RECORD["held_out"] if r["name"] == f["name"])
        layout = f["result"]["layout"]
        assert (layout["tp"], layout["pp"], layout["dp"]) == (run["tp"], run["pp"], run["gpus"] // (run["tp"] *
                                                                                                  run["pp"]))


def test_405b_top_layout_is_the_published_one_or_explained_as_faster():
    run = next(r for r in RECORD["held_out"] if r["name"] == "llama3-405b-8k")
    cluster = load_cluster(run["cluster"])
    found = search(run_config(run), cluster, run["gpus"])
    top, published = found["fits"][0], predict(run)["result"]
    assert top["layout"]["zero"] != 3  # the ZeRO-3 over 1,024 data-parallel ranks the planner used to rank first
    if (top["layout"]["tp"], top["layout"]["pp"], top["layout"]["dp"]) == (run["tp"], run["pp"], 64):
        return
    if top["step_s"] < published["step_s"]:  # another layout: the planner says which parts of the step it saves
        better = nearest_better(published, found["fits"])
        assert better is not None and better["step_s"] < published["step_s"]
        assert " -" in shrinking_parts(published, better)  # a part that shrinks, with its seconds
    # either way a difference of detail: the published layout is within 5% of the top
    assert published["step_s"] == pytest.approx(top["step_s"], rel=0.05)


def test_stage_loads_by_hand():
    # 10 blocks over 4 stages split 3, 3, 2, 2; the head (half a block) on the last rank, the embedding on the first
    loads = rank_loads(10, 4, 1, head_blocks=0.5, embedding_blocks=0.25)
    assert loads == [3.25, 3.0, 2.0, 2.5]
    assert stage_imbalance(loads) == pytest.approx(3.25 / (10.75 / 4))
    # interleaved 2 deep: rank 0 holds virtual stages 0 and 2, rank 1 stages 1 and 3 (and the head)
    assert rank_loads(6, 2, 2, head_blocks=0.5) == [3.0, 3.5]
    # a V (zbv, dualpipev): rank 0 holds the first and the last virtual stage, so the embedding and the head
    assert rank_loads(8, 2, 2, head_blocks=0.5, embedding_blocks=0.25, placement="v") == [4.75, 4.0]
    assert pipeline_imbalance(12, 1, 1, "1f1b", 256, 32, 1e6) == 1.0


@pytest.mark.parametrize("n_layer, pp, v, schedule", [(7, 3, 1, "1f1b"), (6, 2, 2, "interleaved"), (8, 2, 2, "zbv")])
def test_stage_loads_are_the_matmul_weights_each_pipeline_rank_holds(n_layer, pp, v, schedule):
    """Each rank's load (blocks, and the head in blocks' worth) times a block's weights is the matmul weights of the
    stage model the planner builds for that rank: its parameters less the embedding tables (the first rank's, and
    the tied copy the head's rank holds when it is another), plus the head's V x d matmul, to the final norm."""
    base = load_config("configs/tiny.toml", [f"model.n_layer={n_layer}"])
    m = base.model
    one = Layout(dp=1, tp=1, pp=1, zero=0)
    block = rank_param_count(layout_config(base, one, "float32")) - rank_param_count(
        layout_config(load_config("configs/tiny.toml", [f"model.n_layer={n_layer - 1}"]), one, "float32"))
    embedding = m.vocab_size * m.d_model + m.seq_len * m.d_model  # token and position tables (gpt2)
    cfg = layout_config(base, Layout(dp=1, tp=1, pp=pp, zero=0, schedule=schedule, virtual_stages=v), "float32")
    loads = rank_loads(n_layer, pp, v, m.vocab_size * m.d_model / block, placement=placement_of(schedule))
    head_rank = 0 if placement_of(schedule) == "v" else pp - 1
    for rank, load in enumerate(loads):  # rank 0 holds virtual stage 0, the embedding, in either placement
        tables = embedding * ((rank == 0) + (rank == head_rank != 0))
        weights = rank_param_count(cfg, rank) - tables + m.vocab_size * m.d_model * (rank == head_rank)
        assert weights == pytest.approx(load * block, abs=2 * m.d_model + 1), (rank, loads)


def test_fit_on_a_cluster_without_calibration_runs_is_one_line(capsys):
    from mpitrain.plan.record import main
    with pytest.raises(SystemExit) as stop:
        main(["--fit", "b200"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--fit b200" in err and "a100, h100" in err and "Traceback" not in err
