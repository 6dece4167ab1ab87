"""Weights only, for fine-tuning: start a run from another run's parameters (`train.init_from`), and export a LoRA
checkpoint with its adapters merged into the base weights (`mpitrain ckpt export --merge-lora`)."""
from __future__ import annotations

import tomllib
from pathlib import Path

import h5py
import numpy as np

from mpitrain.checkpoint.hf import HFWeights, is_hf_folder
from mpitrain.checkpoint.resume import model_mismatch, resolve_checkpoint
from mpitrain.checkpoint.store import Checkpoint, CheckpointError
from mpitrain.config import config_from_dict, to_toml
from mpitrain.errors import ConfigError
from mpitrain.layers.lora import SUFFIXES, merge


def is_adapter(tensor: str) -> bool:
    return tensor.endswith(SUFFIXES)


def load_weights(manager, path: str) -> str:
    """Collective. The parameters of the checkpoint at `path` (any layout: the pieces are resharded on reading), or
    of a Hugging Face folder (checkpoint/hf.py), into this run's state; optimizer state stays fresh and the run starts
    at step 0. LoRA adapters a base checkpoint lacks keep their initial values (b = 0: the run starts as the base
    model). Returns the checkpoint's path, with what an HF import adapted."""
    if not Path(path).exists():
        raise ConfigError(f"config key train.init_from = {path!r}: no such checkpoint or run directory")
    if is_hf_folder(path):
        checkpoint = HFWeights.open_folder(path, manager.cfg.model)
    else:
        checkpoint = Checkpoint.open(resolve_checkpoint(path))
    mismatch = model_mismatch(checkpoint, manager.cfg.model)
    if mismatch:
        raise CheckpointError(f"train.init_from: {mismatch}")
    held = [item for item in manager.held() if item.piece.kind == "param"]
    saved = checkpoint.tensors()
    needed = {item.piece.tensor for item in held}
    gathered = manager.world.gather_object(needed)  # pipeline stages hold different tensors: rank 0 sees them all
    verdict = None
    if manager.world.rank == 0:
        needed = set().union(*gathered)
        missing = sorted(name for name in needed - saved.keys() if not is_adapter(name))
        unused = sorted(saved.keys() - needed)
        if missing or unused:
            verdict = (f"train.init_from: {checkpoint.path} does not fit this model (missing there: "
                       f"{', '.join(missing) or '-'} | unused here: {', '.join(unused) or '-'}); a LoRA checkpoint "
                       f"needs the same [lora] settings, or export it with --merge-lora")
    verdict = manager.world.broadcast_object(verdict)
    if verdict:
        raise CheckpointError(verdict)
    checkpoint.load_into([item for item in held if item.piece.tensor in saved])
    manager.state.after_restore()
    if isinstance(checkpoint, HFWeights):
        return f"{checkpoint.path} (Hugging Face; {'; '.join(checkpoint.notes)})"
    return str(checkpoint.path)


def export_merged(checkpoint: Checkpoint, out: Path) -> int:
    """One HDF5 file of full tensors (params/<name>) with every adapter merged, W + (alpha / r) a b, in the base
    weight's dtype, and a config without [lora]; returns how many weights were merged."""
    stored = tomllib.loads(checkpoint.index.get("config", ""))
    lora = stored.get("lora", {})
    rank, alpha = int(lora.get("rank", 0)), float(lora.get("alpha", 16.0))
    names = checkpoint.tensors()
    if not rank or not any(is_adapter(name) for name in names):
        raise CheckpointError(f"{checkpoint.path} holds no LoRA adapters (lora.rank = {rank} in its config): "
                              f"export it without --merge-lora")
    tensors = {name: checkpoint.read_box("param", name, (0,) * len(info["global_shape"]), info["global_shape"],
                                         np.float64) for name, info in names.items()}
    merged = merge(tensors, rank, alpha)
    stored.pop("lora", None)
    tmp = out.with_name(f".{out.name}.tmp")
    with h5py.File(tmp, "w") as f:
        f.attrs["step"] = checkpoint.step
        f.attrs["config"] = to_toml(config_from_dict(stored))
        group = f.create_group("params")
        for name, value in merged.items():
            group.create_dataset(name, data=value.astype(np.dtype(names[name]["dtype"])))
    tmp.replace(out)
    return sum(is_adapter(name) for name in names) // 2
