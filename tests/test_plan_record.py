"""The GPU cost model against the published record (configs/clusters/record/published.toml, plan/record.py): the
calibration runs it was fitted to stay fitted, each held-out run's published layout is predicted within 15% on
average, and for Llama 3 405B on 8,192 H100 the planner's top layout is the published one or one it explains as
faster, naming the part of the step that shrinks (and is no longer ZeRO-3 over 1,024 data-parallel ranks)."""
from __future__ import annotations

import pytest

from mpitrain.plan.clusters import load_cluster
from mpitrain.plan.layout import nearest_better, shrinking_parts
from mpitrain.plan.record import load_record, predict, run_config
from mpitrain.plan.search import search

RECORD = load_record()


def test_every_run_names_its_source_and_one_published_figure():
    for run in RECORD["calibration"] + RECORD["held_out"]:
        assert run["source"] in ("narayanan-t1", "narayanan-t2", "llama3-t4"), run["name"]
        assert ("tflops" in run) != ("mfu" in run), run["name"]
    names = {run["name"] for run in RECORD["calibration"]}
    assert not names & {run["name"] for run in RECORD["held_out"]}  # held-out runs are not fitted to


def test_calibration_runs_stay_fitted():
    errors = [predict(run)["error"] for run in RECORD["calibration"]]
    assert sum(abs(e) for e in errors) / len(errors) < 0.06  # the fit reached 4.0% (docs/planning.md)
    assert max(abs(e) for e in errors) < 0.15


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
