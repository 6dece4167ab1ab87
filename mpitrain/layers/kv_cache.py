"""The key/value cache of generation: each block's keys and values of the positions seen so far.

Generation without a cache runs the whole window again for every new token: T positions of work for one logit row.
With it, the prompt is run once (prefill) and each new token is one position: its query attends to the cached keys
and values, and its own key and value are appended (Attention.decode). Keys are cached after RoPE (llama): a
position's rotation depends only on its own absolute position, so a cached key never changes.

The arrays are allocated once, (B, kv heads, capacity, head dim) per block, with capacity = model.seq_len (the
longest window the model was trained on; gpt2 has no learned position past it). Grouped-query attention caches only
the n_kv_head heads: the saving GQA exists for. MoE blocks route each new token alone: equal to the window's forward
when dropless (capacity_factor 0); with a capacity, the window's forward may drop picks that a lone token never loses.

The cache also counts what it moves (bytes read and written, keys attended), for the roofline lab's bytes-per-step
model (mpitrain/lab/roofline.py); counting is a few integer additions per block.
"""
from __future__ import annotations


class LayerCache:
    """One block's keys and values, filled left to right."""

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, xp, dtype):
        self.keys = xp.empty((batch, kv_heads, capacity, head_dim), dtype)
        self.values = xp.empty((batch, kv_heads, capacity, head_dim), dtype)
        self.length = 0
        self.bytes_read = self.bytes_written = self.keys_attended = 0

    def append(self, k, v):
        """Store the new positions' k, v (B, kv heads, t, D); returns views of all cached keys and values, theirs
        included (what the new queries attend to)."""
        t, end = k.shape[2], self.length + k.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"KV cache full: {self.length} + {t} positions exceed its {self.keys.shape[2]} "
                             f"(model.seq_len)")
        self.keys[:, :, self.length:end] = k
        self.values[:, :, self.length:end] = v
        self.length = end
        keys, values = self.keys[:, :, :end], self.values[:, :, :end]
        self.bytes_written += 2 * k.size * self.keys.itemsize
        self.bytes_read += keys.nbytes + values.nbytes
        past = end - t
        self.keys_attended += t * past + t * (t + 1) // 2  # new row i sees the past and the new rows up to itself
        return keys, values


class KVCache:
    """Every block's LayerCache, and how many positions they hold."""

    def __init__(self, n_layer: int, batch: int, kv_heads: int, capacity: int, head_dim: int, xp, dtype):
        self.layers = [LayerCache(batch, kv_heads, capacity, head_dim, xp, dtype) for _ in range(n_layer)]

    @classmethod
    def for_model(cls, cfg, batch: int, backend) -> KVCache:
        """A cache for a whole model of ModelConfig `cfg` (tp = 1), in the compute dtype."""
        return cls(cfg.n_layer, batch, cfg.kv_heads, cfg.seq_len, cfg.head_dim, backend.xp, backend.dtype)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def clear(self) -> None:
        """Forget every position (the arrays and the counters stay)."""
        for layer in self.layers:
            layer.length = 0

    @property
    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)

    def moved(self) -> dict:
        """Bytes read and written and keys attended since the cache was made, summed over the blocks."""
        return {name: sum(getattr(layer, name) for layer in self.layers)
                for name in ("bytes_read", "bytes_written", "keys_attended")}
