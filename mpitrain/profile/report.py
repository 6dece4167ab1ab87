"""`mpitrain report RUN_DIR`: a run's health at a glance, from the files the run writes as it goes.

    metrics.jsonl    one row per logged step: loss, val_loss, tokens/s, MFU, comm_bytes, breakdown (every rank's)
    timeline.json    the pipeline events of the last logged step, every rank (profile/breakdown.gather_step)

Panels: loss and validation loss; tokens/s and MFU; the stacked time breakdown per step (mean over ranks, so the
stack is the mean step time); bytes sent per kind per step; the Gantt chart of one step per rank. Reading tolerates
a torn last line, so it works on a run still going. Needs matplotlib (pip install 'mpitrain[plot]').
"""
from __future__ import annotations

import base64
import contextlib
import html
import io
import json
from itertools import pairwise
from pathlib import Path

from mpitrain.errors import MpitrainError
from mpitrain.profile.breakdown import COMM_PREFIX, ordered_parts
from mpitrain.profile.jsonl import read_records

PANEL_TITLES = ("Loss", "Throughput and MFU", "Time breakdown per step (mean over ranks)",
                "Bytes sent per step (rank 0)", "Pipeline timeline")
_EVENT_COLORS = {"forward": "#4c72b0", "backward": "#55a868", "backward_input": "#55a868",
                 "backward_weight": "#c44e52", "reduce_grads": "#8172b2"}
_WAIT_COLOR = "#bbbbbb"


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


def mean_breakdown(row: dict) -> dict:
    """The row's breakdown averaged over ranks (parts a rank lacks count 0)."""
    ranks = row.get("breakdown") or []
    keys = {key for parts in ranks for key in parts}
    return {key: sum(parts.get(key, 0.0) for parts in ranks) / len(ranks) for key in keys} if ranks else {}


def _plot_loss(axes, rows):
    steps = [row["step"] for row in rows]
    axes.plot(steps, [row["loss"] for row in rows], label="train loss")
    val = [(row["step"], row["val_loss"]) for row in rows if "val_loss" in row]
    if val:
        axes.plot(*zip(*val), "o-", label="validation loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats/token)")
    axes.legend(fontsize=8)


def _plot_throughput(axes, rows):
    steps = [row["step"] for row in rows]
    axes.plot(steps, [row["tokens_per_s"] for row in rows], color="#4c72b0", label="tokens/s")
    axes.set_xlabel("step")
    axes.set_ylabel("tokens/s")
    mfu_axes = axes.twinx()
    mfu_axes.plot(steps, [100 * row["mfu"] for row in rows], "o", markersize=4, color="#dd8452", label="MFU")
    if any(row.get("hardware_mfu", row["mfu"]) != row["mfu"] for row in rows):  # recomputation: more hardware work
        mfu_axes.plot(steps, [100 * row.get("hardware_mfu", row["mfu"]) for row in rows], "x", color="#c44e52",
                      label="hardware MFU")
    mfu_axes.set_ylabel("MFU (%)")
    lines = axes.get_lines() + mfu_axes.get_lines()
    axes.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="lower right")


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
    axes.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))


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
    axes.set_ylabel("MB sent (ring-algorithm bytes)")
    if kinds:
        axes.legend(fontsize=7)


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
    axes.set_xlabel(f"time in step {timeline.get('step')} (ms)")
    from matplotlib.patches import Patch

    axes.legend(handles=[Patch(color=_EVENT_COLORS["forward"], label="forward"),
                         Patch(color=_EVENT_COLORS["backward"], label="backward / input grad"),
                         Patch(color=_EVENT_COLORS["backward_weight"], label="weight grad"),
                         Patch(color=_EVENT_COLORS["reduce_grads"], label="reduce grads"),
                         Patch(color=_WAIT_COLOR, label="send / recv")], fontsize=7, ncol=5,
                loc="lower left", bbox_to_anchor=(0.0, 1.08), frameon=False)


def render(run_dir, out) -> list[str]:
    """Draw the report of `run_dir` into `out` (.png, or .html embedding the PNG and the last row); returns the
    panels' titles."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MpitrainError("mpitrain report needs matplotlib: pip install 'mpitrain[plot]'") from None
    out = Path(out)
    if out.suffix not in (".png", ".html"):
        raise MpitrainError(f"--out {out}: the report is written as .png or .html")
    rows, timeline = load_run(run_dir)
    figure = Figure(figsize=(15, 12), layout="constrained")
    grid = figure.add_gridspec(3, 2)
    panels = [figure.add_subplot(grid[0, 0]), figure.add_subplot(grid[0, 1]), figure.add_subplot(grid[1, 0]),
              figure.add_subplot(grid[1, 1]), figure.add_subplot(grid[2, :])]
    for axes, draw, data in zip(panels, (_plot_loss, _plot_throughput, _plot_breakdown, _plot_bytes, _plot_gantt),
                                (rows, rows, rows, rows, timeline)):
        draw(axes, data)
    titles = list(PANEL_TITLES)
    for axes, title in zip(panels, titles):
        axes.set_title(title, loc="left", fontsize=11)
    figure.suptitle(f"{Path(run_dir).resolve().name}: step {rows[-1]['step']}", fontsize=12)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=70, metadata={"Title": "mpitrain report",
                                                            "Description": " | ".join(titles)})
    if out.suffix == ".png":
        out.write_bytes(buffer.getvalue())
    else:
        image = base64.b64encode(buffer.getvalue()).decode()
        last = html.escape(json.dumps({k: v for k, v in rows[-1].items() if k != "breakdown"}, indent=1))
        out.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>mpitrain report</title></head>"
                       f"<body><h1>{html.escape(str(run_dir))}</h1><img alt='{' | '.join(titles)}' "
                       f"src='data:image/png;base64,{image}'><h2>Last logged step</h2><pre>{last}</pre>"
                       f"</body></html>")
    return titles
