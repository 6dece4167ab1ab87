"""Saving and loading sharded checkpoints with an atomic commit.

Layout on disk (one directory per step, names that sort by step):

    CKPT_DIR/step_00000100/rank_00003.h5   this rank's pieces: one dataset per piece, attributes say where it goes
    CKPT_DIR/step_00000100/index.json      layout, step, config, every piece and its file, SHA-256 per file
    CKPT_DIR/step_00000100/COMMITTED       written last: without it the directory is not a checkpoint
    CKPT_DIR/latest                        the newest committed step's directory name, replaced by atomic rename

Protocol: every rank writes and fsyncs its file into `step_X.partial/`, hashes it and sends the hash to rank 0;
rank 0 writes the index and the marker, fsyncs, renames `step_X.partial` to `step_X`, then moves `latest`. A crash at
any point leaves either the previous checkpoints untouched or a `.partial` directory that is ignored and cleaned.
Nothing is ever modified in place.

Storage failures (a full disk, a quota, a read-only or failing filesystem) reach the writer as an OSError naming the
file: HDF5 writes through a Python file object (`write_rank_file`), because HDF5 writing to a full disk on its own
reports the error only when its caches are freed, and then crashes the process.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from mpitrain.backend import array_module
from mpitrain.checkpoint.pieces import HeldPiece, Piece, count_coverage, fill_box
from mpitrain.errors import MpitrainError
from mpitrain.profile.progress import progress

MARKER = "COMMITTED"
INDEX = "index.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")
FORMAT_VERSION = 1


class CheckpointError(MpitrainError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


class CheckpointWriteFailed(MpitrainError):
    """A save could not be written (disk full, quota, read-only filesystem, I/O error): raised on every rank once the
    failed save is cleaned up, with the same one-line message naming the file, the error and the last good
    checkpoint; the run then ends with its own exit status (checkpoint/manager.STORAGE_FAILED_EXIT_CODE)."""


def describe_os_error(exc: OSError) -> str:
    """'ENOSPC (No space left on device)': the errno's name and text."""
    name = errno.errorcode.get(exc.errno, f"errno {exc.errno}") if exc.errno else type(exc).__name__
    return f"{name} ({exc.strerror or exc})"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.h5"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- writing
class _FailingFile:
    """A file whose writes fail with `error` once `budget` bytes are written: an injected storage fault
    (MPITRAIN_FAULT=enospc|edquot|erofs|eio, resilience/faults.py) that meets the writer where a real one would."""

    def __init__(self, raw, budget: int, error: OSError):
        self.raw, self.budget, self.error, self.written = raw, budget, error, 0

    def write(self, data) -> int:
        self.written += memoryview(data).nbytes
        if self.written > self.budget:
            raise OSError(self.error.errno, self.error.strerror, self.error.filename)
        return self.raw.write(data)

    def __getattr__(self, name):  # read, seek, tell, truncate, flush: the file's own
        return getattr(self.raw, name)


def storage_cause(exc: BaseException) -> OSError | None:
    """The OSError with an errno behind `exc`: HDF5 reports a failed write of its file object again when it closes
    the file ('File close failed'), with the write's own error as the context."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen
        seen = seen.__context__ or seen.__cause__
    return None


def write_rank_file(path: Path, pieces: list[tuple[Piece, np.ndarray]], injected: OSError | None = None) -> dict:
    """Write this rank's pieces (host arrays), fsync, and return {file, sha256, bytes, pieces} for the index.
    A storage failure raises its OSError (errno and file); `injected`: fail so halfway through the pieces' bytes."""
    try:
        with open(path, "w+b") as raw:
            sink = raw if injected is None else _FailingFile(raw, sum(v.nbytes for _, v in pieces) // 2, injected)
            records = _write_pieces(sink, pieces)
            raw.flush()
            os.fsync(raw.fileno())
    except Exception as exc:
        cause = storage_cause(exc)
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror, cause.filename or str(path)) from None
    return {"file": path.name, "sha256": sha256_of(path), "bytes": path.stat().st_size, "pieces": records}


def _write_pieces(raw, pieces: list[tuple[Piece, np.ndarray]]) -> list[dict]:
    records = []
    with h5py.File(raw, "w") as f:
        for number, (piece, values) in enumerate(pieces):
            name = f"{piece.kind}/{piece.tensor}#{number}"
            if values.dtype.name == "bfloat16":  # HDF5 has no bfloat16 (LoRA's frozen base): float32 holds it exactly
                values = values.astype(np.float32)
            dataset = f.create_dataset(name, data=values)
            for key, value in piece.to_dict().items():
                dataset.attrs[key] = value if isinstance(value, str) else np.asarray(value, dtype=np.int64)
            records.append({**piece.to_dict(), "dataset": name, "dtype": str(values.dtype)})
    return records


def commit(partial: Path, final: Path, index: dict) -> None:
    """Rank 0, after every rank's file is on disk: index, marker, rename, then `latest`."""
    with open(partial / INDEX, "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    with open(partial / MARKER, "w") as f:
        f.write(f"step {index['step']}\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_path(partial)
    os.replace(partial, final)
    fsync_path(final.parent)
    point_latest(final.parent)


def point_latest(directory: Path) -> None:
    """`latest` names the newest committed checkpoint (replaced by an atomic rename; removed when there is none)."""
    committed = committed_checkpoints(directory)
    if not committed:
        (directory / "latest").unlink(missing_ok=True)
        return
    latest_tmp = directory / ".latest.tmp"
    latest_tmp.write_text(committed[-1].name + "\n")
    os.replace(latest_tmp, directory / "latest")
    fsync_path(directory)


# ----------------------------------------------------------------------------- finding and cleaning
def committed_checkpoints(directory: Path) -> list[Path]:
    """Committed checkpoint directories, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def clean(directory: Path, keep: int) -> list[Path]:
    """Remove leftover uncommitted directories and all but the `keep` newest committed checkpoints (never the
    newest). Returns what was removed.

    A committed checkpoint is first renamed to `step_X.deleting` (atomic), then deleted: a crash in the middle of
    the deletion must not leave a directory that still looks committed but misses files."""
    removed = []
    if not directory.is_dir():
        return removed
    for path in directory.iterdir():
        leftover = path.name.endswith((".partial", ".deleting")) or (STEP_DIR.match(path.name) and
                                                                      not (path / MARKER).is_file())
        if path.is_dir() and leftover:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    committed = committed_checkpoints(directory)
    for path in committed[:-max(1, keep)] if keep > 0 else []:
        doomed = path.with_name(path.name + ".deleting")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


# ----------------------------------------------------------------------------- reading
@dataclass
class Checkpoint:
    path: Path
    index: dict
    _by_tensor: dict = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path) -> Checkpoint:
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint not found: {path}")
        if not (path / MARKER).is_file():
            raise CheckpointError(f"{path} is not a committed checkpoint (no {MARKER} marker): an interrupted save")
        try:
            index = json.loads((path / INDEX).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path / INDEX} is unreadable: {exc}") from exc
        if not isinstance(index, dict) or not {"step", "files", "tensors"} <= index.keys():
            raise CheckpointError(f"{path / INDEX} is not a checkpoint index (it lacks step, files or tensors)")
        checkpoint = cls(path, index)
        for record in index["files"]:
            for piece in record["pieces"]:
                key = (piece["kind"], piece["tensor"])
                checkpoint._by_tensor.setdefault(key, []).append((record["file"], piece))
        return checkpoint

    @property
    def step(self) -> int:
        return int(self.index["step"])

    def verify_files(self) -> None:
        """Every shard file present, of the recorded size and SHA-256; raises naming the first bad file."""
        for record in self.index["files"]:
            path = self.path / record["file"]
            if not path.is_file():
                raise CheckpointError(f"checkpoint shard missing: {path}")
            if path.stat().st_size != record["bytes"]:
                raise CheckpointError(f"checkpoint shard truncated: {path} has {path.stat().st_size} bytes, "
                                      f"the index recorded {record['bytes']}")
            if sha256_of(path) != record["sha256"]:
                raise CheckpointError(f"checkpoint shard corrupt: {path} does not match its SHA-256 in the index")

    def tensors(self) -> dict:
        return self.index["tensors"]

    def verify_coverage(self) -> None:
        """Every element of every saved tensor is held by exactly one piece, for each kind."""
        for (kind, tensor), saved in sorted(self._by_tensor.items()):
            counts = np.zeros(self.tensors()[tensor]["global_shape"], dtype=np.int32)
            for _, record in saved:
                count_coverage(Piece.from_dict(record), counts)
            if not (counts == 1).all():
                missing, repeated = int((counts == 0).sum()), int((counts > 1).sum())
                raise CheckpointError(f"{self.path}: {kind} {tensor} has {missing} elements in no piece and "
                                      f"{repeated} in more than one")

    def export(self, out: Path, kinds=("param",)) -> None:
        """Full tensors in one HDF5 file (groups params/, exp_avg/, exp_avg_sq/), written then renamed."""
        tmp = out.with_name(f".{out.name}.tmp")
        with h5py.File(tmp, "w") as f:
            f.attrs["step"] = self.step
            f.attrs["config"] = self.index.get("config", "")
            for kind in kinds:
                group = f.create_group("params" if kind == "param" else kind)
                for tensor, info in progress(self.tensors().items(), desc=f"export {kind}", unit="tensor"):
                    shape = tuple(info["global_shape"])
                    group.create_dataset(tensor, data=self.read_box(kind, tensor, (0,) * len(shape), shape,
                                                                    np.dtype(info["dtype"])))
        tmp.replace(out)

    def read_box(self, kind: str, tensor: str, box_offset, box_shape, dtype) -> np.ndarray:
        """The block [box_offset, box_offset + box_shape) of a saved tensor, assembled from whatever pieces hold it.
        Parts outside the tensor (vocabulary padding) are zero."""
        saved = self._by_tensor.get((kind, tensor))
        if not saved:
            hint = "" if kind == "param" else (" (optimizer state: was it saved with another optim.name or "
                                               "optim.adafactor_momentum? resume with the run's own)")
            raise CheckpointError(f"{self.path} has no {kind} for tensor {tensor}{hint}")
        out = np.zeros(box_shape, dtype=dtype)
        covered = np.zeros(box_shape, dtype=bool)
        files: dict[str, h5py.File] = {}
        try:
            for file_name, record in saved:
                if file_name not in files:
                    files[file_name] = h5py.File(self.path / file_name, "r")
                piece = Piece.from_dict(record)
                fill_box(box_offset, box_shape, piece, files[file_name][record["dataset"]][()], out, covered)
        finally:
            for handle in files.values():
                handle.close()
        global_shape = np.asarray(saved[0][1]["global_shape"])
        inside = tuple(slice(0, max(0, min(n, g - o))) for n, g, o in zip(box_shape, global_shape, box_offset))
        if not covered[inside].all():
            raise CheckpointError(f"{self.path}: the saved pieces do not cover all of {kind} {tensor} "
                                  f"[{list(box_offset)} + {list(box_shape)}]")
        return out

    def load_into(self, held: list[HeldPiece]) -> None:
        """Fill every piece this rank holds from the checkpoint (any layout to any layout)."""
        boxes: dict = {}
        for item in held:
            p = item.piece
            key = (p.kind, p.tensor, p.box_offset, p.box_shape)
            if key not in boxes:
                boxes = {key: self.read_box(p.kind, p.tensor, p.box_offset, p.box_shape, np.float64)}
            flat = boxes[key].reshape(-1)[p.flat[0]:p.flat[1]]
            view = item.view()
            view[...] = flat.astype(view.dtype) if isinstance(view, np.ndarray) else _to_device(view, flat)


def _to_device(view, flat: np.ndarray):
    return array_module(view).asarray(flat, dtype=view.dtype)
