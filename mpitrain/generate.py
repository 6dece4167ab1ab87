"""Sampling text from a model, and loading a whole model from a checkpoint of any layout into one process."""
from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np

from mpitrain.backend import make_backend
from mpitrain.checkpoint.resume import choose_checkpoint
from mpitrain.checkpoint.store import STEP_DIR, Checkpoint, CheckpointError, committed_checkpoints
from mpitrain.config import config_from_dict
from mpitrain.data.tokenizer import tokenizer_from_description
from mpitrain.model.gpt import GPT
from mpitrain.state.replicated import ReplicatedState


def sample(model: GPT, state, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
           top_k: int = 0, seed: int = 0) -> str:
    """Autoregressive sampling on one rank (no KV cache: small models, readable code)."""
    backend, seq_len = model.backend, model.cfg.seq_len
    rng = np.random.default_rng(seed)
    ids = list(tokenizer.encode(prompt)) or [0]
    for _ in range(max_new_tokens):
        window = np.asarray(ids[-seq_len:], dtype=np.int64)[None, :]
        logits = backend.to_host(model.last_logits(state, backend.from_host(window)))[0].astype(np.float64)
        logits = logits[:tokenizer.vocab_size]  # ids the tokenizer cannot decode are never sampled
        if temperature <= 0:
            ids.append(int(np.argmax(logits)))
            continue
        logits /= temperature
        if top_k:
            logits[logits < np.sort(logits)[-top_k]] = -np.inf
        probs = np.exp(logits - logits.max())
        ids.append(int(rng.choice(len(probs), p=probs / probs.sum())))
    return tokenizer.decode(np.asarray(ids))


def resolve_checkpoint(path) -> Path:
    """A checkpoint directory from: itself, a checkpoints directory (its newest committed), or a run directory."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if (candidate / "COMMITTED").is_file():
            return candidate
        committed = committed_checkpoints(candidate)
        if committed:
            return committed[-1]
    raise CheckpointError(f"no committed checkpoint at {path} (give a run directory, its checkpoints/ or a step_* "
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
    raise CheckpointError(f"no committed checkpoint at {path} (give a run directory, its checkpoints/ or a step_* "
                          f"directory)")


def load_checkpoint_model(path, device: str = "cpu", echo=print):
    """(model, state, tokenizer or None, config): the whole model in one process (tp = 1), from any layout, from a
    verified checkpoint (see verified_checkpoint; echo: where fallback lines go)."""
    checkpoint = verified_checkpoint(path, echo)
    cfg = config_from_dict(tomllib.loads(checkpoint.index["config"]), str(checkpoint.path / "index.json"))
    backend = make_backend(device, cfg.precision.compute)
    model = GPT(cfg.model, backend)
    state = ReplicatedState(model.layouts, backend, seed=None)
    for layout, views in zip(model.layouts, state.params.views):
        for spec in layout.specs:
            full = checkpoint.read_box("param", f"{layout.name}.{spec.name}", spec.start, spec.shape, np.float64)
            views[spec.name][...] = backend.from_host(full, backend.dtype)
    description = checkpoint.index.get("tokenizer")
    tokenizer = tokenizer_from_description(description) if description else None
    return model, state, tokenizer, cfg
