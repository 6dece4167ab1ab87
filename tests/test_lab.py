"""`mpitrain lab`: every built lab in --quick mode; each deterministic row (bytes held, bytes moved, the bubble of
the recorded event order) equals its formula. Times are printed by the labs, never checked here."""
from __future__ import annotations

import copy

import pytest
from click.testing import CliRunner

from mpitrain.cli import main
from mpitrain.lab import LABS, zero
from mpitrain.lab.runner import Row, run_job, save_plot


@pytest.fixture(scope="module")
def results():
    return {}


def lab_result(results, name):
    if name not in results:
        results[name] = run_job(LABS[name], quick=True, timeout=300)
    return results[name]


@pytest.mark.parametrize("name", sorted(LABS))
def test_each_lab_measures_what_its_formulas_say(results, name, tmp_path):
    lab = LABS[name]
    rows = lab.rows(lab_result(results, name))
    checked = [row for row in rows if row.checked]
    assert len(checked) >= 2, name
    assert [row.claim for row in checked if not row.holds] == [], [vars(r) for r in checked]
    save_plot(lab, lab_result(results, name), tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_a_lab_check_can_fail(results):
    """ZeRO-3 moving DP's bytes (no second all-gather), or one more padding-sized chunk of state, is caught."""
    result = copy.deepcopy(lab_result(results, "zero"))
    result["stages"]["3"]["moved"] = result["stages"]["0"]["moved"]
    result["stages"]["1"]["held"] += 4 * result["psi"] // 100
    failing = [row.claim for row in zero.rows(result) if not row.holds]
    assert any("ZeRO-3 bytes moved" in claim for claim in failing), failing
    assert any("ZeRO-1 state" in claim for claim in failing), failing
    assert not Row("t", "f", "1", 1.0, 2.0).holds and Row("t", "f", "1 ms").holds  # times are never checked


def test_the_roofline_checks_can_fail(results):
    """A cache that forgot to count the new keys it writes, or a training micro-batch whose saved state is not what
    the layers declare, or one too small to reuse its weights, is caught."""
    from mpitrain.lab import roofline
    result = copy.deepcopy(lab_result(results, "roofline"))
    result["decode"]["cache_bytes"] -= result["decode"]["steps"] * 2 * result["n_layer"] * result["kv"] * 4
    result["training"]["saved"] += 4
    result["training"]["flops_per_token"] /= 100
    failing = [row.claim for row in roofline.rows(result) if not row.holds]
    assert any("decode bytes" in claim for claim in failing), failing
    assert any("training bytes" in claim for claim in failing), failing
    assert any("compute-bound" in claim for claim in failing), failing


def test_lab_command_lists_and_names_an_unknown_lab():
    runner = CliRunner()
    listed = runner.invoke(main, ["lab", "list"])
    assert listed.exit_code == 0 and all(name in listed.output for name in LABS)
    unknown = runner.invoke(main, ["lab", "nope"])
    assert unknown.exit_code != 0 and "no lab 'nope'" in unknown.output and "Traceback" not in unknown.output


def test_lab_command_prints_the_table_and_writes_the_plot(tmp_path):
    png = tmp_path / "memory.png"
    done = CliRunner().invoke(main, ["lab", "memory", "--quick", "--png", str(png)])
    assert done.exit_code == 0, done.output
    assert "claim" in done.output and "measured here" in done.output and "FAILS" not in done.output
    assert png.stat().st_size > 1000


def test_a_plot_into_a_missing_folder_is_one_line_before_any_run(tmp_path):
    done = CliRunner().invoke(main, ["lab", "zero", "--png", str(tmp_path / "missing" / "zero.png")])
    assert done.exit_code != 0 and "--png" in done.output and "does not exist" in done.output, done.output
    assert "Traceback" not in done.output
