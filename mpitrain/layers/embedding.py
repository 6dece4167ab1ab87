"""The token embedding as a sublayer: split over tp by vocabulary rows (ceil(V/t) per rank, the overhang zero
padding), plus learned positions for gpt2 (replicated; under sequence parallelism a rank adds its chunk's).

Positions are the model's (0..T-1, or a cp rank's zig-zag chunks), one vector for every row; with packed documents
(data.document_mask) they are each token's position inside its document, a (B, T) array per micro-batch, kept with
the token ids for backward's scatter into the table."""
from __future__ import annotations

import numpy as np

from mpitrain.config import ModelConfig
from mpitrain.layers import ops
from mpitrain.layers import tensor_parallel as tensor
from mpitrain.layers.tensor_parallel import TensorParallel, split_spec
from mpitrain.state.params import ParamSpec


class TokenEmbedding:
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        self.tp = tp
        self.vocab_first, rows, _ = tensor.vocab_shard(cfg.vocab_size, tp)
        self.specs = [split_spec("wte", (cfg.vocab_size, cfg.d_model), 0, tp, "normal", cfg.init_std, per_rank=rows)]
        if cfg.arch == "gpt2":
            self.specs.append(ParamSpec("wpe", (cfg.seq_len, cfg.d_model), "normal", cfg.init_std))
        self.partial_grads: list[str] = []
        self.ring = None  # the rank's ContextParallel under parallel.cp > 1: its tokens' absolute positions

    def forward(self, params, tokens, ctx):
        """(x, saved): x is this rank's sequence chunk under SP; saved are the token ids local to this rank's rows."""
        x, ids = tensor.vocab_parallel_embedding_forward(self.tp, params["wte"], tokens, self.vocab_first)
        positions = ctx["positions"]
        if "wpe" in params:
            x += params["wpe"][positions[..., self.tp.sequence_chunk(tokens.shape[1])]]
        if "wpe" in params and positions.ndim == 2:  # per-row positions (packed documents): backward needs them
            return x, (ids, positions)
        return x, ids

    def backward(self, params, grads, ids, dx, deferred=None) -> None:
        """Adds the rows' gradients (a scatter, not a matmul: done at once even in a split backward)."""
        ids, positions = ids if isinstance(ids, tuple) else (ids, None)
        dx = tensor.vocab_parallel_embedding_backward(self.tp, ids, dx, grads["wte"])  # dx: the whole sequence now
        if "wpe" in grads and positions is not None:  # each token's position inside its document
            ops.scatter_add_rows(grads["wpe"], positions.reshape(-1), dx.reshape(-1, dx.shape[-1]))
        elif "wpe" in grads:  # positions are 0..T-1 without context parallelism, the zig-zag chunks' with it
            rows = slice(0, dx.shape[1]) if self.ring is None else self.ring.positions(dx.shape[1])
            grads["wpe"][rows] += dx.sum(axis=0)

    def saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        return [((batch, seq_len), np.dtype(np.int64))]
