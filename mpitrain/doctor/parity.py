"""`mpitrain doctor parity CONFIG -n RANKS`: one step of a layout beside a one-process float64 reference, tensor by
tensor, naming the first tensor that differs (docs/architecture.md, Determinism and parity).

Both runs are the same code (`mpitrain doctor capture`, one process for the reference, mpiexec for the layout) on the
same batch, in float64 with one thread replica. Each rank records, in execution order:

    forward     each unit's output per micro-batch (GPT.observe): its dp rows, its cp chunks, its sp chunk
    grad        each reduced gradient it holds after backward (the state's reduced_grad_window), as pieces
    param, ...  parameters and optimizer state after the update (what a checkpoint would save), as pieces

and saves them with where they sit in the whole: a piece is described in global terms (checkpoint/pieces.py: the
tensor's box a tp rank holds, the flat range a ZeRO shard covers), so each is compared with the same slice of the
reference, never reassembled. Gradients are read after the step: the optimizers leave them unchanged.

The reference keeps the config but every parallel degree is 1 (no ZeRO, no sequence parallelism, no recomputation
or offload), so a mismatch is the layout's. The order of comparison is the order of execution: forward outputs
layer by layer, then gradients from the head down, then the updated state; the first beyond --tol is named.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpitrain.checkpoint.pieces import held_pieces
from mpitrain.config import Config, load_config, resolve_layout
from mpitrain.doctor.plant import PLANT_ENV, plant_from_environment
from mpitrain.errors import MpitrainError
from mpitrain.launcher import find_mpiexec, rank_environment
from mpitrain.parallel.context import split_sequence
from mpitrain.train import Trainer

BOTH = ["precision.compute=float64", "train.thread_replicas=1"]  # float64 to compare at 1e-9; one replica's rows
REFERENCE = ["parallel.dp=1", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1", "parallel.ep=1", "parallel.zero=0",
             "parallel.sequence_parallel=false", "parallel.virtual_stages=1", "parallel.stage_layers=[]",
             "parallel.schedule=1f1b", "memory.recompute=none", "memory.offload=none"]
STAGES = ("forward", "grad")  # then the updated state (param, exp_avg, ...)


# ---- the capture run (every rank of the layout, or the one process of the reference) ---------------------------------
class Recorder:
    """What one rank computed in one training step, with where each array sits in the whole."""

    def __init__(self, trainer: Trainer):
        self.trainer, mesh, cfg = trainer, trainer.mesh, trainer.cfg
        self.micro_per_rank = cfg.train.global_batch // cfg.parallel.dp // cfg.train.micro_batch
        self.first_micro = mesh.dp_rank * self.micro_per_rank  # global micro-batch index of this rank's first
        self.records: list[dict] = []
        self.arrays: list[np.ndarray] = []
        self.seen: Counter = Counter()  # forward calls per unit: the k-th is micro-batch k (every schedule)
        self.skipped: list[str] = []

    def _add(self, record: dict, array) -> None:
        record["index"] = len(self.arrays)
        self.records.append(record)
        self.arrays.append(np.array(self.trainer.backend.to_host(array) if hasattr(array, "shape") else array,
                                    dtype=np.float64))

    def forward_output(self, unit: str, x) -> None:
        micro = self.first_micro + self.seen[unit]
        self.seen[unit] += 1
        if np.ndim(x) == 0 and self.trainer.mesh.cp.size > 1:
            return  # the head's loss sum of this cp rank's tokens only: the step's loss is compared instead
        self._add({"stage": "forward", "tensor": unit, "micro": micro}, x)

    def gradients(self) -> None:
        state, model = self.trainer.state, self.trainer.model
        for i, unit in enumerate(model.units):
            try:
                geometry, (start, end), values = state.reduced_grad_window(i)
            except NotImplementedError as exc:
                self.skipped.append(f"gradients of {unit.layout.name}: {exc}")
                continue
            for held in held_pieces("grad", geometry, [(start, end, values, 0)], True, (1, 0), (1, 0)):
                self._add({"stage": "grad", "tensor": held.piece.tensor, "piece": held.piece.to_dict()}, held.view())

    def updated_state(self, scratch: Path) -> None:
        manager = self.trainer.checkpoint_manager(scratch, 1, echo=lambda text: None)
        for held in manager.held():  # what a checkpoint saves: parameters, then the optimizer's moments
            piece = held.piece
            self._add({"stage": piece.kind, "tensor": piece.tensor, "piece": piece.to_dict()}, held.view())

    def save(self, out_dir: Path, loss: float, planted: str | None) -> None:
        mesh, p = self.trainer.mesh, self.trainer.cfg.parallel
        rank = mesh.world.rank
        where = {"rank": rank, "dp": mesh.dp_rank, "tp": mesh.tp.rank, "pp": mesh.pp_rank, "cp": mesh.cp.rank}
        meta = {"where": where, "tp": [mesh.tp.size, mesh.tp.rank], "cp": [mesh.cp.size, mesh.cp.rank],
                "sequence_parallel": p.sequence_parallel, "loss": loss, "planted": planted,
                "skipped": self.skipped, "records": self.records}
        out_dir.mkdir(parents=True, exist_ok=True)
        np.savez(out_dir / f"rank_{rank:05d}.npz", *self.arrays)
        (out_dir / f"rank_{rank:05d}.json").write_text(json.dumps(meta))


def capture(cfg: Config, world_comm, out_dir: Path) -> None:
    """One training step of `cfg` on this rank, everything it computed saved to OUT_DIR/rank_NNNNN.{json,npz}."""
    trainer = Trainer(cfg, world_comm, None, out_dir)
    planted = plant_from_environment(trainer.model, cfg.parallel.sequence_parallel)
    recorder = Recorder(trainer)
    trainer.model.observe = recorder.forward_output
    result = trainer.train_step(0)
    trainer.model.observe = None
    recorder.gradients()
    recorder.updated_state(out_dir / "unused-checkpoints")
    recorder.save(out_dir, result.loss, planted)


# ---- comparing ------------------------------------------------------------------------------------------------------
@dataclass
class Comparison:
    order: tuple
    what: str
    relative: float  # inf: no reference counterpart, or shapes differ


@dataclass
class ParityReport:
    tol: float
    ranks: int
    comparisons: list[Comparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[Comparison]:
        return [c for c in self.comparisons if not c.relative <= self.tol]

    def text(self) -> str:
        counts = Counter(c.order[0] for c in self.comparisons)
        kinds = ", ".join(f"{n} {name}" for name, n in (("forward outputs", counts[0]), ("gradient pieces", counts[1]),
                                                         ("updated-state pieces", counts[2])))
        head = f"compared {len(self.comparisons)} tensors of {self.ranks} rank(s) with the one-process float64 "
        lines = [head + f"reference ({kinds})"] + self.notes
        failures = self.failures
        if not self.comparisons:
            lines.append("nothing was compared")
        elif not failures:
            worst = max(self.comparisons, key=lambda c: c.relative)
            lines.append(f"all match: largest relative difference {worst.relative:.1e} ({worst.what}), within "
                         f"--tol {self.tol:g}")
        else:
            first = min(failures, key=lambda c: c.order)
            lines.append(f"{len(failures)} of {len(self.comparisons)} differ; the first in execution order: "
                         f"{first.what}: relative difference {first.relative:.1e} > --tol {self.tol:g}")
        return "\n".join(lines)


def unit_order(unit: str) -> int:
    """Forward order of a unit: the embedding, the blocks, the head."""
    if unit.startswith("blocks."):
        return 1 + int(unit.split(".")[1])
    return 0 if unit == "embed" else 10**9


def unit_of(tensor: str) -> str:
    return tensor.rsplit(".", 1)[0]


def layer_name(unit: str) -> str:
    if unit.startswith("blocks."):
        return f"layer {unit.split('.')[1]}"
    return "the embedding" if unit == "embed" else "the head"


def load_rank(directory: Path, rank: int) -> tuple[dict, list[np.ndarray]]:
    meta = json.loads((directory / f"rank_{rank:05d}.json").read_text())
    with np.load(directory / f"rank_{rank:05d}.npz") as arrays:
        return meta, [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def piece_coordinates(piece: dict) -> tuple[tuple, np.ndarray]:
    """Global coordinates of a piece's values, and which of them fall inside the tensor (not vocab padding)."""
    local = np.unravel_index(np.arange(*piece["flat"]), piece["box_shape"])
    coords = tuple(c + o for c, o in zip(local, piece["box_offset"]))
    inside = np.ones(len(local[0]), dtype=bool)
    for c, n in zip(coords, piece["global_shape"]):
        inside &= c < n
    return coords, inside


def reference_tables(meta: dict, arrays: list[np.ndarray]) -> tuple[dict, dict]:
    """The reference's forward outputs by (unit, micro-batch) and its whole tensors by (stage, name)."""
    forward, tensors = {}, {}
    for record in meta["records"]:
        values = arrays[record["index"]]
        if record["stage"] == "forward":
            forward[(record["tensor"], record["micro"])] = values
            continue
        piece = record["piece"]
        whole = tensors.setdefault((record["stage"], record["tensor"]), np.zeros(piece["global_shape"]))
        coords, inside = piece_coordinates(piece)
        whole[tuple(c[inside] for c in coords)] = values[inside]
    return forward, tensors


def relative_difference(got: np.ndarray, expected: np.ndarray) -> float:
    if got.shape != expected.shape:
        return float("inf")
    scale = float(np.linalg.norm(expected))
    error = float(np.linalg.norm(got - expected))
    return error / scale if scale else error


def expected_forward(reference: np.ndarray, meta: dict, got: np.ndarray) -> np.ndarray:
    """The slice of the reference's unit output this rank holds: its cp chunks, then its sp chunk."""
    if reference.ndim < 2:
        return reference
    cp_size, cp_rank = meta["cp"]
    expected = split_sequence(reference, cp_size, cp_rank)
    tp_size, tp_rank = meta["tp"]
    if meta["sequence_parallel"] and got.ndim >= 2 and got.shape[1] * tp_size == expected.shape[1]:
        chunk = got.shape[1]
        expected = expected[:, tp_rank * chunk:(tp_rank + 1) * chunk]
    return expected


def describe_where(meta: dict) -> str:
    w = meta["where"]
    return f"rank {w['rank']} (dp {w['dp']}, tp {w['tp']}, pp stage {w['pp']}, cp {w['cp']})"


def compare_rank(meta: dict, arrays: list[np.ndarray], forward: dict, tensors: dict) -> list[Comparison]:
    rank, where, found = meta["where"]["rank"], describe_where(meta), []
    for record in meta["records"]:
        got, stage, tensor = arrays[record["index"]], record["stage"], record["tensor"]
        if stage == "forward":
            reference = forward.get((tensor, record["micro"]))
            expected = None if reference is None else expected_forward(reference, meta, got)
            order = (0, unit_order(tensor), record["micro"], rank)
            what = f"forward output of {tensor} ({layer_name(tensor)}), micro-batch {record['micro']}, on {where}"
        else:
            piece, whole = record["piece"], tensors.get((stage, tensor))
            coords, inside = piece_coordinates(piece)
            expected = None if whole is None else whole[tuple(c[inside] for c in coords)]
            got = got[inside]
            unit = unit_of(tensor)
            order = (1, -unit_order(unit), tensor, rank) if stage == "grad" else (2, unit_order(unit), stage,
                                                                                  tensor, rank)
            label = "gradient" if stage == "grad" else f"{stage} after the update"
            what = (f"{label} of {tensor} ({layer_name(unit)}) on {where}; shard: box at "
                    f"{tuple(piece['box_offset'])} of {tuple(piece['box_shape'])}, flat {tuple(piece['flat'])} of "
                    f"global shape {tuple(piece['global_shape'])}")
        relative = float("inf") if expected is None else relative_difference(got, expected)
        found.append(Comparison(order, what + ("" if expected is not None else " (no reference counterpart)"),
                                relative))
    return found


def compare(reference_dir: Path, layout_dir: Path, tol: float) -> ParityReport:
    """Every tensor each layout rank recorded against the reference's matching slice."""
    ref_meta, ref_arrays = load_rank(reference_dir, 0)
    forward, tensors = reference_tables(ref_meta, ref_arrays)
    ranks = sorted(int(p.stem.split("_")[1]) for p in layout_dir.glob("rank_*.json"))
    report = ParityReport(tol, len(ranks))
    for rank in ranks:
        meta, arrays = load_rank(layout_dir, rank)
        report.comparisons += compare_rank(meta, arrays, forward, tensors)
        report.notes += [f"rank {rank}: not compared: {text}" for text in meta["skipped"]]
        if meta["planted"]:
            report.notes.append(f"rank {rank}: planted bug ({PLANT_ENV}): {meta['planted']}")
        loss = relative_difference(np.array(meta["loss"]), np.array(ref_meta["loss"]))  # the same on every rank
        report.comparisons.append(Comparison((0, 10**9 + 1, 0, rank), f"the step's loss on rank {rank}", loss))
    if not ranks:
        report.notes.append(f"no layout rank wrote a record in {layout_dir}")
    return report


# ---- the command ----------------------------------------------------------------------------------------------------
def capture_command(config: str, settings: list[str], out_dir: Path) -> list[str]:
    args = [sys.executable, "-m", "mpitrain", "doctor", "capture", config, "--out", str(out_dir)]
    return args + [arg for setting in settings for arg in ("--set", setting)]


def run_capture(command: list[str], env: dict, what: str) -> None:
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "ERROR" in line or "Error" in line]
        tail = errors[-1] if errors else (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise MpitrainError(f"doctor parity: the {what} run failed (exit status {result.returncode}): {tail}")


def run_parity(config: str, overrides: list[str], n_ranks: int, tol: float, out_dir: Path | None, echo) -> int:
    """Capture the reference and the layout, compare, print; 0 when every tensor matches, 1 otherwise."""
    layout, reference = list(overrides) + BOTH, list(overrides) + BOTH + REFERENCE
    if n_ranks < 1:
        raise MpitrainError(f"-n must be >= 1, got {n_ranks}")
    # a bad key or value, or a layout the ranks cannot hold: one line here, before any process starts
    resolve_layout(load_config(config, layout), n_ranks)
    load_config(config, reference)
    if out_dir is None:  # nothing kept
        with tempfile.TemporaryDirectory(prefix="mpitrain-doctor-") as scratch:
            return _run_parity(config, overrides, layout, reference, n_ranks, tol, Path(scratch), echo)
    echo(f"doctor parity: the records go to {out_dir}")
    return _run_parity(config, overrides, layout, reference, n_ranks, tol, Path(out_dir), echo)


def _run_parity(config, overrides, layout, reference, n_ranks, tol, out_dir: Path, echo) -> int:
    base = {key: value for key, value in os.environ.items() if key != PLANT_ENV}  # the reference is never planted
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    run_capture(capture_command(config, reference, out_dir / "reference"), rank_environment(1, cores, base),
                "one-process reference")
    command = [find_mpiexec(), "-n", str(n_ranks)] + capture_command(config, layout, out_dir / "layout")
    run_capture(command, rank_environment(n_ranks, cores, os.environ), f"{n_ranks}-rank layout")
    report = compare(out_dir / "reference", out_dir / "layout", tol)
    echo(f"doctor parity: {' '.join([config, *overrides])} on {n_ranks} rank(s)")
    echo(report.text())
    return 0 if not report.failures else 1
