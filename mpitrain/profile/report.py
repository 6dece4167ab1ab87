"""`mpitrain report RUN_DIR`: a run's health at a glance, from the files the run writes as it goes.

    config.toml      the resolved config: the layout named in the titles (a timeline is a pipeline's only if pp > 1)
    metrics.jsonl    one row per logged step: loss, val_loss, tokens/s, MFU, comm_bytes, breakdown (every rank's)
    timeline.json    the events of the last logged step, every rank (profile/breakdown.gather_step)

Panels, one above the other so the step axes line up (a slow step shows in every panel at the same x): loss and
validation loss; tokens/s and MFU; the stacked time breakdown per step (mean over ranks, so the stack is the mean
step time); bytes sent per kind per step; the last logged step per rank. Each legend sits to the right of its own
panel, outside the data. An MoE run's title adds each block's busiest expert over uniform (last logged step).
Reading tolerates a torn last line, so it works on a run still going. Needs matplotlib (pip install 'mpitrain[report]').
"""
from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import tomllib
from itertools import pairwise
from pathlib import Path

from mpitrain.errors import MpitrainError
from mpitrain.profile.breakdown import COMM_PREFIX, ordered_parts
from mpitrain.profile.jsonl import read_records
from mpitrain.profile.moe_metrics import expert_load_line

_EVENT_COLORS = {"forward": "#4c72b0", "backward": "#55a868", "backward_input": "#55a868",
                 "backward_weight": "#c44e52", "reduce_grads": "#8172b2"}
_WAIT_COLOR = "#bbbbbb"
_TOKENS_COLOR, _MFU_COLOR = "#4c72b0", "#dd8452"
# Sizes for a PNG read at 100% zoom: 12 x 16 inches at 100 dpi, text at 11 pt (about 15 pixels high).
FIGURE_INCHES, DPI, FONT_PT = (12, 16), 100, 11


def load_run(run_dir) -> tuple[list[dict], dict | None]:
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise MpitrainError(f"{metrics} not found: RUN_DIR is the --out directory of `mpitrain train`")
    rows = [row for row in read_records(metrics) if "step" in row]
    if not rows:
        raise MpitrainError(f"{metrics} has no logged step yet")
    timeline = None
    with contextlib.suppress(OSError, ValueError):  # not yet written, or cut short: the panel says so
        timeline = json.loads((run_dir / "timeline.json").read_text())
    return rows, timeline


def load_config(run_dir) -> dict:
    """RUN_DIR/config.toml as a dict; {} when the run has none (the titles then name no layout)."""
    with contextlib.suppress(OSError, tomllib.TOMLDecodeError):
        return tomllib.loads((Path(run_dir) / "config.toml").read_text())
    return {}


def panel_titles(config: dict, step) -> list[str]:
    """The five panels' titles; the last one calls the timeline a pipeline's only when the run has pp > 1."""
    parallel = config.get("parallel", {})
    pp = parallel.get("pp")
    if pp is None:
        timeline = f"Timeline of step {step}, per rank"
    elif pp > 1:
        schedule = parallel.get("schedule", "1f1b")
        chunks = parallel.get("virtual_stages", 1)
        shape = f"{schedule}, pp = {pp}" + (f", {chunks} chunks per rank" if schedule == "interleaved" else "")
        timeline = f"Pipeline timeline of step {step} ({shape})"
    else:
        timeline = f"Step {step} per rank: forward, backward, gradient reduction (no pipeline: pp = 1)"
    return ["Loss", "Throughput and MFU", "Time breakdown per step (mean over ranks)",
            "Bytes sent per step (rank 0)", timeline]


def layout_words(config: dict) -> str:
    """'dp 2 tp 1 pp 1 cp 1 ep 1, ZeRO-0' from the resolved config, '' without one."""
    parallel = config.get("parallel", {})
    if not parallel:
        return ""
    degrees = " ".join(f"{name} {parallel.get(name, 1)}" for name in ("dp", "tp", "pp", "cp", "ep"))
    return f"{degrees}, ZeRO-{parallel.get('zero', 0)}"


def mean_breakdown(row: dict) -> dict:
    """The row's breakdown averaged over ranks (parts a rank lacks count 0)."""
    ranks = row.get("breakdown") or []
    keys = {key for parts in ranks for key in parts}
    return {key: sum(parts.get(key, 0.0) for parts in ranks) / len(ranks) for key in keys} if ranks else {}


def _legend_beside(axes, handles=None, labels=None):
    """The legend to the right of its own panel, top-aligned with it: it never covers data, and a reader finds it
    level with the panel it explains."""
    options = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0, "fontsize": FONT_PT - 1}
    if handles is None:
        return axes.legend(**options)
    return axes.legend(handles, labels, **options)


def _plot_loss(axes, rows):
    steps = [row["step"] for row in rows]
    axes.plot(steps, [row["loss"] for row in rows], label="train loss")
    val = [(row["step"], row["val_loss"]) for row in rows if "val_loss" in row]
    if val:
        axes.plot(*zip(*val), "o-", label="validation loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats/token)")
    _legend_beside(axes)


def _plot_throughput(axes, rows):
    """tokens/s on the left axis, MFU on the right; each axis is coloured like its series, and the legend (beside
    the panel) names both."""
    steps = [row["step"] for row in rows]
    axes.plot(steps, [row["tokens_per_s"] for row in rows], color=_TOKENS_COLOR, label="tokens/s (left axis)")
    axes.set_xlabel("step")
    axes.set_ylabel("tokens/s", color=_TOKENS_COLOR)
    mfu_axes = axes.twinx()
    mfu_axes.plot(steps, [100 * row["mfu"] for row in rows], "o", markersize=4, color=_MFU_COLOR,
                  label="MFU (right axis)")
    if any(row.get("hardware_mfu", row["mfu"]) != row["mfu"] for row in rows):  # recomputation: more hardware work
        mfu_axes.plot(steps, [100 * row.get("hardware_mfu", row["mfu"]) for row in rows], "x", color="#c44e52",
                      label="hardware MFU (right axis)")
    mfu_axes.set_ylabel("MFU (%)", color=_MFU_COLOR)
    lines = axes.get_lines() + mfu_axes.get_lines()
    # Beside the panel as the others, but past the MFU axis's tick labels and name (the twin's tight box).
    legend = _legend_beside(mfu_axes, lines, [line.get_label() for line in lines])
    legend.set_bbox_to_anchor((1.09, 1.0), transform=mfu_axes.transAxes)


def _plot_breakdown(axes, rows):
    means = [(row["step"], mean_breakdown(row)) for row in rows if row.get("breakdown")]
    if not means:
        axes.text(0.5, 0.5, "no breakdown logged", ha="center", va="center", transform=axes.transAxes)
        return
    keys = {key for _, parts in means for key in parts}
    order = [key for key in ordered_parts(dict.fromkeys(keys)) if key in keys]
    steps = [step for step, _ in means]
    bottom = [0.0] * len(means)
    colors = _part_colors(order)
    for key in order:
        heights = [1e3 * parts.get(key, 0.0) for _, parts in means]
        if not any(heights):
            continue
        axes.bar(steps, heights, bottom=bottom, label=key.removeprefix(COMM_PREFIX), color=colors[key],
                 width=_bar_width(steps))
        bottom = [b + h for b, h in zip(bottom, heights)]
    axes.set_xlabel("step")
    axes.set_ylabel("time (ms)")
    _legend_beside(axes)


def _bar_width(steps) -> float:
    """Bars as wide as 80% of the logging interval (rows are every log_every steps)."""
    gaps = [b - a for a, b in pairwise(steps) if b > a]
    return 0.8 * min(gaps, default=1)


def _part_colors(order):
    from matplotlib import colormaps

    fixed = {"forward": "#4c72b0", "backward_input": "#55a868", "backward_weight": "#c44e52",
             "pipeline_bubble": "#999999", "optimizer": "#8172b2", "data": "#937860", "checkpoint": "#da8bc3",
             "other": "#dddddd"}
    comm = [key for key in order if key.startswith(COMM_PREFIX)]
    shades = colormaps["autumn"]
    fixed.update({key: shades(i / max(1, len(comm) - 1) * 0.8) for i, key in enumerate(comm)})
    return fixed


def _plot_bytes(axes, rows):
    steps = [row["step"] for row in rows]
    kinds = sorted({kind for row in rows for kind, value in row.get("comm_bytes", {}).items() if value})
    bottom = [0.0] * len(rows)
    for kind in kinds:
        heights = [row.get("comm_bytes", {}).get(kind, 0) / 1e6 for row in rows]
        axes.bar(steps, heights, bottom=bottom, label=kind, width=_bar_width(steps))
        bottom = [b + h for b, h in zip(bottom, heights)]
    axes.set_xlabel("step")
    axes.set_ylabel("MB sent\n(ring-algorithm bytes)")
    if kinds:
        _legend_beside(axes)


def _plot_gantt(axes, timeline):
    if not timeline or not timeline.get("events"):
        axes.text(0.5, 0.5, "no timeline yet", ha="center", va="center", transform=axes.transAxes)
        return
    events = timeline["events"]
    start = min(event["start"] for event in events)
    for event in events:
        kind = event["kind"]
        color = _EVENT_COLORS.get(kind, _WAIT_COLOR)
        axes.barh(event["rank"], 1e3 * (event["end"] - event["start"]), left=1e3 * (event["start"] - start),
                  height=0.7 if kind in _EVENT_COLORS else 0.35, color=color, edgecolor="black", linewidth=0.3)
    ranks = timeline.get("ranks") or 1 + max(event["rank"] for event in events)
    axes.set_yticks(range(ranks), [f"rank {rank}" for rank in range(ranks)])
    axes.invert_yaxis()
    axes.set_xlabel("time since the step began (ms)")
    from matplotlib.patches import Patch

    kinds = {event["kind"] for event in events}
    entries = [("forward", "forward"), ("backward", "backward" if "backward_input" not in kinds else "input grad"),
               ("backward_weight", "weight grad"), ("reduce_grads", "reduce grads")]
    handles = [Patch(color=_EVENT_COLORS[kind], label=label) for kind, label in entries
               if kind in kinds or (kind == "backward" and "backward_input" in kinds)]
    if kinds - set(_EVENT_COLORS):
        handles.append(Patch(color=_WAIT_COLOR, label="send / recv"))
    _legend_beside(axes, handles, [handle.get_label() for handle in handles])


def build_figure(run_dir):
    """The report of `run_dir` as a matplotlib Figure (its axes carry the titles and legends tests read back)."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise MpitrainError("mpitrain report needs matplotlib: pip install 'mpitrain[report]'") from None
    rows, timeline = load_run(run_dir)
    config = load_config(run_dir)
    step = (timeline or {}).get("step", rows[-1]["step"])
    with matplotlib.rc_context({"font.size": FONT_PT, "axes.titlesize": FONT_PT + 1}):
        figure = Figure(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")
        grid = figure.add_gridspec(5, 1, height_ratios=(1, 1, 1.2, 1, 1.2))
        panels = [figure.add_subplot(grid[i, 0]) for i in range(5)]
        for axes, draw, data in zip(panels, (_plot_loss, _plot_throughput, _plot_breakdown, _plot_bytes,
                                             _plot_gantt), (rows, rows, rows, rows, timeline)):
            draw(axes, data)
        for axes, title in zip(panels, panel_titles(config, step)):
            axes.set_title(title, loc="left")
        total = config.get("train", {}).get("steps")
        head = f"{Path(run_dir).resolve().name}: step {rows[-1]['step']}" + (f" of {total}" if total else "")
        layout = layout_words(config)
        moe_line = expert_load_line(next((row for row in reversed(rows) if "expert_load" in row), {}))
        figure.suptitle(head + (f"  ({layout})" if layout else "") + (f"\n{moe_line}" if moe_line else ""),
                        fontsize=FONT_PT + 2)
    return figure


def render(run_dir, out) -> list[str]:
    """Draw the report of `run_dir` into `out` (.png, or .html embedding the PNG and the last row); returns the
    panels' titles."""
    out = Path(out)
    if out.suffix not in (".png", ".html"):
        raise MpitrainError(f"--out {out}: the report is written as .png or .html")
    figure = build_figure(run_dir)
    titles = [axes.get_title(loc="left") for axes in figure.axes if axes.get_title(loc="left")]
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Title": "mpitrain report", "Description": " | ".join(titles)})
    if out.suffix == ".png":
        out.write_bytes(buffer.getvalue())
    else:
        rows, _ = load_run(run_dir)
        image = base64.b64encode(buffer.getvalue()).decode()
        last = html.escape(json.dumps({k: v for k, v in rows[-1].items() if k != "breakdown"}, indent=1))
        out.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>mpitrain report</title></head>"
                       f"<body><h1>{html.escape(str(run_dir))}</h1><img alt='{html.escape(' | '.join(titles))}' "
                       f"src='data:image/png;base64,{image}'><h2>Last logged step</h2><pre>{last}</pre>"
                       f"</body></html>")
    return titles
