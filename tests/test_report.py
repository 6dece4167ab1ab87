"""`mpitrain report`: the PNG of a short pipeline run has its five panels (titles read back from the PNG's
metadata), an HTML report embeds it, and a run still going (torn last line, no timeline yet) is drawn too."""
from __future__ import annotations

import pytest
from click.testing import CliRunner
from mpi_helpers import describe, run_mpi

from mpitrain.cli import main
from mpitrain.profile.report import PANEL_TITLES, mean_breakdown

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("report") / "run"
    result = run_mpi(2, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir),
                         "--set", "data.synthetic=true", "--set", "parallel.pp=2", "--set", "train.steps=3",
                         "--set", "train.eval_batches=1", "--set", "logging.peak_flops=1e9"], timeout=300)
    assert result.returncode == 0, describe(result)
    return run_dir


def test_png_has_the_panels(run_dir, tmp_path):
    from PIL import Image

    out = tmp_path / "report.png"
    result = CliRunner().invoke(main, ["report", str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(out) as image:
        described = image.text["Description"].split(" | ")
        assert image.size[0] > 600 and image.size[1] > 600
    assert described == list(PANEL_TITLES)
    for title in ("Loss", "Throughput and MFU", "Time breakdown per step", "Bytes sent per step", "Pipeline"):
        assert any(panel.startswith(title) for panel in described)


def test_html_and_a_run_still_going(run_dir, tmp_path):
    going = tmp_path / "going"
    going.mkdir()
    text = (run_dir / "metrics.jsonl").read_text()
    (going / "metrics.jsonl").write_text(text + text.splitlines()[-1][:40])  # a row being written: torn
    out = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["report", str(going), "--out", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "data:image/png;base64," in page and "Pipeline timeline" in page
    assert (run_dir / "timeline.json").is_file()


def test_bad_inputs_are_one_line(tmp_path):
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code != 0 and "metrics.jsonl not found" in result.output
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    result = CliRunner().invoke(main, ["report", str(tmp_path), "--out", str(tmp_path / "r.pdf")])
    assert result.exit_code != 0 and ".png or .html" in result.output


def test_mean_breakdown():
    row = {"breakdown": [{"forward": 1.0, "comm.all_reduce.dp": 2.0}, {"forward": 3.0}]}
    assert mean_breakdown(row) == {"forward": 2.0, "comm.all_reduce.dp": 1.0}
