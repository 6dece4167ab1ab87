"""Deciding what a run continues from, without MPI: the manager runs these on rank 0 and `generate` in its one process.

- `choose_checkpoint`: the newest committed checkpoint whose files verify, falling back past broken ones.
- `resolve_checkpoint`, `verified_checkpoint`: the checkpoint a path names (a run directory, its checkpoints/ or a
  step_* directory), as `generate`, `train.init_from`, `train --resume PATH` and the `ckpt` commands are given it.
- `review_changes`: what a resume changes in the config since its checkpoint (a table by group, the reshard line),
  refusing the learning-rate schedule and global-batch keys unless `--allow-changes` names them.
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
from dataclasses import dataclass
from pathlib import Path

from mpitrain.checkpoint.store import (
    STEP_DIR,
    Checkpoint,
    CheckpointError,
    committed_checkpoints,
    fsync_path,
    point_latest,
)
from mpitrain.config import Config, ModelConfig, config_from_dict, to_toml
from mpitrain.config_rules import did_you_mean
from mpitrain.errors import ConfigError, shown_path

SET_ASIDE = "set_aside"  # CKPT_DIR/set_aside/<why>/step_X: kept for the user, invisible to resume and retention


def choose_checkpoint(directory: Path, spec: str, echo=print) -> Path | None:
    """`spec` = "auto": the newest committed checkpoint in `directory` whose files verify (None when there is none at
    all); a path: that checkpoint, verified. Raises CheckpointError naming the bad file or the broken checkpoints."""
    if spec != "auto":
        return _named_checkpoint(Path(spec), echo)
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


def _named_checkpoint(path: Path, echo) -> Path:
    """The checkpoint `--resume PATH` names: a step_* directory, verified; or a run directory or its checkpoints/,
    their newest committed checkpoint that verifies (as `generate` takes a run)."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {shown_path(path)} not found")
    if STEP_DIR.match(path.name) or (path / "COMMITTED").is_file():
        Checkpoint.open(path).verify_files()
        return path
    for directory in (path, path / "checkpoints"):
        if committed_checkpoints(directory):
            return choose_checkpoint(directory, "auto", echo)
    raise _nothing_at(path)


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
    return CheckpointError(f"no committed checkpoint at {shown_path(path)} (give a run directory, its checkpoints/ "
                           f"or a step_* directory)")


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


# ----------------------------------------------------------------------------- what a resume changes
# Changed on resume, these keys silently change what the run is: the learning rate of every later step (the cosine
# schedule runs over train.steps) or the batch each step sees. Refused unless --allow-changes names each of them.
SCHEDULE_KEYS = ("optim.lr", "optim.min_lr", "optim.warmup_steps", "train.steps", "optim.decay_fraction",
                 "optim.decay_shape")
BATCH_KEYS = ("train.global_batch", "train.batch_rampup")
MEANING_PREFIXES = ("optim.schedule", "train.batch_rampup")  # keys of those kinds added later, whatever their name
LAYOUT_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero")  # parallel.*: any layout resumes any other (resharded)
GROUPS = ("schedule", "batch", "layout", "precision", "other")
NOT_SET = "-"  # a key one of the two configs does not have


@dataclass(frozen=True)
class ConfigChange:
    key: str
    was: object
    now: object

    @property
    def group(self) -> str:
        section = self.key.split(".", 1)[0]
        if self.key in SCHEDULE_KEYS or self.key.startswith("optim.schedule"):
            return "schedule"
        if self.key in BATCH_KEYS or self.key.startswith("train.batch_rampup") or self.key == "train.micro_batch":
            return "batch"
        return {"parallel": "layout", "precision": "precision"}.get(section, "other")

    @property
    def changes_meaning(self) -> bool:
        return self.key in SCHEDULE_KEYS or self.key in BATCH_KEYS or self.key.startswith(MEANING_PREFIXES)


def _flat(raw: dict) -> dict:
    return {f"{section}.{key}": value for section, values in raw.items() if isinstance(values, dict)
            for key, value in values.items()}


def config_keys() -> list[str]:
    """Every config key, as section.key."""
    return list(_flat(tomllib.loads(to_toml(Config()))))


def config_changes(saved_toml: str, cfg: Config) -> list[ConfigChange]:
    """The keys whose value differs between a checkpoint's config and this run's, in config order. A key the saved
    config lacks (added since) counts as its default, so a checkpoint of an older version shows only real changes."""
    defaults = _flat(tomllib.loads(to_toml(Config())))
    was = {**defaults, **_flat(tomllib.loads(saved_toml))}
    now = _flat(tomllib.loads(to_toml(cfg)))
    keys = dict.fromkeys([*now, *was])
    return [ConfigChange(key, was.get(key, NOT_SET), now.get(key, NOT_SET)) for key in keys
            if was.get(key, NOT_SET) != now.get(key, NOT_SET)]


def check_allowed_changes(allowed) -> list[str]:
    """The keys of `--allow-changes` (repeatable, or comma-separated), each a config key."""
    keys = [key.strip() for item in allowed for key in str(item).split(",") if key.strip()]
    known = config_keys()
    for key in keys:
        if key not in known:
            raise ConfigError(f"--allow-changes {key}: not a config key; {did_you_mean(key, known)}"
                              f"give section.key, e.g. --allow-changes train.steps")
    return keys


def changes_table(changes: list[ConfigChange], checkpoint_name: str) -> list[str]:
    """A small table of the changes (key, was, now), grouped: schedule, batch, layout, precision, other."""
    rows = sorted(changes, key=lambda change: GROUPS.index(change.group))
    width = max(len(change.key) for change in rows)
    shown = [(change, _literal(change.was), _literal(change.now)) for change in rows]
    was_width = max(3, *(len(was) for _, was, _ in shown))
    lines = [f"resume: the config differs from {checkpoint_name}'s:",
             f"  {'group':<10} {'key':<{width}}  {'was':<{was_width}}  now"]
    lines += [f"  {change.group:<10} {change.key:<{width}}  {was:<{was_width}}  {now}" for change, was, now in shown]
    return lines


def _literal(value) -> str:
    return repr(value) if isinstance(value, str) and value != NOT_SET else str(value)


def resharded_line(saved_layout: dict, cfg: Config) -> str | None:
    """"resharded: checkpoint saved under dp=2 tp=1 ... now dp=1 tp=2 ..." when the layout differs, else None."""
    now = {key: getattr(cfg.parallel, key) for key in LAYOUT_KEYS}
    was = {key: saved_layout.get(key, 1 if key != "zero" else 0) for key in LAYOUT_KEYS}
    if was == now:
        return None
    def words(layout):
        return " ".join(f"{key}={value}" for key, value in layout.items())
    return f"resharded: checkpoint saved under {words(was)}, now {words(now)}"


def review_changes(checkpoint: Checkpoint, cfg: Config, allowed: list[str], echo=print) -> None:
    """Before a resume: print what this run's config changes against the checkpoint's (a table, and the reshard
    line), and refuse, on every rank alike, a change to a key that alters the run's meaning that `allowed` (the
    --allow-changes keys) does not name."""
    changes = config_changes(checkpoint.index.get("config", ""), cfg)
    if changes:
        for line in changes_table(changes, checkpoint.path.name):
            echo(line)
    reshard = resharded_line(checkpoint.index.get("layout", {}), cfg)
    if reshard:
        echo(reshard)
    refused = [change.key for change in changes if change.changes_meaning and change.key not in allowed]
    if refused:
        flags = " ".join(f"--allow-changes {key}" for key in refused)
        raise ConfigError(f"resume from {checkpoint.path}: {', '.join(refused)} changed since the checkpoint, which "
                          f"alters the learning-rate schedule or the batch of the steps to come; set them as the "
                          f"checkpoint has them, or pass {flags} to resume with the change")
