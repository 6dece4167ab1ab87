"""Sampling text from a model, and loading a whole model from a checkpoint of any layout into one process."""
from __future__ import annotations

import tomllib

import numpy as np

from mpitrain.backend import make_backend
from mpitrain.checkpoint.resume import verified_checkpoint
from mpitrain.config import config_from_dict
from mpitrain.data.tokenizer import tokenizer_from_description
from mpitrain.layers.kv_cache import KVCache
from mpitrain.model.gpt import GPT
from mpitrain.state.inference import InferenceState


def sample(model: GPT, state, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
           top_k: int = 0, seed: int = 0, kv_cache: bool = True) -> str:
    """Autoregressive sampling on one rank; `kv_cache` False runs the whole window again per token (the reference
    the cached decode is tested against)."""
    rng = np.random.default_rng(seed)

    def choose(logits) -> int:
        logits = logits[:tokenizer.vocab_size]  # ids the tokenizer cannot decode are never sampled
        if temperature <= 0:
            return int(np.argmax(logits))
        logits = logits / temperature
        if top_k:
            logits[logits < np.sort(logits)[-top_k]] = -np.inf
        probs = np.exp(logits - logits.max())
        return int(rng.choice(len(probs), p=probs / probs.sum()))

    ids = generate_ids(model, state, list(tokenizer.encode(prompt)) or [0], max_new_tokens, choose, kv_cache)
    return tokenizer.decode(np.asarray(ids))


def generate_ids(model: GPT, state, ids: list[int], max_new_tokens: int, choose, kv_cache: bool = True) -> list[int]:
    """ids plus max_new_tokens more, each `choose(float64 logits of the next position)`."""
    next_logits = CachedDecoder(model, state) if kv_cache else WindowDecoder(model, state)
    ids = list(ids)
    for _ in range(max_new_tokens):
        ids.append(choose(next_logits(ids)))
    return ids


class WindowDecoder:
    """No cache: the last model.seq_len ids through the whole model for every new token."""

    def __init__(self, model: GPT, state):
        self.model, self.state = model, state

    def __call__(self, ids: list[int]) -> np.ndarray:
        backend, window = self.model.backend, np.asarray(ids[-self.model.cfg.seq_len:], dtype=np.int64)[None, :]
        return backend.to_host(self.model.last_logits(self.state, backend.from_host(window)))[0].astype(np.float64)


class CachedDecoder:
    """With a KV cache: the ids not yet cached go through the model (the prompt at once, then one per token).

    Past model.seq_len the window slides, and a slid window cannot reuse its keys and values: positions shift (the
    learned position rows and rotary angles of every token change) and the oldest token leaves every attention. So
    from then on each token re-prefills the last seq_len ids, exactly as WindowDecoder: results stay identical with
    and without the cache, and the cache speeds up the first seq_len positions (the window the model was trained
    on; no position past it exists for gpt2)."""

    def __init__(self, model: GPT, state):
        self.model, self.state = model, state
        self.cache, self.cached = None, []  # the ids whose keys and values the cache holds

    def __call__(self, ids: list[int]) -> np.ndarray:
        model, backend = self.model, self.model.backend
        window = ids[-model.cfg.seq_len:]
        cached = len(self.cached)
        extends = cached < len(ids) <= model.cfg.seq_len and ids[:cached] == self.cached
        if self.cache is None:
            self.cache = KVCache.for_model(model.cfg, 1, backend)
        if not extends:  # a new prompt, or a slid window: prefill
            self.cache.clear()
            self.cached = []
        new = np.asarray(window[len(self.cached):], dtype=np.int64)[None, :]
        logits = model.decode(self.state, backend.from_host(new), self.cache)
        self.cached = list(window)
        return backend.to_host(logits)[0].astype(np.float64)


def load_checkpoint_model(path, device: str = "cpu", echo=print, announce: bool = False):
    """(model, state, tokenizer or None, config): the whole model in one process (tp = 1), from any layout, from a
    verified checkpoint (see checkpoint/resume.verified_checkpoint; echo: where fallback lines go, and with
    `announce` the checkpoint taken: a run directory names none of its own)."""
    checkpoint = verified_checkpoint(path, echo)
    if announce:
        echo(f"checkpoint: loaded {checkpoint.path} (step {checkpoint.step})")
    cfg = config_from_dict(tomllib.loads(checkpoint.index["config"]), str(checkpoint.path / "index.json"))
    backend = make_backend(device, cfg.precision.compute)
    model = GPT(cfg.model, backend)
    state = InferenceState(model.layouts, backend)  # weights only: generation computes no gradient
    for layout, views in zip(model.layouts, state.params.views):
        for spec in layout.specs:
            full = checkpoint.read_box("param", f"{layout.name}.{spec.name}", spec.start, spec.shape, np.float64)
            views[spec.name][...] = backend.from_host(full, backend.dtype)
    description = checkpoint.index.get("tokenizer")
    tokenizer = tokenizer_from_description(description) if description else None
    return model, state, tokenizer, cfg
