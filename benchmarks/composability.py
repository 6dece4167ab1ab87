"""The composability table: each feature (row) under each parallel layout (column), measured.

    python benchmarks/composability.py [--all | --pairwise] [--jobs N] [--out docs/composability.md]

A cell runs the real `mpitrain train` on configs/tiny.toml for a few steps in float64 on synthetic data, under
mpiexec with the layout's rank count, and holds it to the one-process run of the same config (run once per row and
reused across the row's layouts): the loss of every step and every final parameter (whole tensors read from the
checkpoint, whatever layout wrote it) within a relative 1e-10. A cell is then one of

    parity    the layout run matches, with the largest relative difference seen
    bounded   a quantized wire format (ZeRO++), inexact by design: the run is held to the exact one-process run
              within the codec's and Adam's bounds, and the cell shows the errors measured
    refused   the tool refused the combination before training: its one-line reason is the cell's note
    MISMATCH  it ran and differs from the one-process run (or leaves its bounds): a bug
    ERROR     it crashed, hung or printed a traceback: a bug

FP8 rows are held to 1e-6, not 1e-10: each layout sums a GEMM's pieces in its own order, and a last-bit difference
before a cast to e4m3 can move a code by one of its steps (tests/test_fp8.py holds its layouts to the same 1e-6).

--pairwise runs a covering subset (every feature, every layout and each named pair at least once: the CI test,
tests/test_composability.py); --new runs the covering subset of the rows and columns added last (NEW_CELLS);
--all runs every cell. --keep FILE carries the parity cells of an earlier table into this one (cells measured now
win). The markdown goes to --out, a summary line to stdout.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from mpitrain.checkpoint.resume import resolve_checkpoint  # noqa: E402
from mpitrain.checkpoint.store import Checkpoint  # noqa: E402
from mpitrain.comm.quantized import WORST_RELATIVE_ERROR  # noqa: E402
from mpitrain.config import load_config  # noqa: E402
from mpitrain.optim.schedule import lr_at  # noqa: E402
from tests.mpi_helpers import OVERSUBSCRIBED_ENV, find_mpiexec  # noqa: E402

RTOL = 1e-10
STEPS = 3  # the warm-up (2 steps) and one step of the decay after it
BASE = ["data.synthetic=true", "precision.compute=float64", f"train.steps={STEPS}", "train.micro_batch=2",
        "train.sample_tokens=0"]
CELL_TIMEOUT_S = 300
MOE = "model.moe={experts = 4, top_k = 2}"
FP8_RTOL = 1e-6
# block scales tile 128 columns: d_model 256 keeps every tp 2 shard a whole number of tiles (as tests/test_fp8.py)
FP8_MODEL = "model.d_model=256"
FAKE_NODES = (("MPITRAIN_FAKE_NODES", "2"),)  # hierarchical layouts: 4 ranks as 2 nodes of 2 (comm/nodes.py)
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
    rtol: float = RTOL  # parity tolerance (FP8_RTOL for FP8 recipes)
    # ZeRO++ wire formats: keys that act only on ZeRO's collectives, left out of the one-process run; the cell is
    # then bounded, and the row applies to layouts with parallel.zero >= min_zero
    quantized: tuple[str, ...] = ()
    min_zero: int = 0


@dataclass(frozen=True)
class Layout:
    name: str
    ranks: int
    settings: tuple[str, ...]
    experts_only: bool = False
    model: tuple[str, ...] = ()  # model keys the layout needs, given to the one-process reference too
    env: tuple[tuple[str, str], ...] = ()  # environment of the layout run (fake nodes)

    @property
    def zero(self) -> int:
        return max([int(s.split("=")[1]) for s in self.settings if s.startswith("parallel.zero=")] or [0])


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
    # every dispatched row is rounded to e4m3, local experts' too, so ep matches one process exactly
    Feature("MoE fp8 dispatch", ('model.moe={experts = 4, top_k = 2, dispatch_dtype = "fp8"}',), moe=True),
    Feature("fp8 tensor", ("precision.fp8=tensor", FP8_MODEL), rtol=FP8_RTOL),
    Feature("fp8 delayed", ("precision.fp8=delayed", FP8_MODEL), rtol=FP8_RTOL),
    Feature("fp8 block", ("precision.fp8=block", FP8_MODEL), rtol=FP8_RTOL),
    Feature("fp8 mxfp8", ("precision.fp8=mxfp8", FP8_MODEL), rtol=FP8_RTOL),
    Feature("MoE + fp8 tensor", (MOE, "precision.fp8=tensor", FP8_MODEL), moe=True, rtol=FP8_RTOL),
    Feature("MoE + fp8 block", (MOE, "precision.fp8=block", FP8_MODEL), moe=True, rtol=FP8_RTOL),
    Feature("ZeRO int8 gather", (), quantized=("parallel.zero_gather_dtype=int8",), min_zero=3),
    Feature("ZeRO fp8 gather", (), quantized=("parallel.zero_gather_dtype=fp8",), min_zero=3),
    Feature("ZeRO int8 grads", (), quantized=("parallel.zero_grad_reduce=int8",), min_zero=1),
    Feature("ZeRO int4 grads", (), quantized=("parallel.zero_grad_reduce=int4",), min_zero=1),
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
    # V schedules: two chunks per rank (four layers); dualpipev needs m >= 2p micro-batches (8 / 2 = 4 here)
    Layout("pp 2 zbv", 2, ("parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2"),
           model=("model.n_layer=4",)),
    Layout("pp 2 dualpipev", 2, ("parallel.pp=2", "parallel.schedule=dualpipev", "parallel.virtual_stages=2"),
           model=("model.n_layer=4",)),
    Layout("pp 2 dualpipev x tp 2", 4, ("parallel.pp=2", "parallel.schedule=dualpipev", "parallel.virtual_stages=2",
                                        "parallel.tp=2"), model=("model.n_layer=4",)),
    Layout("tp 2 + SP overlap", 2, ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=true")),
    Layout("dp 2 x pp 2 x tp 2 + SP overlap ZeRO-1", 8, ("parallel.pp=2", "parallel.tp=2", "parallel.zero=1",
                                                        "parallel.sequence_parallel=true", "parallel.tp_overlap=true")),
    Layout("cp 2 ulysses", 2, ("parallel.cp=2", "parallel.cp_kind=ulysses")),
    Layout("cp 4 hybrid (2 nodes)", 4, ("parallel.cp=4", "parallel.cp_kind=hybrid"), env=FAKE_NODES),
    Layout("cp 4 hybrid ZeRO-3 (2 nodes)", 4, ("parallel.cp=4", "parallel.cp_kind=hybrid", "parallel.zero=3"),
           env=FAKE_NODES),
    Layout("dp 4 two-level (2 nodes)", 4, ("parallel.dp_reduce=two_level",), env=FAKE_NODES),
    Layout("ZeRO-3 two-level (2 nodes)", 4, ("parallel.zero=3", "parallel.dp_reduce=two_level"), env=FAKE_NODES),
    Layout("ZeRO-3 node-sharded (2 nodes)", 4, ("parallel.zero=3", "parallel.zero_shard=node"), env=FAKE_NODES),
]

# The covering subset of the table before the rows and columns added last: every feature, every layout and each
# named pair (MoE with LoRA, with selective recompute, with cp; Adafactor with offload) at least once.
PAIRWISE = [
    ("dense gpt2", "dp 2 x pp 2 x tp 2 ZeRO-1"), ("dense llama", "tp 2 + SP"), ("dense llama", "pp 2 interleaved"),
    ("MoE", "ep 2"), ("MoE", "cp 2"), ("MoE", "cp 2 + ep 2"), ("LoRA", "ZeRO-3"), ("LoRA", "pp 2 1f1b"),
    ("recompute full", "pp 2 x tp 2"), ("recompute selective", "dp 2 x cp 2"), ("offload host", "ZeRO-2"),
    ("offload disk", "ZeRO-1"), ("adamw", "dp 2"), ("adafactor", "tp 2"), ("adam8bit", "ZeRO-3"),
    ("sgd", "pp 2 zb1p"), ("document mask", "dp 2 x tp 2"), ("document mask", "cp 2"),
    ("batch ramp-up", "pp 2 gpipe"), ("MoE + LoRA", "ep 2"), ("MoE + LoRA", "ZeRO-3"), ("MoE + LoRA", "tp 2"),
    ("MoE + recompute selective", "ep 2"),
    ("adafactor + offload host", "ZeRO-1"),
    # the riskiest of the rows and columns added last (NEW_CELLS covers them all): a V schedule's chunks split over
    # tp, hybrid cp's two node levels under ZeRO-3's gathers, the overlapped tp collectives inside pp and ZeRO-1,
    # FP8 per-tensor scales of a sequence split over cp (tests/test_fp8.py covers its recipes under tp, pp and dp)
    ("dense llama", "pp 2 dualpipev x tp 2"), ("dense llama", "cp 4 hybrid ZeRO-3 (2 nodes)"),
    ("MoE", "dp 2 x pp 2 x tp 2 + SP overlap ZeRO-1"), ("fp8 tensor", "cp 2"),
]

# The covering subset of the rows and columns added last (--new): each new layout under the llama, MoE and LoRA
# rows (and the packed-document and selective-recompute rows under the cp kinds that split attention anew), each
# FP8 recipe under four layouts that differ in how they split its GEMMs, the fp8 dispatch where it crosses ranks,
# and each ZeRO++ wire format under the ZeRO stages it acts on.
NEW_LAYOUTS = ("pp 2 zbv", "pp 2 dualpipev", "pp 2 dualpipev x tp 2", "tp 2 + SP overlap",
               "dp 2 x pp 2 x tp 2 + SP overlap ZeRO-1", "cp 2 ulysses", "cp 4 hybrid (2 nodes)",
               "cp 4 hybrid ZeRO-3 (2 nodes)", "dp 4 two-level (2 nodes)", "ZeRO-3 two-level (2 nodes)",
               "ZeRO-3 node-sharded (2 nodes)")
NEW_CELLS = [(f, lay) for lay in NEW_LAYOUTS for f in ("dense llama", "MoE", "LoRA")] + [
    ("recompute selective", "cp 2 ulysses"), ("recompute selective", "cp 4 hybrid (2 nodes)"),
    ("document mask", "cp 2 ulysses"), ("document mask", "cp 4 hybrid (2 nodes)"),
    ("fp8 tensor", "tp 2 + SP overlap"), ("fp8 tensor", "pp 2 dualpipev"), ("fp8 tensor", "cp 2"),
    ("fp8 tensor", "ZeRO-3 node-sharded (2 nodes)"),
    ("fp8 delayed", "pp 2 zbv"), ("fp8 delayed", "ZeRO-3"), ("fp8 delayed", "cp 2 ulysses"),
    ("fp8 delayed", "dp 2 x tp 2"),
    ("fp8 block", "tp 2"), ("fp8 block", "pp 2 dualpipev x tp 2"), ("fp8 block", "cp 4 hybrid (2 nodes)"),
    ("fp8 block", "ZeRO-2"),
    ("fp8 mxfp8", "tp 2 + SP"), ("fp8 mxfp8", "pp 2 interleaved"), ("fp8 mxfp8", "dp 4 two-level (2 nodes)"),
    ("fp8 mxfp8", "ZeRO-1"),
    ("MoE + fp8 tensor", "cp 2"), ("MoE + fp8 tensor", "tp 2"), ("MoE + fp8 block", "ep 2"),
    ("MoE + fp8 block", "cp 2 + ep 2"),
    ("MoE fp8 dispatch", "ep 2"), ("MoE fp8 dispatch", "cp 2 + ep 2"), ("MoE fp8 dispatch", "ZeRO-3"),
    ("MoE fp8 dispatch", "pp 2 1f1b"),
    ("ZeRO int8 gather", "ZeRO-3"), ("ZeRO int8 gather", "cp 4 hybrid ZeRO-3 (2 nodes)"),
    ("ZeRO int8 gather", "ZeRO-3 node-sharded (2 nodes)"), ("ZeRO fp8 gather", "ZeRO-3"),
    ("ZeRO int8 grads", "ZeRO-1"), ("ZeRO int8 grads", "dp 2 x pp 2 x tp 2 ZeRO-1"),
    ("ZeRO int4 grads", "ZeRO-2"), ("ZeRO int4 grads", "ZeRO-3"), ("ZeRO int4 grads", "ZeRO-3 two-level (2 nodes)"),
] + [("dense gpt2", lay) for lay in NEW_LAYOUTS] + [
    # the other rows under the new layouts that touch their state or schedule: recomputation and masks under the
    # V schedules and the new cp kinds, the batch ramp-up's changing micro-batch count under dualpipev's m >= 2p,
    # each optimizer's state and offloading under hierarchical sharding
    ("recompute full", "pp 2 zbv"), ("recompute full", "pp 2 dualpipev"), ("recompute full", "cp 2 ulysses"),
    ("recompute full", "cp 4 hybrid (2 nodes)"), ("recompute selective", "pp 2 zbv"),
    ("recompute selective", "pp 2 dualpipev x tp 2"), ("recompute selective", "tp 2 + SP overlap"),
    ("document mask", "pp 2 zbv"), ("document mask", "pp 2 dualpipev"), ("document mask", "dp 4 two-level (2 nodes)"),
    ("batch ramp-up", "pp 2 zbv"), ("batch ramp-up", "pp 2 dualpipev"), ("batch ramp-up", "dp 4 two-level (2 nodes)"),
    ("batch ramp-up", "ZeRO-3 node-sharded (2 nodes)"),
    ("adafactor", "ZeRO-3 node-sharded (2 nodes)"), ("adafactor", "ZeRO-3 two-level (2 nodes)"),
    ("adam8bit", "ZeRO-3 node-sharded (2 nodes)"), ("adam8bit", "dp 4 two-level (2 nodes)"),
    ("offload host", "ZeRO-3 node-sharded (2 nodes)"), ("offload host", "dp 4 two-level (2 nodes)"),
    ("offload disk", "ZeRO-3 two-level (2 nodes)"), ("sgd", "pp 2 dualpipev"), ("adamw", "pp 2 zbv"),
    ("MoE + LoRA", "pp 2 zbv"), ("MoE + LoRA", "cp 2 ulysses"), ("MoE + recompute selective", "cp 4 hybrid (2 nodes)"),
    ("MoE + recompute selective", "pp 2 dualpipev"), ("adafactor + offload host", "ZeRO-3 node-sharded (2 nodes)"),
    ("fp8 mxfp8", "cp 2 ulysses"), ("fp8 delayed", "cp 4 hybrid (2 nodes)"),
    ("fp8 tensor", "dp 2 x pp 2 x tp 2 + SP overlap ZeRO-1"), ("MoE fp8 dispatch", "pp 2 dualpipev"),
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
    status: str  # parity | bounded | refused | MISMATCH | ERROR
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
    """Expert parallelism splits experts: a dense model has none; ZeRO++'s wire formats act on ZeRO's collectives
    only (the cell is N/A, not refused)."""
    return (feature.moe or not layout.experts_only) and layout.zero >= feature.min_zero


def train(ranks: int, settings: list[str], run_dir: Path, extra_env: tuple[tuple[str, str], ...] = ()) -> Outcome:
    """`mpitrain train configs/tiny.toml` on `ranks` ranks: the outcome with losses and final full tensors."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise SystemExit("no mpiexec beside the Python interpreter or on PATH: pip install -e '.[mpich]'")
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir)]
    for setting in settings:
        args += ["--set", setting]
    command = [mpiexec, "-n", str(ranks), sys.executable, *args]
    env = {**os.environ, **OVERSUBSCRIBED_ENV, **dict(extra_env),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    shown = " ".join([*(f"{k}={v}" for k, v in extra_env), "mpiexec", "-n", str(ranks), "python",
                      *(repr(a) if " " in a else a for a in args)])
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


def adam_step_bound(t: int, beta1: float = 0.9, beta2: float = 0.95) -> float:
    """max |m_hat / sqrt(v_hat)| at Adam's step t over all gradient histories (Cauchy-Schwarz over the two
    exponential averages; the bound tests/test_zero_quantized.py uses): about 1, so a step moves an element by at
    most about lr; decoupled weight decay only shrinks a difference."""
    a_over_b = sum((beta1 ** 2 / beta2) ** i for i in range(t))
    return math.sqrt((1 - beta1) ** 2 * (1 - beta2 ** t) / ((1 - beta1 ** t) ** 2 * (1 - beta2)) * a_over_b)


def quantized_bounds(feature: Feature) -> tuple[float, float]:
    """(loss, weight) bounds of a ZeRO++ row against the exact run: a loss moves by at most the codec's worst
    relative error; Adam moves an element by at most about lr a step (adam_step_bound), so two runs part by at most
    2 lr a step (tests/test_zero_quantized.py holds its runs to the same)."""
    codecs = [setting.split("=")[1] for setting in feature.quantized]
    o = load_config("configs/tiny.toml", list(BASE)).optim
    lrs = [lr_at(t, o.lr, o.min_lr, o.warmup_steps, STEPS, o.schedule) for t in range(STEPS)]
    drift = sum(2 * adam_step_bound(t + 1, o.beta1, o.beta2) * lr for t, lr in enumerate(lrs))
    return max(WORST_RELATIVE_ERROR[codec] for codec in codecs), drift


def judge_bounded(feature: Feature, reference: Outcome, run: Outcome, cell: Cell) -> Cell:
    """A ZeRO++ cell: the loss and weight errors against the exact one-process run, inside their bounds."""
    loss_bound, weight_bound = quantized_bounds(feature)
    _, why = relative_difference(reference, run)
    if why:
        cell.status, cell.detail = "MISMATCH", why
        return cell
    loss = max(abs(got - ref) / abs(ref) for (_, ref), (_, got) in zip(reference.losses, run.losses))
    weights = max(float(np.max(np.abs(run.params[name] - ref))) for name, ref in reference.params.items())
    cell.max_rel_diff = loss
    cell.detail = (f"loss {loss:.1e} (bound {loss_bound:.1e}), weights max |Δ| {weights:.1e} "
                   f"(bound {weight_bound:.1e})")
    cell.status = "bounded" if loss <= loss_bound and weights <= weight_bound else "MISMATCH"
    return cell


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
    elif feature.quantized:
        return judge_bounded(feature, reference, run, cell)
    else:
        cell.max_rel_diff, why = relative_difference(reference, run)
        if cell.max_rel_diff <= feature.rtol:
            cell.status = "parity"
        else:
            cell.status = "MISMATCH"
            cell.detail = why or f"largest relative difference {cell.max_rel_diff:.1e} > {feature.rtol:g}"
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
            run = train(layout.ranks, [*reference_settings(feature, layout), *feature.quantized, *layout.settings],
                        scratch / f"cell-{index:03d}", layout.env)
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
    kind = {"refused": "R", "bounded": "Q"}.get(cell.status, "B")
    text = {"R": cell.detail, "Q": f"{cell.feature} x {cell.layout}: {cell.detail}"}.get(
        kind, f"{cell.status}: {cell.detail} — `{cell.command}`")
    if text not in notes:
        notes[text] = f"{kind}{sum(1 for label in notes.values() if label[0] == kind) + 1}"
    label = notes[text]
    if cell.refused_without_reason:
        return f"**refused, no reason** {label}"
    if kind == "Q":
        return f"≈ {cell.max_rel_diff:.0e} {label}"
    return f"refused {label}" if cell.status == "refused" else f"**{cell.status}** {label}"


def counts(cells: list[Cell]) -> dict[str, int]:
    return {status: sum(c.status == status for c in cells)
            for status in ("parity", "bounded", "refused", "MISMATCH", "ERROR")}


def kept_cells(table: Path, measured: list[Cell]) -> list[Cell]:
    """The parity cells of an earlier docs/composability.md that this run did not measure (others stay `·`)."""
    rows = [line.strip().strip("|").split("|") for line in table.read_text().splitlines() if line.startswith("| ")]
    header, done = [name.strip() for name in rows[0][1:]], {(c.feature, c.layout) for c in measured}
    kept = []
    for row in rows[1:]:
        feature = row[0].strip()
        for layout, text in zip(header, row[1:]):
            match = re.fullmatch(r"✓ (\S+)", text.strip())
            if match and (feature, layout) not in done:
                kept.append(Cell(feature, layout, "parity", "kept from the earlier table", float(match.group(1))))
    return kept


def render(cells: list[Cell], mode: str, seconds: float, jobs: int, kept: list[Cell] = ()) -> str:
    """docs/composability.md: how it was made, the table, then the refusals' reasons, bounded cells and any bugs."""
    by_pair = {(c.feature, c.layout): c for c in [*kept, *cells]}
    n = counts(list(by_pair.values()))
    every = len(all_pairs())
    source = (f"; {len(kept)} parity cells are kept from the table's earlier run (`--keep`: the rows and columns "
              "it had)" if kept else "")
    lines = [
        "# Composability: features against parallel layouts",
        "",
        (f"Generated by `python benchmarks/composability.py --{mode} --jobs {jobs}"
         f"{' --keep docs/composability.md' if kept else ''}` (this run measured {len(cells)} cells in "
         f"{seconds / 60:.1f} min on 2 cores{source}; {len(by_pair)} of the {every} cells in all); `--all` measures "
         "every cell. Do not edit by hand."),
        "",
        (f"Each cell runs `mpitrain train configs/tiny.toml` for {STEPS} steps in float64 on synthetic data "
         f"(`{' '.join('--set ' + s for s in BASE)}`, plus the row's and the column's keys) and compares it with "
         "the one-process run of the same config: the loss of every step and every final parameter (whole tensors "
         "read back from the checkpoint), relative difference per tensor as |Δ|/|ref|."),
        "",
        (f"- `✓ d`: parity; d is the largest relative difference (must be <= {RTOL:g}; <= {FP8_RTOL:g} for the "
         "FP8 recipe rows: each layout sums a GEMM's pieces in its own order, and a last-bit difference before a "
         "cast to e4m3 moves a code by one of its steps; tests/test_fp8.py holds its layouts to the same, with "
         "the one-process scales to 1e-9)."),
        ("- `≈ e Qn`: bounded; a ZeRO++ wire format (`parallel.zero_gather_dtype`, `parallel.zero_grad_reduce`) "
         "rounds what crosses the wire by design, so its run is held to the exact one-process run within bounds: "
         "the loss within the codec's worst relative error (1/254 int8, 1/14 int4, 1/16 fp8), each weight within "
         "Adam's largest step, 2 lr a step. e is the largest relative loss error; note Qn has both errors."),
        "- `refused Rn`: the tool refused the combination before training; the reason it gives is note Rn below.",
        "- `MISMATCH` / `ERROR` (note Bn): the run trained and differs from one process, or crashed: a bug.",
        ("- `N/A`: expert parallelism on a model without experts, or a ZeRO++ wire format on a layout without "
         "the ZeRO stage it quantizes. `·`: not measured. Columns marked (2 nodes) run 4 ranks as 2 nodes of 2 "
         "(`MPITRAIN_FAKE_NODES=2`)."),
        ("- `refused, no reason`: the refusal says `not supported` or `yet`, no reason that holds for any "
         f"implementation; the CI test fails on it as on a bug. Rows {', '.join(SAME_MATH_AS_DENSE[1:])} are the "
         "dense gpt2 row's math by design (same activations recomputed, same state moved, the default optimizer): "
         "equal numbers are expected."),
        "",
        (f"Cells: {n['parity']} at parity, {n['bounded']} bounded, {n['refused']} refused, {n['MISMATCH']} "
         f"mismatching, {n['ERROR']} errors."),
        ("Not a row: `precision.grad_reduce = bfloat16` (a float64 run held to 1e-10 cannot measure a reduction "
         "that rounds to 8 bits; tests/test_precision.py checks it at bfloat16 tolerances)."),
        ("Refused, so not a cell: the per-tensor FP8 recipes (tensor, delayed) on experts under "
         "`parallel.ep > 1`: an expert's GEMM then holds the rows that every ep rank's micro-batch routes to it, "
         "and a per-tensor scale is the amax over those rows, not over one micro-batch's (docs/fp8.md; measured "
         "before the refusal: 0.27 relative after 3 steps). The block and mxfp8 tiles are row-wise and do not "
         "depend on which rows meet: the MoE + fp8 block row."),
        "",
    ]
    notes: dict[str, str] = {}
    lines.append("| feature | " + " | ".join(lay.name for lay in LAYOUTS) + " |")
    lines.append("|---" * (len(LAYOUTS) + 1) + "|")
    for feature in FEATURES:
        row = [cell_text(by_pair.get((feature.name, lay.name)), notes) if applies(feature, lay) else "N/A"
               for lay in LAYOUTS]
        lines.append(f"| {feature.name} | " + " | ".join(row) + " |")
    keys = {f.name: " ".join((*f.settings, *f.quantized)) or "(tiny.toml as is)" for f in FEATURES}
    lines += ["", "Feature keys: " + "; ".join(f"{name}: `{text}`" for name, text in keys.items()) + ".",
              "", "Layout keys: " + "; ".join(f"{lay.name} ({lay.ranks} ranks): `{' '.join(lay.settings) or '-'}`"
                                                + (f" (and `{' '.join(lay.model)}` in both runs)" if lay.model else "")
                                                for lay in LAYOUTS) + "."]
    for kind, title in (("R", "Refusals (the tool's one-line reasons)"),
                        ("Q", "Bounded cells: ZeRO++ wire formats against the exact one-process run"),
                        ("B", "Bugs: cells that ran and failed")):
        mine = [(label, text) for text, label in notes.items() if label[0] == kind]
        if mine:
            lines += ["", f"## {title}", ""] + [f"- **{label}**: {text}" for label, text in mine]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every cell of the table")
    which.add_argument("--pairwise", action="store_true", help="the covering subset (the default)")
    which.add_argument("--new", action="store_true", help="the covering subset of the rows and columns added last")
    which.add_argument("--cells-json", default="", help="render the cells a run saved (CELLS.json) without running")
    parser.add_argument("--jobs", type=int, default=1, help="mpiexec jobs at a time")
    parser.add_argument("--out", default="docs/composability.md")
    parser.add_argument("--keep", default="", help="an earlier table whose parity cells this one carries")
    parser.add_argument("--resume", default="", help="a saved run's CELLS.json: reuse its cells, measure the rest")
    parser.add_argument("--scratch", default="", help="folder for the run directories (default: a new temporary)")
    args = parser.parse_args(argv)
    mode = "all" if args.all else "new" if args.new else "pairwise"
    start = time.perf_counter()
    if args.cells_json:
        saved = json.loads(Path(args.cells_json).read_text())
        cells, seconds, mode = [Cell(**c) for c in saved["cells"]], saved["seconds"], saved["mode"]
    else:
        scratch = Path(args.scratch or tempfile.mkdtemp(prefix="composability-"))
        pairs = all_pairs() if args.all else NEW_CELLS if args.new else PAIRWISE
        saved = json.loads(Path(args.resume).read_text()) if args.resume else {"cells": [], "seconds": 0.0}
        reused = [Cell(**c) for c in saved["cells"] if (c["feature"], c["layout"]) in pairs]
        done = {(c.feature, c.layout) for c in reused}
        cells = reused + run_cells([pair for pair in pairs if pair not in done], args.jobs, scratch)
        seconds = saved["seconds"] + time.perf_counter() - start
        (scratch / "cells.json").write_text(json.dumps({"mode": mode, "seconds": seconds,
                                                        "cells": [asdict(c) for c in cells]}))
    kept = kept_cells(Path(args.keep), cells) if args.keep else []
    Path(args.out).write_text(render(cells, mode, seconds, args.jobs, kept))
    for cell in cells:
        if cell.status in ("MISMATCH", "ERROR") or cell.refused_without_reason:
            print(f"{cell.status} {cell.feature} x {cell.layout}: {cell.detail}\n  {cell.command}")
    print(json.dumps({"mode": mode, "cells": len(cells), **counts(cells), "seconds": round(seconds, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
