"""`mpitrain report`: the figure of a short recorded run, read back as matplotlib objects (not pixels): five panels
whose titles match the run (a pipeline timeline only when pp > 1), each legend beside its own panel and over no
panel's data, text sized to read at 100% zoom; the PNG and an HTML report from the command, and a run still going
(torn last line, no timeline yet)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner
from mpi_helpers import describe, run_mpi

from mpitrain.cli import main
from mpitrain.profile.report import build_figure, mean_breakdown, panel_titles

pytest.importorskip("matplotlib", reason="mpitrain report draws with matplotlib: pip install -e '.[report]'")


def record_run(tmp_path_factory, name, *settings):
    """3 steps of the tiny model on 2 ranks, synthetic tokens: the files a real run leaves for the report."""
    run_dir = tmp_path_factory.mktemp(name) / "run"
    overrides = [word for setting in settings for word in ("--set", setting)]
    result = run_mpi(2, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir),
                         "--set", "data.synthetic=true", "--set", "train.steps=3", "--set", "train.eval_batches=1",
                         "--set", "logging.peak_flops=1e9", *overrides], timeout=300)
    assert result.returncode == 0, describe(result)
    return run_dir


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    return record_run(tmp_path_factory, "pipeline", "parallel.pp=2")


@pytest.fixture(scope="module")
def data_parallel_run(tmp_path_factory):
    return record_run(tmp_path_factory, "dp", "parallel.pp=1")


def drawn(run_dir):
    """The report's figure, laid out and drawn, and the renderer that measured it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = build_figure(run_dir)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return figure, canvas.get_renderer()


def panels(figure):
    """The five titled panels, top to bottom (the MFU axis twinned onto the throughput panel has no title)."""
    return [axes for axes in figure.axes if axes.get_title(loc="left")]


def test_titles_follow_the_layout(pipeline_run, data_parallel_run):
    pipeline_titles = [axes.get_title(loc="left") for axes in panels(drawn(pipeline_run)[0])]
    assert pipeline_titles[:4] == ["Loss", "Throughput and MFU", "Time breakdown per step (mean over ranks)",
                                   "Bytes sent per step (rank 0)"]
    assert pipeline_titles[4] == "Pipeline timeline of step 3 (1f1b, pp = 2)"
    figure, _ = drawn(data_parallel_run)
    dp_titles = [axes.get_title(loc="left") for axes in panels(figure)]
    assert not any("ipeline timeline" in title for title in dp_titles), dp_titles
    assert dp_titles[4].startswith("Step 3 per rank") and "pp = 1" in dp_titles[4]
    assert "dp 2 tp 1 pp 1" in figure.get_suptitle()
    assert panel_titles({"parallel": {"pp": 4, "schedule": "interleaved", "virtual_stages": 2}}, 7)[4] == \
        "Pipeline timeline of step 7 (interleaved, pp = 4, 2 chunks per rank)"


@pytest.mark.parametrize("run", ["pipeline_run", "data_parallel_run"])
def test_each_legend_sits_beside_its_own_panel(run, request):
    """Every panel but the timeline's placeholder has a legend; it is right of its panel, top-aligned with it, and
    overlaps no panel (nor the MFU axis's labels)."""
    figure, renderer = drawn(request.getfixturevalue(run))
    titled = panels(figure)
    boxes = [axes.get_window_extent(renderer) for axes in titled]
    twin = next(axes for axes in figure.axes if axes not in titled)
    for index, axes in enumerate(titled):
        title = axes.get_title(loc="left")
        legend = axes.get_legend() or (twin.get_legend() if index == 1 else None)
        assert legend is not None, f"panel {title!r} has no legend"
        box = legend.get_window_extent(renderer)
        own = boxes[index]
        assert box.x0 >= own.x1, f"legend of {title!r} is not right of its panel"
        assert abs(box.y1 - own.y1) < 2, f"legend of {title!r} is not level with its panel"
        assert not any(box.overlaps(other) for other in boxes), f"legend of {title!r} covers a panel"
        if index == 1:
            assert box.x0 >= twin.yaxis.get_tightbbox(renderer).x1, "the throughput legend covers the MFU axis"


def test_readable_at_full_size(pipeline_run):
    """At 100% zoom: the PNG is at least 1,000 pixels wide and no tick label, axis label, title or legend entry is
    set below 10 points (about 14 pixels at the figure's dpi)."""
    from matplotlib.text import Text

    figure, _ = drawn(pipeline_run)
    assert figure.get_size_inches()[0] * figure.dpi >= 1000
    texts = [text for text in figure.findobj(Text) if text.get_text().strip() and text.get_visible()]
    assert texts and min(text.get_fontsize() for text in texts) >= 10


def test_png_and_html(pipeline_run, tmp_path):
    from PIL import Image

    out = tmp_path / "report.png"
    result = CliRunner().invoke(main, ["report", str(pipeline_run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    with Image.open(out) as image:
        described = image.text["Description"].split(" | ")
        assert image.size[0] >= 1000
    assert described == [axes.get_title(loc="left") for axes in panels(drawn(pipeline_run)[0])]
    page = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["report", str(pipeline_run), "--out", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "data:image/png;base64," in text and "Pipeline timeline" in text


def test_a_run_still_going(pipeline_run, tmp_path):
    """A torn last row and no timeline.json or config.toml yet: drawn, the timeline panel saying so."""
    going = tmp_path / "going"
    going.mkdir()
    text = (pipeline_run / "metrics.jsonl").read_text()
    (going / "metrics.jsonl").write_text(text + text.splitlines()[-1][:40])  # a row being written: torn
    figure, _ = drawn(going)
    timeline = panels(figure)[4]
    assert timeline.get_title(loc="left") == "Timeline of step 3, per rank"
    assert [text.get_text() for text in timeline.texts] == ["no timeline yet"]


def test_bad_inputs_are_one_line(tmp_path):
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code != 0 and "metrics.jsonl not found" in result.output
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    result = CliRunner().invoke(main, ["report", str(tmp_path), "--out", str(tmp_path / "r.pdf")])
    assert result.exit_code != 0 and ".png or .html" in result.output


def test_mean_breakdown():
    row = {"breakdown": [{"forward": 1.0, "comm.all_reduce.dp": 2.0}, {"forward": 3.0}]}
    assert mean_breakdown(row) == {"forward": 2.0, "comm.all_reduce.dp": 1.0}
