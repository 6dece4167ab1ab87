"""The composability table: each feature (row) under each parallel layout (column), measured.

    python benchmarks/composability.py [--all | --pairwise] [--jobs N] [--out docs/composability.md]

A cell runs the real `mpitrain train` on configs/tiny.toml for a few steps in float64 on synthetic data, under
mpiexec with the layout's rank count, and holds it to the one-process run of the same config (run once per row and
reused across the row's layouts): the loss of every step and every final parameter (whole tensors read from the
checkpoint, whatever layout wrote it) within a relative 1e-10. A cell is then one of

    parity    the layout run matches, with the largest relative difference seen
    refused   the tool refused the combination before training: its one-line reason is the cell's note
    MISMATCH  it ran and differs from the one-process run: a bug
    ERROR     it crashed, hung or printed a traceback: a bug

--pairwise runs a covering subset (every feature, every layout and each named pair at least once: the CI test,
tests/test_composability.py); --all runs every cell. The markdown goes to --out, a summary line to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from mpitrain.checkpoint.resume import resolve_checkpoint  # noqa: E402
from mpitrain.checkpoint.store import Checkpoint  # noqa: E402
from tests.mpi_helpers import OVERSUBSCRIBED_ENV, find_mpiexec  # noqa: E402

RTOL = 1e-10
STEPS = 3  # the warm-up (2 steps) and one step of the decay after it
BASE = ["data.synthetic=true", "precision.compute=float64", f"train.steps={STEPS}", "train.micro_batch=2",
        "train.sample_tokens=0"]
CELL_TIMEOUT_S = 300
MOE = "model.moe={experts = 4, top_k = 2}"
# A refusal that promises a later version ("not supported yet", "not split ... yet") gives no reason why the
# combination cannot work.
NO_REASON = re.compile(r"not supported|unsupported|not implemented|\byet\b", re.IGNORECASE)
# Rows whose math is the dense row's by design: recomputation rebuilds the same activations, offload moves the same
# state, adamw is the default optimizer. Every other row must change the one-process run (its keys took effect).
SAME_MATH_AS_DENSE = ("dense gpt2", "recompute full", "recompute selective", "offload host", "offload disk", "adamw")


@dataclass(frozen=True)
class Feature:
    name: str
    settings: tuple[str, ...]
    moe: bool = False  # expert-parallel layouts apply only to models with experts


@dataclass(frozen=True)
class Layout:
    name: str
    ranks: int
    settings: tuple[str, ...]
    experts_only: bool = False
    model: tuple[str, ...] = ()  # model keys the layout needs, given to the one-process reference too


FEATURES = [
    Feature("dense gpt2", ()),
    Feature("dense llama", ("model.arch=llama", "model.n_kv_head=2")),
    Feature("MoE", (MOE,), moe=True),
    Feature("LoRA", ("lora.rank=4",)),
    Feature("recompute full", ("memory.recompute=full",)),
    Feature("recompute selective", ("memory.recompute=selective",)),
    Feature("offload host", ("memory.offload=host",)),
    Feature("offload disk", ("memory.offload=disk",)),
    Feature("adamw", ("optim.name=adamw",)),
    Feature("adafactor", ("optim.name=adafactor",)),
    Feature("adam8bit", ("optim.name=adam8bit",)),
    Feature("sgd", ("optim.name=sgd",)),
    Feature("document mask", ("data.document_mask=true",)),
    Feature("batch ramp-up", ("train.batch_rampup=[4, 4, 8]",)),
    Feature("MoE + LoRA", (MOE, "lora.rank=4"), moe=True),
    Feature("MoE + recompute selective", (MOE, "memory.recompute=selective"), moe=True),
    Feature("adafactor + offload host", ("optim.name=adafactor", "memory.offload=host")),
]

LAYOUTS = [
    Layout("dp 2", 2, ()),
    Layout("ZeRO-1", 2, ("parallel.zero=1",)),
    Layout("ZeRO-2", 2, ("parallel.zero=2",)),
    Layout("ZeRO-3", 2, ("parallel.zero=3",)),
    Layout("tp 2", 2, ("parallel.tp=2",)),
    Layout("tp 2 + SP", 2, ("parallel.tp=2", "parallel.sequence_parallel=true")),
    Layout("pp 2 gpipe", 2, ("parallel.pp=2", "parallel.schedule=gpipe")),
    Layout("pp 2 1f1b", 2, ("parallel.pp=2", "parallel.schedule=1f1b")),
    Layout("pp 2 zb1p", 2, ("parallel.pp=2", "parallel.schedule=zb1p")),
    # two chunks on each of two stages need four layers
    Layout("pp 2 interleaved", 2, ("parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"),
           model=("model.n_layer=4",)),
    Layout("cp 2", 2, ("parallel.cp=2",)),
    Layout("ep 2", 2, ("parallel.ep=2",), experts_only=True),
    Layout("cp 2 + ep 2", 2, ("parallel.cp=2", "parallel.ep=2"), experts_only=True),
    Layout("dp 2 x tp 2", 4, ("parallel.tp=2",)),
    Layout("pp 2 x tp 2", 4, ("parallel.pp=2", "parallel.tp=2")),
    Layout("dp 2 x cp 2", 4, ("parallel.cp=2",)),
    Layout("dp 2 x pp 2 x tp 2 ZeRO-1", 8, ("parallel.pp=2", "parallel.tp=2", "parallel.zero=1")),
]

# The covering subset: every feature, every layout and each named pair (MoE with LoRA, with selective recompute,
# with cp; Adafactor with offload) at least once.
PAIRWISE = [
    ("dense gpt2", "dp 2 x pp 2 x tp 2 ZeRO-1"), ("dense llama", "tp 2 + SP"), ("dense llama", "pp 2 interleaved"),
    ("MoE", "ep 2"), ("MoE", "cp 2"), ("MoE", "cp 2 + ep 2"), ("LoRA", "ZeRO-3"), ("LoRA", "pp 2 1f1b"),
    ("recompute full", "pp 2 x tp 2"), ("recompute selective", "dp 2 x cp 2"), ("offload host", "ZeRO-2"),
    ("offload disk", "ZeRO-1"), ("adamw", "dp 2"), ("adafactor", "tp 2"), ("adam8bit", "ZeRO-3"),
    ("sgd", "pp 2 zb1p"), ("document mask", "dp 2 x tp 2"), ("document mask", "cp 2"),
    ("batch ramp-up", "pp 2 gpipe"), ("MoE + LoRA", "ep 2"), ("MoE + LoRA", "ZeRO-3"), ("MoE + LoRA", "tp 2"),
    ("MoE + recompute selective", "ep 2"),
    ("adafactor + offload host", "ZeRO-1"),
]


@dataclass
class Outcome:
    """One run: its exit status, the refusal line (if any), and (when it trained) its losses and final tensors."""
    command: str
    returncode: int
    stderr: str = ""
    losses: list = field(default_factory=list)
    params: dict = field(default_factory=dict)

    @property
    def refusal(self) -> str | None:
        """The tool's one-line refusal: a nonzero exit with an `ERROR:` line and no traceback."""
        lines = [line[len("ERROR: "):].strip() for line in self.stderr.splitlines() if line.startswith("ERROR: ")]
        if self.returncode != 0 and lines and "Traceback" not in self.stderr:
            return lines[0]
        return None


@dataclass
class Cell:
    feature: str
    layout: str
    status: str  # parity | refused | MISMATCH | ERROR
    detail: str = ""  # the refusal, the mismatch or the error
    max_rel_diff: float | None = None
    command: str = ""
    seconds: float = 0.0
    reference_losses: list = field(default_factory=list)  # the one-process run's (step, loss)

    @property
    def refused_without_reason(self) -> bool:
        return self.status == "refused" and bool(NO_REASON.search(self.detail))


def find_feature(name: str) -> Feature:
    return next(f for f in FEATURES if f.name == name)


def find_layout(name: str) -> Layout:
    return next(lay for lay in LAYOUTS if lay.name == name)


def applies(feature: Feature, layout: Layout) -> bool:
    """Expert parallelism splits experts: a dense model has none (the cell is N/A, not refused)."""
    return feature.moe or not layout.experts_only


def train(ranks: int, settings: list[str], run_dir: Path) -> Outcome:
    """`mpitrain train configs/tiny.toml` on `ranks` ranks: the outcome with losses and final full tensors."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise SystemExit("no mpiexec beside the Python interpreter or on PATH: pip install -e '.[mpich]'")
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir)]
    for setting in settings:
        args += ["--set", setting]
    command = [mpiexec, "-n", str(ranks), sys.executable, *args]
    env = {**os.environ, **OVERSUBSCRIBED_ENV,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    shown = " ".join(["mpiexec", "-n", str(ranks), "python", *(repr(a) if " " in a else a for a in args)])
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=CELL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)  # mpiexec and every rank it started: a new session of their own
        process.communicate()
        return Outcome(shown, -9, f"timed out after {CELL_TIMEOUT_S} s (hung?)")
    outcome = Outcome(shown, process.returncode, stderr)
    if process.returncode == 0:
        try:
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            outcome.losses = [(row["step"], row["loss"]) for row in rows]
            outcome.params = final_params(run_dir)
        except Exception as exc:  # noqa: BLE001 -- a run that trained but left no readable result is an error cell
            outcome.returncode, outcome.stderr = -1, f"unreadable result: {type(exc).__name__}: {exc}"
    return outcome


def final_params(run_dir: Path) -> dict:
    """Every full tensor of the run's newest checkpoint, whatever layout wrote it."""
    checkpoint = Checkpoint.open(resolve_checkpoint(run_dir))
    return {name: checkpoint.read_box("param", name, (0,) * len(info["global_shape"]), info["global_shape"],
                                      np.float64) for name, info in checkpoint.tensors().items()}


def relative_difference(reference: Outcome, other: Outcome) -> tuple[float, str]:
    """The largest relative difference over the step losses and the final tensors (each tensor's norm of the
    difference over its norm), and what differs in kind (steps, tensor names) if anything."""
    if [step for step, _ in other.losses] != [step for step, _ in reference.losses]:
        steps = [[step for step, _ in run.losses] for run in (other, reference)]
        return float("inf"), f"logged steps differ: {steps[0]} against {steps[1]}"
    if other.params.keys() != reference.params.keys():
        return float("inf"), f"tensor names differ: {sorted(set(other.params) ^ set(reference.params))}"
    worst = 0.0
    for (_, ref), (_, got) in zip(reference.losses, other.losses):
        worst = max(worst, abs(got - ref) / abs(ref))
    for name, ref in reference.params.items():
        scale = np.linalg.norm(ref)
        diff = np.linalg.norm(other.params[name] - ref)
        worst = max(worst, float(diff / scale) if scale > 0 else float(diff))
    return worst, ""


def judge(feature: Feature, layout: Layout, reference: Outcome, run: Outcome, seconds: float) -> Cell:
    cell = Cell(feature.name, layout.name, "ERROR", command=run.command, seconds=seconds,
                reference_losses=reference.losses)
    if run.refusal is not None:
        cell.status, cell.detail = "refused", run.refusal
    elif run.returncode != 0:
        cell.detail = f"exit {run.returncode}: {last_lines(run.stderr)}"
    elif reference.returncode != 0:
        cell.detail = f"the layout ran but the one-process run did not ({reference.command}): " + (
            reference.refusal or last_lines(reference.stderr))
    else:
        cell.max_rel_diff, why = relative_difference(reference, run)
        if cell.max_rel_diff <= RTOL:
            cell.status = "parity"
        else:
            cell.status = "MISMATCH"
            cell.detail = why or f"largest relative difference {cell.max_rel_diff:.1e} > {RTOL:g}"
    return cell


def last_lines(text: str, count: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-count:])[-600:]


def reference_settings(feature: Feature, layout: Layout) -> tuple[str, ...]:
    return (*BASE, *feature.settings, *layout.model)


def run_cells(pairs: list[tuple[str, str]], jobs: int = 1, scratch: Path | None = None) -> list[Cell]:
    """Measure the cells (feature name, layout name): the one-process references first, one per distinct config,
    then the layout runs, `jobs` mpiexec jobs at a time."""
    scratch = Path(scratch or tempfile.mkdtemp(prefix="composability-"))
    cells = [(find_feature(f), find_layout(lay)) for f, lay in pairs]
    configs = sorted({reference_settings(f, lay) for f, lay in cells})
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        outcomes = pool.map(lambda i: train(1, list(configs[i]), scratch / f"one-{i:03d}"), range(len(configs)))
        references = dict(zip(configs, outcomes))

        def measure(index: int) -> Cell:
            feature, layout = cells[index]
            start = time.perf_counter()
            run = train(layout.ranks, [*reference_settings(feature, layout), *layout.settings],
                        scratch / f"cell-{index:03d}")
            reference = references[reference_settings(feature, layout)]
            return judge(feature, layout, reference, run, time.perf_counter() - start)
        return list(pool.map(measure, range(len(cells))))


def all_pairs() -> list[tuple[str, str]]:
    return [(f.name, lay.name) for f in FEATURES for lay in LAYOUTS if applies(f, lay)]


def cell_text(cell: Cell | None, notes: dict[str, str]) -> str:
    """A table cell: the largest difference at parity, else a numbered note (refusals R, bugs B)."""
    if cell is None:
        return "·"
    if cell.status == "parity":
        return f"✓ {cell.max_rel_diff:.0e}"
    kind = "R" if cell.status == "refused" else "B"
    text = cell.detail if cell.status == "refused" else f"{cell.status}: {cell.detail} — `{cell.command}`"
    if text not in notes:
        notes[text] = f"{kind}{sum(1 for label in notes.values() if label[0] == kind) + 1}"
    label = notes[text]
    if cell.refused_without_reason:
        return f"**refused, no reason** {label}"
    return f"refused {label}" if cell.status == "refused" else f"**{cell.status}** {label}"


def counts(cells: list[Cell]) -> dict[str, int]:
    return {status: sum(c.status == status for c in cells) for status in ("parity", "refused", "MISMATCH", "ERROR")}


def render(cells: list[Cell], mode: str, seconds: float, jobs: int) -> str:
    """docs/composability.md: how it was made, the table, then the refusals' reasons and any bugs."""
    by_pair = {(c.feature, c.layout): c for c in cells}
    n = counts(cells)
    every = len(all_pairs())
    lines = [
        "# Composability: features against parallel layouts",
        "",
        (f"Generated by `python benchmarks/composability.py --{mode} --jobs {jobs}` ({len(cells)} of the {every} "
         f"cells, {seconds / 60:.1f} min on 2 cores); `--all` measures every cell. Do not edit by hand."),
        "",
        (f"Each cell runs `mpitrain train configs/tiny.toml` for {STEPS} steps in float64 on synthetic data "
         f"(`{' '.join('--set ' + s for s in BASE)}`, plus the row's and the column's keys) and compares it with "
         "the one-process run of the same config: the loss of every step and every final parameter (whole tensors "
         "read back from the checkpoint), relative difference per tensor as |Δ|/|ref|."),
        "",
        f"- `✓ d`: parity; d is the largest relative difference (must be <= {RTOL:g}).",
        "- `refused Rn`: the tool refused the combination before training; the reason it gives is note Rn below.",
        "- `MISMATCH` / `ERROR` (note Bn): the run trained and differs from one process, or crashed: a bug.",
        "- `N/A`: expert parallelism on a model without experts. `·`: not measured in this run of the script.",
        ("- `refused, no reason`: the refusal says `not supported` or `yet`, no reason that holds for any "
         f"implementation; the CI test fails on it as on a bug. Rows {', '.join(SAME_MATH_AS_DENSE[1:])} are the "
         "dense gpt2 row's math by design (same activations recomputed, same state moved, the default optimizer): "
         "equal numbers are expected."),
        "",
        f"Cells: {n['parity']} at parity, {n['refused']} refused, {n['MISMATCH']} mismatching, {n['ERROR']} errors.",
        ("Not a row: `precision.grad_reduce = bfloat16` (a float64 run held to 1e-10 cannot measure a reduction "
         "that rounds to 8 bits; tests/test_precision.py checks it at bfloat16 tolerances)."),
        "",
    ]
    notes: dict[str, str] = {}
    lines.append("| feature | " + " | ".join(lay.name for lay in LAYOUTS) + " |")
    lines.append("|---" * (len(LAYOUTS) + 1) + "|")
    for feature in FEATURES:
        row = [cell_text(by_pair.get((feature.name, lay.name)), notes) if applies(feature, lay) else "N/A"
               for lay in LAYOUTS]
        lines.append(f"| {feature.name} | " + " | ".join(row) + " |")
    lines += ["", "Feature keys: " + "; ".join(f"{f.name}: `{' '.join(f.settings) or '(tiny.toml as is)'}`"
                                                for f in FEATURES) + ".",
              "", "Layout keys: " + "; ".join(f"{lay.name} ({lay.ranks} ranks): `{' '.join(lay.settings) or '-'}`"
                                                + (f" (and `{' '.join(lay.model)}` in both runs)" if lay.model else "")
                                                for lay in LAYOUTS) + "."]
    for kind, title in (("R", "Refusals (the tool's one-line reasons)"), ("B", "Bugs: cells that ran and failed")):
        mine = [(label, text) for text, label in notes.items() if label[0] == kind]
        if mine:
            lines += ["", f"## {title}", ""] + [f"- **{label}**: {text}" for label, text in mine]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every cell of the table")
    which.add_argument("--pairwise", action="store_true", help="the covering subset (the default)")
    parser.add_argument("--jobs", type=int, default=1, help="mpiexec jobs at a time")
    parser.add_argument("--out", default="docs/composability.md")
    parser.add_argument("--scratch", default="", help="folder for the run directories (default: a new temporary)")
    args = parser.parse_args(argv)
    mode = "all" if args.all else "pairwise"
    start = time.perf_counter()
    cells = run_cells(all_pairs() if args.all else PAIRWISE, args.jobs, Path(args.scratch) if args.scratch else None)
    seconds = time.perf_counter() - start
    Path(args.out).write_text(render(cells, mode, seconds, args.jobs))
    for cell in cells:
        if cell.status in ("MISMATCH", "ERROR") or cell.refused_without_reason:
            print(f"{cell.status} {cell.feature} x {cell.layout}: {cell.detail}\n  {cell.command}")
    print(json.dumps({"mode": mode, "cells": len(cells), **counts(cells), "seconds": round(seconds, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
