"""Sharded checkpoints under MPI: exact resume, resharding between layouts, crash safety, corruption fallback."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpitrain.checkpoint.store import Checkpoint, committed_checkpoints
from mpitrain.data.prepare import prepare_dataset
from tests.mpi_helpers import OVERSUBSCRIBED_ENV, REPO_ROOT, describe, find_mpiexec, run_mpi
from tests.test_train_parity import dataset  # noqa: F401 (fixture)

FAST = ["logging.peak_flops=1e9", "train.log_every=1"]
PREEMPTED = 75


def train(n, run_dir, data, *overrides, resume=None, expect=0, config="configs/tiny.toml", extra=()):
    args = ["-m", "mpitrain", "train", config, "--out", str(run_dir), *extra]
    for setting in [f"data.path={data}", *FAST, *overrides]:
        args += ["--set", setting]
    if resume:
        args += ["--resume", resume]
    result = run_mpi(n, args, timeout=180)
    assert result.returncode == expect, describe(result)
    return result


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def saved_state(run_dir):
    """Every full tensor of every kind (parameters and both Adam moments) of the newest checkpoint."""
    checkpoint = Checkpoint.open(committed_checkpoints(run_dir / "checkpoints")[-1])
    return {(kind, name): checkpoint.read_box(kind, name, (0,) * len(info["global_shape"]), info["global_shape"],
                                              np.float64)
            for name, info in checkpoint.tensors().items() for kind in ("param", "exp_avg", "exp_avg_sq")}


@pytest.fixture(scope="module")
def small_epochs(tmp_path_factory):
    """A dataset of ~24 windows of 33 tokens: an epoch is 3 steps of 8 sequences, so step 4 is mid-epoch."""
    path = tmp_path_factory.mktemp("tiny-data") / "tiny.h5"
    prepare_dataset("python-stdlib", path, max_bytes=840, val_fraction=0.5)
    return path


LAYOUTS = {"dp2": (2, []), "zero3-dp2": (2, ["parallel.zero=3"]), "tp2": (2, ["parallel.tp=2"]),
           "tp2-sp-zero1-dp2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero=1"])}


# Every pair of values of any two of (layout, precision, sync/async) is run, in 8 cases instead of all 16 (each
# case is three multi-rank runs): even layouts pair sync with float32, odd ones sync with float64.
RESUME_CASES = [(layout, precision, asynchronous)
                for i, layout in enumerate(LAYOUTS)
                for asynchronous, precision in ((False, ("float32", "float64")[i % 2]),
                                                (True, ("float64", "float32")[i % 2]))]


@pytest.mark.parametrize("layout, precision, asynchronous", RESUME_CASES,
                         ids=[f"{'async' if a else 'sync'}-{layout}-{p}" for layout, p, a in RESUME_CASES])
def test_stop_and_resume_is_bitwise_the_same_run(tmp_path, small_epochs, layout, precision, asynchronous):
    n, overrides = LAYOUTS[layout]
    settings = [f"precision.compute={precision}", f"checkpoint.async={str(asynchronous).lower()}",
                "checkpoint.every=2", "model.seq_len=32", *overrides]
    train(n, tmp_path / "straight", small_epochs, *settings)
    train(n, tmp_path / "resumed", small_epochs, *settings, "train.stop_at=4", expect=PREEMPTED)
    out = train(n, tmp_path / "resumed", small_epochs, *settings, resume="auto")
    assert "checkpoint: resumed from" in out.stdout
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert straight == resumed  # every step's loss, bitwise
    a, b = saved_state(tmp_path / "straight"), saved_state(tmp_path / "resumed")
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))


RESHARD_JOB = """
import sys, json
import numpy as np
from mpi4py import MPI
from mpitrain.config import load_config
from mpitrain.train import Trainer
from mpitrain.checkpoint.store import committed_checkpoints

mode, directory, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
cfg = load_config("configs/tiny.toml", ["data.synthetic=true", "precision.compute=float64",
                                        "logging.peak_flops=1e9", "model.vocab_size=259", "train.micro_batch=1",
                                        *overrides])
trainer = Trainer(cfg, MPI.COMM_WORLD)
manager = trainer.checkpoint_manager(directory, keep=0, echo=lambda text: None)
kinds = {"param": 0.25, "exp_avg": 0.5, "exp_avg_sq": 0.75}

def expected(piece):
    # each element encodes (kind, tensor, global position): misplaced or missing values cannot go unseen
    coords = np.unravel_index(np.arange(*piece.flat), piece.box_shape)
    coords = [c + o for c, o in zip(coords, piece.box_offset)]
    inside = np.ones(piece.size, bool)
    for c, g in zip(coords, piece.global_shape):
        inside &= c < g
    flat = np.zeros(piece.size)
    flat[inside] = np.ravel_multi_index(tuple(c[inside] for c in coords), piece.global_shape)
    tensor_code = sum(map(ord, piece.tensor)) * 100000.0
    return np.where(inside, tensor_code + flat + kinds[piece.kind], 0.0)

held = manager.held()
if mode == "save":
    for item in held:
        item.view()[...] = expected(item.piece)
    manager.save(3)
else:
    for item in held:
        item.view()[...] = -1.0
    manager.restore(committed_checkpoints(__import__("pathlib").Path(directory))[-1])
    bad = [f"{i.piece.kind} {i.piece.tensor}" for i in held if not np.array_equal(i.view(), expected(i.piece))]
    assert not bad, f"rank {MPI.COMM_WORLD.rank}: wrong values in {bad[:5]}"
    if MPI.COMM_WORLD.rank == 0:
        print("RESHARD OK", len(held))
"""

RESHARD_PAIRS = [
    ((8, ["parallel.zero=0"]), (1, [])),
    ((1, []), (8, ["parallel.zero=3"])),
    ((4, ["parallel.zero=3"]), (2, ["parallel.zero=1"])),
    ((2, ["parallel.tp=2"]), (4, ["parallel.zero=2"])),
    ((4, ["parallel.tp=4"]), (2, ["parallel.tp=2", "parallel.sequence_parallel=true"])),
    ((4, ["parallel.tp=2", "parallel.zero=3"]), (1, [])),
    ((1, []), (4, ["parallel.tp=2", "parallel.zero=1"])),
    ((2, ["parallel.zero=3"]), (4, ["parallel.tp=4"])),
    ((8, ["parallel.tp=2", "parallel.zero=3"]), (8, ["parallel.tp=4", "parallel.zero=2"])),
    ((4, ["parallel.zero=2"]), (2, ["parallel.zero=3"])),
    ((2, ["parallel.tp=2", "model.arch=llama", "model.n_kv_head=2"]), (4, ["parallel.zero=3", "model.arch=llama",
                                                                          "model.n_kv_head=2"])),
    # pipelines: each stage holds its units' tensors; gpt2's last stage loads its copy of the tied embedding
    ((2, ["parallel.tp=2", "model.n_layer=4"]), (2, ["parallel.pp=2", "model.n_layer=4"])),
    ((2, ["parallel.pp=2", "model.n_layer=4"]), (2, ["parallel.zero=3", "model.n_layer=4"])),
    ((4, ["parallel.pp=4", "model.n_layer=4"]), (1, ["model.n_layer=4"])),
    ((8, ["parallel.pp=2", "parallel.tp=2", "parallel.zero=2", "parallel.schedule=interleaved",
          "parallel.virtual_stages=2", "model.n_layer=4"]),
     (4, ["parallel.pp=4", "parallel.schedule=zb1p", "model.n_layer=4"])),
    ((4, ["parallel.pp=2", "parallel.zero=1", "model.arch=llama", "model.n_kv_head=2", "model.n_layer=4"]),
     (4, ["parallel.pp=2", "parallel.tp=2", "parallel.stage_layers=[3, 1]", "model.arch=llama", "model.n_kv_head=2",
          "model.n_layer=4"])),
]


def _describe_layout(layout):
    n, overrides = layout
    return f"{n}:" + ",".join(o.split(".")[-1] for o in overrides)


@pytest.mark.parametrize("saved, loaded", RESHARD_PAIRS,
                         ids=[f"{_describe_layout(a)}->{_describe_layout(b)}" for a, b in RESHARD_PAIRS])
def test_state_saved_under_one_layout_lands_exactly_under_another(tmp_path, saved, loaded):
    for mode, (n, overrides) in (("save", saved), ("load", loaded)):
        script = tmp_path / "job.py"
        script.write_text(RESHARD_JOB)
        result = run_mpi(n, [str(script), mode, str(tmp_path / "ckpt"), *overrides], timeout=120)
        assert result.returncode == 0, describe(result)
    assert "RESHARD OK" in result.stdout


def test_a_run_resumed_under_another_layout_continues_with_the_same_losses(tmp_path, dataset):
    settings = ["precision.compute=float64", "train.micro_batch=2"]
    train(1, tmp_path / "straight", dataset, *settings)
    train(4, tmp_path / "moved", dataset, *settings, "parallel.tp=2", "parallel.zero=1", "train.stop_at=4",
          expect=PREEMPTED)
    train(4, tmp_path / "moved", dataset, *settings, "parallel.zero=3", resume="auto")
    straight, moved = losses(tmp_path / "straight"), losses(tmp_path / "moved")
    assert straight.keys() == moved.keys()
    for step, loss in straight.items():
        assert abs(moved[step] - loss) <= 1e-10 * abs(loss), step


def _rank_pids(marker: str) -> list[int]:
    """Training ranks (python processes, not mpiexec) whose command line mentions the run directory."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(marker.encode() in part for part in cmdline) and b"mpitrain" in b" ".join(cmdline) and \
                    not cmdline[0].endswith(b"mpiexec") and b"hydra" not in cmdline[0]:
                pids.append(int(entry))
    return pids


def _wait_for_a_new_checkpoint(directory: Path, process, attempt: int, timeout: float = 600) -> None:
    """Until a checkpoint newer than the current newest is committed (the deadline only guards against a hang)."""
    before = committed_checkpoints(directory)[-1:]
    deadline = time.monotonic() + timeout
    while committed_checkpoints(directory)[-1:] == before:
        if process.poll() is not None:
            pytest.fail(f"attempt {attempt}: the job ended before saving:\n{process.communicate()[0]}")
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"attempt {attempt}: no new checkpoint within {timeout:.0f} s")
        time.sleep(0.1)


def test_killing_a_rank_during_saves_never_leaves_a_checkpoint_that_resume_takes(tmp_path, dataset):
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec beside the Python interpreter or on PATH: pip install -e '.[mpich]'")
    run_dir = tmp_path / "run"
    env = {**os.environ, **OVERSUBSCRIBED_ENV, "PYTHONPATH": str(REPO_ROOT)}
    # a model whose saves take a good part of each step, saved every step
    command = [mpiexec, "-n", "2", sys.executable, "-m", "mpitrain", "train", "configs/tiny.toml", "--out",
               str(run_dir), "--resume", "auto"]
    for setting in [f"data.path={dataset}", "logging.peak_flops=1e9", "checkpoint.every=1", "checkpoint.keep=4",
                    "model.d_model=128", "model.n_layer=3", "train.steps=1000"]:
        command += ["--set", setting]
    rng = random.Random(7)
    for attempt in range(4):
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        # not a fixed sleep: on a busy machine the ranks may not even have started after a few seconds. Wait for
        # this attempt's first save, then kill at a random moment of the save-every-step cycle.
        _wait_for_a_new_checkpoint(run_dir / "checkpoints", process, attempt)
        time.sleep(rng.random())
        pids = _rank_pids(str(run_dir))
        assert pids, f"attempt {attempt}: no training rank found"
        os.kill(rng.choice(pids), signal.SIGKILL)
        try:
            process.wait(timeout=60)
            deadline = time.time() + 30  # mpiexec may return while the other rank is still being taken down
            while _rank_pids(str(run_dir)) and time.time() < deadline:
                time.sleep(0.1)
            assert not _rank_pids(str(run_dir)), f"attempt {attempt}: ranks outlived the job"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"attempt {attempt}: the job hung after a rank was killed")
        for checkpoint in committed_checkpoints(run_dir / "checkpoints"):
            opened = Checkpoint.open(checkpoint)
            opened.verify_files()  # every committed checkpoint is whole
            opened.verify_coverage()
    assert committed_checkpoints(run_dir / "checkpoints"), "no save completed in the attempts"


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, dataset):
    run_dir = tmp_path / "run"
    train(2, run_dir, dataset, "checkpoint.every=2", "train.stop_at=6", expect=PREEMPTED)
    newest = committed_checkpoints(run_dir / "checkpoints")[-1]
    shard = newest / "rank_00001.h5"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x40
    shard.write_bytes(bytes(data))
    result = train(2, run_dir, dataset, "checkpoint.every=2", resume="auto")
    assert "checkpoint shard corrupt" in result.stdout and "rank_00001.h5" in result.stdout, describe(result)
    assert "falling back" in result.stdout
    assert "resumed from" in result.stdout and "step_00000004" in result.stdout, describe(result)


def test_resume_from_a_broken_path_fails_in_one_line_naming_the_file(tmp_path, dataset):
    run_dir = tmp_path / "run"
    train(2, run_dir, dataset, "train.stop_at=2", expect=PREEMPTED)
    newest = committed_checkpoints(run_dir / "checkpoints")[-1]
    (newest / "rank_00000.h5").unlink()
    result = train(2, run_dir, dataset, resume=str(newest), expect=1)
    assert result.stderr.count("checkpoint shard missing") == 1 and "rank_00000.h5" in result.stderr, describe(result)


def test_ckpt_tools_inspect_verify_export(tmp_path, dataset):
    run_dir = tmp_path / "run"
    train(2, run_dir, dataset, "parallel.zero=3", "train.steps=2")
    cli = [sys.executable, "-m", "mpitrain", "ckpt"]
    inspect = subprocess.run(cli + ["inspect", str(run_dir)], capture_output=True, text=True, cwd=REPO_ROOT)
    assert "step 2" in inspect.stdout and "zero=3" in inspect.stdout and "embed.wte" in inspect.stdout
    verify = subprocess.run(cli + ["verify", str(run_dir)], capture_output=True, text=True, cwd=REPO_ROOT)
    assert verify.returncode == 0 and "covered exactly once" in verify.stdout, verify.stderr
    out = tmp_path / "full.h5"
    export = subprocess.run(cli + ["export", str(run_dir), str(out), "--optimizer"], capture_output=True, text=True,
                            cwd=REPO_ROOT)
    assert export.returncode == 0, export.stderr
    import h5py
    with h5py.File(out) as f:
        assert f["params/embed.wte"].shape == (256, 32) and "exp_avg" in f
    generate = subprocess.run([sys.executable, "-m", "mpitrain", "generate", str(run_dir), "--tokens", "5"],
                              capture_output=True, text=True, cwd=REPO_ROOT)
    assert generate.returncode == 0 and generate.stdout.startswith("def "), generate.stderr
