"""Deciding what a run continues from, without MPI: the manager runs these on rank 0 and `generate` in its one process.

- `choose_checkpoint`: the newest committed checkpoint whose files verify, falling back past broken ones.
- `resolve_checkpoint`, `verified_checkpoint`: the checkpoint a path names (a run directory, its checkpoints/ or a
  step_* directory), as `generate`, `train.init_from` and the `ckpt` commands are given it.
- `set_aside_newer`: checkpoints beyond the step a run continues from are moved out of the way, never deleted.
- `model_mismatch`: the model architecture keys of a checkpoint's config against the run's.
- `writable_problem`: can this process create files in the checkpoint directory (asked at start-up, not at step N).
- `trim_metrics`: a resumed run drops the metrics rows of the steps it is about to redo.
"""
from __future__ import annotations

import json
import os
import tempfile
import tomllib
from pathlib import Path

from mpitrain.checkpoint.store import (
    STEP_DIR,
    Checkpoint,
    CheckpointError,
    committed_checkpoints,
    fsync_path,
    point_latest,
)
from mpitrain.config import ModelConfig, config_from_dict
from mpitrain.errors import ConfigError

SET_ASIDE = "set_aside"  # CKPT_DIR/set_aside/<why>/step_X: kept for the user, invisible to resume and retention


def choose_checkpoint(directory: Path, spec: str, echo=print) -> Path | None:
    """`spec` = "auto": the newest committed checkpoint in `directory` whose files verify (None when there is none at
    all); a path: that checkpoint, verified. Raises CheckpointError naming the bad file or the broken checkpoints."""
    if spec != "auto":
        Checkpoint.open(Path(spec)).verify_files()
        return Path(spec)
    broken = []
    for candidate in reversed(committed_checkpoints(directory)):
        try:
            Checkpoint.open(candidate).verify_files()
            return candidate
        except CheckpointError as exc:
            echo(f"checkpoint: {exc}; falling back to the previous committed checkpoint")
            broken.append(f"{candidate.name} ({exc})")
    if broken:
        # Not "start from step 0": left in place these stay the newest (retention would delete the new, good
        # checkpoints first and auto would keep trying them); set aside, a whole run's progress would be dropped
        # without anyone deciding it. A run whose every save is broken needs a person.
        raise CheckpointError(f"every committed checkpoint in {directory} is broken: {'; '.join(broken)}; repair or "
                              f"move them out of {directory} to start afresh")
    return None


def resolve_checkpoint(path) -> Path:
    """A checkpoint directory from: itself, a checkpoints directory (its newest committed), or a run directory."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if (candidate / "COMMITTED").is_file():
            return candidate
        committed = committed_checkpoints(candidate)
        if committed:
            return committed[-1]
    raise _nothing_at(path)


def _nothing_at(path: Path) -> CheckpointError:
    return CheckpointError(f"no committed checkpoint at {path} (give a run directory, its checkpoints/ or a step_* "
                           f"directory)")


def verified_checkpoint(path, echo=print) -> Checkpoint:
    """A checkpoint whose shard files match their checksums. A step_* directory must itself be whole (else one line
    naming the bad file); for a run directory or its checkpoints/, the newest whole one, falling back past broken ones
    with a line each, as `train --resume auto` does (the same code)."""
    path = Path(path)
    if STEP_DIR.match(path.name) or (path / "COMMITTED").is_file():
        return Checkpoint.open(choose_checkpoint(path.parent, str(path), echo))
    for directory in (path, path / "checkpoints"):
        if committed_checkpoints(directory):
            return Checkpoint.open(choose_checkpoint(directory, "auto", echo))
    raise _nothing_at(path)


def set_aside_newer(directory: Path, step: int, kept: Path | None, echo=print) -> Path | None:
    """Move every committed checkpoint of `directory` beyond `step` (and one at `step` that is not `kept`, the
    checkpoint the run continues from) into CKPT_DIR/set_aside/beyond_step_S[.N]/; returns that folder, or None.

    Why move, not delete or leave: they are an abandoned future (a branch from an older step, a fresh start in a used
    directory) or failed verification. Left in place, `--resume auto` and `generate` would take them, a save of the
    same step would collide with them and retention (newest first) would delete the good checkpoints before them.
    Deleting would silently lose a user's data (a branch may be worth comparing, a corrupt shard worth inspecting).
    Each move is one atomic rename inside the same filesystem, so every checkpoint stays whole wherever it is."""
    kept = kept.resolve() if kept is not None else None
    def step_of(path: Path) -> int:
        return int(STEP_DIR.match(path.name).group(1))

    beyond = [path for path in committed_checkpoints(directory)
              if step_of(path) > step or (step_of(path) == step and path.resolve() != kept)]
    if not beyond:
        return None
    folder = directory / SET_ASIDE / f"beyond_step_{step:08d}"
    number = 1
    while folder.exists():
        number += 1
        folder = directory / SET_ASIDE / f"beyond_step_{step:08d}.{number}"
    folder.mkdir(parents=True)
    for path in beyond:
        os.replace(path, folder / path.name)
    fsync_path(folder)
    fsync_path(directory)
    point_latest(directory)
    echo(f"checkpoint: moved {', '.join(p.name for p in beyond)} (beyond step {step}, where this run continues) to "
         f"{folder}, out of reach of --resume, generate and checkpoint.keep; nothing was deleted")
    return folder


def architecture(model: ModelConfig) -> dict:
    """The model.* keys that decide which tensors exist and what they mean (effective values: d_ff = 0 and an
    explicit 4*d_model are the same model). Not init_std: it only matters before step 1."""
    keys = {"model.arch": model.arch, "model.n_layer": model.n_layer, "model.d_model": model.d_model,
            "model.n_head": model.n_head, "model.n_kv_head": model.kv_heads, "model.d_ff": model.ff_dim,
            "model.vocab_size": model.vocab_size, "model.norm_eps": model.norm_eps}
    if model.arch == "gpt2":
        keys["model.seq_len"] = model.seq_len  # learned positions: a table of seq_len rows
    else:
        keys["model.rope_theta"] = model.rope_theta  # rotary positions: any seq_len fits, the frequencies must agree
    return keys


def model_mismatch(checkpoint: Checkpoint, model: ModelConfig) -> str | None:
    """One line naming the model keys whose values differ between the checkpoint's config and this run's, or None."""
    try:
        stored = config_from_dict({"model": tomllib.loads(checkpoint.index["config"]).get("model", {})}).model
    except (KeyError, tomllib.TOMLDecodeError, ConfigError) as exc:
        return f"{checkpoint.path / 'index.json'} has no readable model config ({exc})"
    there, here = architecture(stored), architecture(model)
    keys = dict.fromkeys([*there, *here])  # both arches' keys, in order, once
    differ = [f"{key} = {there.get(key, '-')} there, {here.get(key, '-')} here" for key in keys
              if there.get(key) != here.get(key)]
    if not differ:
        return None
    return (f"{checkpoint.path} holds another model: {'; '.join(differ)}; set these keys as the checkpoint has them "
            f"(or train a new run)")


def writable_problem(directory: Path) -> str | None:
    """Why this process cannot create files in `directory` (created if missing), or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return None


def trim_metrics(path: Path, last_step: int) -> None:
    """Keep the rows of steps 1..last_step (and no torn line): a resumed run logs the later steps again. Written to a
    temporary file and renamed, so a crash leaves the old file or the trimmed one, never half of either."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by a crash mid-write
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
