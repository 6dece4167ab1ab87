"""Launch a lab's ranks with mpiexec, collect the result, print the table "claim | formula | measured here", plot.

Rows carry their own check: `expected` and `tolerance` for a deterministic quantity (bytes held, bytes moved,
the bubble of the recorded event order), None for a time, which is printed but never checked.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mpitrain.errors import MpitrainError
from mpitrain.launcher import find_mpiexec

RESULT_PREFIX = "LAB-RESULT "
# MPICH's yield settings and one BLAS thread per rank: several ranks share a few cores (docs/architecture.md, Backends).
OVERSUBSCRIBED = {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
                  "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
REPO_ROOT = Path(__file__).resolve().parents[2]  # the labs read configs/*.toml from there


@dataclass
class Row:
    claim: str
    formula: str
    measured: str
    value: float | None = None  # the measured number a check compares
    expected: float | None = None  # None: a time or a ratio of times, shown only
    tolerance: float = 0.0

    @property
    def checked(self) -> bool:
        return self.expected is not None

    @property
    def holds(self) -> bool:
        return not self.checked or abs(self.value - self.expected) <= self.tolerance


def run_job(lab, quick: bool, timeout: float = 600) -> dict:
    """Run lab.job on lab.ranks(quick) MPI ranks; returns what rank 0 printed after RESULT_PREFIX."""
    if hasattr(lab, "run_host"):  # the lab launches its own jobs (faults: mpitrain launch)
        return lab.run_host(quick)
    mpiexec = find_mpiexec()
    env = dict(os.environ, **OVERSUBSCRIBED)
    command = [mpiexec, "-n", str(lab.ranks(quick)), sys.executable, "-m", "mpitrain.lab.worker", lab.NAME,
               "quick" if quick else "full"]
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, text=True, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise MpitrainError(f"lab {lab.NAME}: its ranks did not finish within {timeout:.0f} s") from exc
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise MpitrainError(f"lab {lab.NAME}: its ranks failed (exit {done.returncode}):\n{tail}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def format_table(rows: list[Row]) -> str:
    header = ("claim", "formula", "measured here", "check")
    cells = [header] + [(r.claim, r.formula, r.measured, ("ok" if r.holds else "FAILS") if r.checked else "-")
                        for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(4)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def save_plot(lab, result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, lab.PANELS, figsize=(max(4.2 * lab.PANELS, 6.4), 3.2))  # room for the title
    lab.plot(result, axes if lab.PANELS > 1 else [axes])
    figure.suptitle(lab.TITLE, fontsize=10)
    figure.tight_layout()
    figure.savefig(png, dpi=80)
    plt.close(figure)


def run_lab(lab, quick: bool, png: Path | None = None) -> tuple[str, list[Row]]:
    """The printed report of one lab and its rows (tests check `row.holds` on each)."""
    result = run_job(lab, quick)
    rows = lab.rows(result)
    if png is not None:
        save_plot(lab, result, png)
    return f"{lab.TITLE}\n\n{format_table(rows)}", rows
