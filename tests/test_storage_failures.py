"""Storage failures during a save (disk full, quota, read-only, I/O error): the writer gets the OSError with its errno
and file; a 2-rank job where one rank's write fails in the middle of a save (MPITRAIN_FAULT=enospc / eio, synchronous
and asynchronous saves) ends every rank with exit status 74 after one line on rank 0, no traceback anywhere, the
partial directory removed; `--resume auto` then continues from the last good checkpoint with the losses of an
uninterrupted run, bitwise (float64, same layout). The same on a real 2.7 MB tmpfs filling up, where a mount
namespace can be made (unshare -rm)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.checkpoint.manager import STORAGE_FAILED_EXIT_CODE, CheckpointManager
from mpitrain.checkpoint.pieces import Piece
from mpitrain.checkpoint.store import CheckpointWriteFailed, describe_os_error, storage_cause, write_rank_file
from mpitrain.resilience.faults import FaultPlan, parse_faults
from mpitrain.resilience.inject import storage_fault
from tests.mpi_helpers import OVERSUBSCRIBED_ENV, REPO_ROOT, describe, find_mpiexec, run_mpi

SETTINGS = ["data.synthetic=true", "precision.compute=float64", "logging.peak_flops=1e9", "train.log_every=1",
            "train.steps=8", "checkpoint.every=2"]


# ---- the writer ------------------------------------------------------------------------------------------------------
def pieces(n: int = 4) -> list:
    return [(Piece("param", f"w{i}", (256,), (0,), (256,), (0, 256)), np.arange(256.0) + i) for i in range(n)]


@pytest.mark.parametrize("kind", ["enospc", "edquot", "erofs", "eio"])
def test_an_injected_storage_fault_reaches_the_writer_as_its_oserror(tmp_path, kind):
    path = tmp_path / "rank_00000.h5"
    plan = FaultPlan(parse_faults(f"{kind}:rank=0:step=4"), rank=0)
    assert storage_fault(plan, 2, path) is None
    injected = storage_fault(plan, 4, path)
    assert storage_fault(plan, 4, path) is None  # strikes once
    code = getattr(errno, kind.upper())
    with pytest.raises(OSError) as raised:
        write_rank_file(path, pieces(), injected)
    assert (raised.value.errno, raised.value.filename) == (code, str(path))
    assert describe_os_error(raised.value) == f"{kind.upper()} ({os.strerror(code)})"
    record = write_rank_file(path, pieces())  # the same pieces without the fault: a whole file
    assert record["bytes"] == path.stat().st_size and len(record["pieces"]) == 4


def test_the_storage_cause_is_found_behind_hdf5s_own_error():
    wrapped = OSError("File close failed (driver write request failed)")  # HDF5's, when it closes the file
    wrapped.__context__ = OSError(errno.ENOSPC, "No space left on device")  # the write's own
    assert storage_cause(wrapped).errno == errno.ENOSPC
    assert storage_cause(ValueError("not storage")) is None


class OneRank:
    """A world of one rank: its collectives return what they are given."""
    rank, size = 0, 1

    def all_reduce_scalar(self, x, op="sum"):
        return x

    def broadcast_object(self, obj, root=0):
        return obj


def test_a_checkpoint_directory_that_cannot_be_made_fails_the_save_in_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    manager = CheckpointManager(blocker / "checkpoints", 3, cfg=None, mesh=SimpleNamespace(world=OneRank()),
                                state=None, optimizer=SimpleNamespace(steps_taken=0))
    with pytest.raises(CheckpointWriteFailed) as failed:
        manager._prepare(4)
    assert str(failed.value) == (f"checkpoint: saving step 4 failed: rank 0 could not write {blocker / 'checkpoints'}: "
                                 f"ENOTDIR (Not a directory); removed step_00000004.partial; no checkpoint of this "
                                 f"run is committed yet; exiting with status 74")


# ---- real jobs -------------------------------------------------------------------------------------------------------
def train(run_dir: Path, *settings: str, fault: str = "", resume: bool = False):
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir)]
    for setting in [*SETTINGS, *settings]:
        args += ["--set", setting]
    return run_mpi(2, args + (["--resume", "auto"] if resume else []), timeout=240, env={"MPITRAIN_FAULT": fault})


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = train(run_dir)
    assert result.returncode == 0, describe(result)
    return losses(run_dir)


def assert_failed_cleanly(result, failed_rank: int, name: str, step: int, last_good: str) -> str:
    assert result.returncode == STORAGE_FAILED_EXIT_CODE, describe(result)
    output = result.stdout + result.stderr
    assert "Traceback" not in output and "Abort" not in output, describe(result)
    lines = [line for line in output.splitlines() if "ERROR" in line or " failed: " in line]
    assert len(lines) == 1, describe(result)  # one line, from rank 0
    line = lines[0]
    assert line.startswith(f"ERROR: checkpoint: saving step {step} failed: rank {failed_rank} could not write "), line
    assert f"step_{step:08d}.partial/rank_{failed_rank:05d}.h5: {name}; removed step_{step:08d}.partial; " in line
    assert f"the last good checkpoint is {last_good}; continue with --resume auto" in line, line
    assert line.endswith(f"exiting with status {STORAGE_FAILED_EXIT_CODE}"), line
    return line


@pytest.mark.parametrize("save, fault, name", [
    ("sync", "enospc:rank=1:step=4", "ENOSPC (No space left on device)"),
    ("async", "eio:rank=0:step=4", "EIO (Input/output error)"),
])
def test_a_failed_save_ends_every_rank_cleanly_and_resume_continues_bitwise(tmp_path, reference, save, fault, name):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    result = train(run_dir, f"checkpoint.async={str(save == 'async').lower()}", fault=fault)
    rank = int(fault.split("rank=")[1].split(":")[0])
    assert_failed_cleanly(result, rank, name, 4, str(checkpoints / "step_00000002"))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002"]  # .partial removed
    assert not (run_dir / ".lock").exists()
    resumed = train(run_dir, f"checkpoint.async={str(save == 'async').lower()}", fault=fault, resume=True)
    assert resumed.returncode == 0, describe(resumed)  # the fault struck once: the disk is "fixed"
    assert "checkpoint: resumed from" in resumed.stdout and "step_00000002 at step 2" in resumed.stdout
    assert losses(run_dir) == reference  # float64, same layout: bitwise


REAL_FS = """
set -u
mount -t tmpfs -o size=2700k tmpfs "$CKPT" || exit 90
"$@" > "$OUT/first.out" 2> "$OUT/first.err"; echo $? > "$OUT/first.status"
ls -a "$CKPT" > "$OUT/first.ls"
mount -o remount,size=64m "$CKPT"
"$@" --resume auto > "$OUT/second.out" 2> "$OUT/second.err"; echo $? > "$OUT/second.status"
"""


def test_a_real_filesystem_filling_up_ends_the_run_cleanly_and_resume_continues(tmp_path, reference):
    """Two ranks checkpoint into a 2.7 MB tmpfs (each float64 checkpoint ~1.1 MB, checkpoint.keep = 3): the third
    save fills it. Then the filesystem grows and `--resume auto` continues to the uninterrupted run's losses."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare -rm): the injected faults above cover the logic")
    run_dir, checkpoints, out = tmp_path / "run", tmp_path / "ckpt", tmp_path / "out"
    checkpoints.mkdir()
    out.mkdir()
    command = [find_mpiexec(), "-n", "2", sys.executable, "-m", "mpitrain", "train", "configs/tiny.toml", "--out",
               str(run_dir)]
    for setting in [*SETTINGS, f"checkpoint.dir={checkpoints}"]:
        command += ["--set", setting]
    env = {**os.environ, **OVERSUBSCRIBED_ENV, "PYTHONPATH": str(REPO_ROOT), "CKPT": str(checkpoints), "OUT": str(out)}
    done = subprocess.run([unshare, "-rm", "sh", "-c", REAL_FS, "sh", *command], cwd=REPO_ROOT, env=env, timeout=480)
    if done.returncode == 90:
        pytest.skip("tmpfs cannot be mounted in this namespace")
    assert (out / "first.status").exists(), f"the script ended with {done.returncode} before the first run's status"
    first = subprocess.CompletedProcess(command, int((out / "first.status").read_text()),
                                        (out / "first.out").read_text(), (out / "first.err").read_text())
    lines = [line for line in (first.stdout + first.stderr).splitlines() if "ERROR" in line or " failed: " in line]
    assert first.returncode == STORAGE_FAILED_EXIT_CODE and len(lines) == 1, describe(first)
    assert "Traceback" not in first.stdout + first.stderr, describe(first)
    assert lines[0].startswith("ERROR: checkpoint: saving step 6 failed: rank "), lines[0]
    assert ": ENOSPC (No space left on device)" in lines[0] and f"is {checkpoints / 'step_00000004'};" in lines[0]
    assert (out / "first.ls").read_text().split() == [".", "..", "latest", "step_00000002", "step_00000004"]
    assert int((out / "second.status").read_text()) == 0, (out / "second.err").read_text()
    assert f"resumed from {checkpoints / 'step_00000004'} at step 4" in (out / "second.out").read_text()
    assert losses(run_dir) == reference
