"""Sampling text from a model, and reading/writing the final weights file (until sharded checkpoints land)."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

import h5py
import numpy as np

from mpitrain.backend import make_backend, to_host
from mpitrain.config import config_from_dict, to_toml
from mpitrain.data.tokenizer import tokenizer_from_description
from mpitrain.errors import DataError
from mpitrain.model.gpt import GPT
from mpitrain.model.params import FlatBuffer
from mpitrain.parallel.data import ReplicatedState


def sample(model: GPT, state, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
           top_k: int = 0, seed: int = 0) -> str:
    """Autoregressive sampling on one rank (no KV cache: small models, readable code)."""
    backend, seq_len = model.backend, model.cfg.seq_len
    rng = np.random.default_rng(seed)
    ids = list(tokenizer.encode(prompt)) or [0]
    for _ in range(max_new_tokens):
        window = np.asarray(ids[-seq_len:], dtype=np.int64)[None, :]
        logits = backend.to_host(model.last_logits(state, backend.from_host(window)))[0].astype(np.float64)
        if temperature <= 0:
            ids.append(int(np.argmax(logits)))
            continue
        logits /= temperature
        if top_k:
            logits[logits < np.sort(logits)[-top_k]] = -np.inf
        probs = np.exp(logits - logits.max())
        ids.append(int(rng.choice(len(probs), p=probs / probs.sum())))
    return tokenizer.decode(np.asarray(ids))


def save_weights(path: Path, params: FlatBuffer, cfg, tokenizer_description: dict | None) -> None:
    """Full parameters in one HDF5 file, written to a temporary name and renamed, so a crash never leaves half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w") as f:
        f.attrs["config"] = to_toml(cfg)
        f.attrs["tokenizer"] = json.dumps(tokenizer_description or {})
        group = f.create_group("params")
        for name, view in params.named_views():
            group.create_dataset(name, data=to_host(view))
    tmp.replace(path)


def load_weights(path, device: str = "cpu"):
    """(config, model, state holding the weights, tokenizer or None) from a file written by save_weights."""
    path = Path(path)
    if path.is_dir():
        path = path / "final.h5"
    if not path.is_file():
        raise DataError(f"weights file not found: {path} (train writes RUN_DIR/final.h5)")
    with h5py.File(path, "r") as f:
        cfg = config_from_dict(tomllib.loads(f.attrs["config"]), str(path))
        description = json.loads(f.attrs["tokenizer"])
        backend = make_backend(device, cfg.precision.compute)
        model = GPT(cfg.model, backend)
        state = ReplicatedState(model.layouts, backend, seed=None)
        for name, view in state.params.named_views():
            if name not in f["params"]:
                raise DataError(f"{path} has no tensor {name}: it was written by another model version")
            view[...] = backend.from_host(f["params"][name][()])
    tokenizer = tokenizer_from_description(description) if description else None
    return cfg, model, state, tokenizer
