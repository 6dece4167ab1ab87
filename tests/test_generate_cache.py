"""The KV cache of generation (layers/kv_cache.py, GPT.decode): in float64 the cached decode gives the no-cache full
forward's last-position logits at every step, for each model flavour the config offers; greedy generation gives the
same ids with and without the cache, also past model.seq_len where the window slides."""
from __future__ import annotations

import numpy as np
import pytest

from mpitrain.backend import make_backend
from mpitrain.config import ModelConfig
from mpitrain.generate import generate_ids
from mpitrain.layers.kv_cache import KVCache
from mpitrain.model.gpt import GPT
from mpitrain.state.inference import InferenceState
from mpitrain.state.replicated import ReplicatedState

SEQ = 16
VARIANTS = {
    "gpt2": {"arch": "gpt2"},  # learned positions, tied head, biases
    "llama-gqa": {"arch": "llama", "n_kv_head": 2},  # RoPE, 4 query heads sharing 2 cached K/V heads
    "llama-moe": {"arch": "llama", "moe": {"experts": 4, "top_k": 2}},  # dropless routing is per token
}


def build(variant: str):
    cfg = ModelConfig(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=SEQ, init_std=0.3, **VARIANTS[variant])
    backend = make_backend("cpu", "float64")
    model = GPT(cfg, backend)
    state = InferenceState(model.layouts, backend)  # what `mpitrain generate` reads: weights only
    state.params.data[...] = ReplicatedState(model.layouts, backend, seed=3).params.data
    return model, state


def rel_err(expected, actual) -> float:
    return float(np.abs(expected - actual).max() / np.abs(expected).max())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_decode_gives_the_full_forwards_logits_at_every_step(variant):
    model, state = build(variant)
    tokens = np.random.default_rng(0).integers(0, 64, (2, SEQ))  # two rows: the cache is per batch row
    cache = KVCache.for_model(model.cfg, 2, model.backend)
    steps = [(0, 5), (5, 9)] + [(n, n + 1) for n in range(9, SEQ)]  # prefill, a second prefill after it, decodes
    for start, end in steps:
        cached = model.decode(state, tokens[:, start:end], cache)
        full = model.last_logits(state, tokens[:, :end])
        assert cache.length == end
        assert rel_err(full, cached) < 1e-12, (variant, end, rel_err(full, cached))
    with pytest.raises(ValueError, match="model.seq_len 16"):
        model.decode(state, tokens[:, :1], cache)


def test_the_cache_holds_only_the_kv_heads_and_counts_what_it_moves():
    model, state = build("llama-gqa")
    cache = KVCache.for_model(model.cfg, 1, model.backend)
    assert cache.nbytes == 2 * 2 * 1 * 2 * SEQ * 8 * 8  # K and V x layers x batch x kv heads x positions x D x 8 B
    model.decode(state, np.arange(4)[None, :], cache)
    model.decode(state, np.array([[7]]), cache)  # one token against 5 cached positions
    moved = cache.moved()
    row = 2 * 8 * 8  # a position's key or value: kv heads x D x 8 bytes
    assert moved["bytes_written"] == 2 * 2 * 5 * row  # layers x (K and V) x positions
    assert moved["bytes_read"] == 2 * 2 * (4 + 5) * row
    assert moved["keys_attended"] == 2 * ((1 + 2 + 3 + 4) + 5)


@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa"])
def test_greedy_generation_is_the_same_with_and_without_the_cache(variant):
    model, state = build(variant)
    prompt = [5, 9, 9, 9, 2]
    def greedy(logits):
        return int(np.argmax(logits))
    with_cache = generate_ids(model, state, prompt, SEQ + 4, greedy)  # 4 tokens past seq_len: the window slides
    without = generate_ids(model, state, prompt, SEQ + 4, greedy, kv_cache=False)
    assert with_cache == without and len(with_cache) == len(prompt) + SEQ + 4
