"""The language-model head as a sublayer: final norm, output projection split by vocabulary columns, and the
vocabulary-parallel cross-entropy (the full logits never exist on one rank).

The projection is either the head's own `w_lm` (d_model, V) or, tied (gpt2), the token embedding `wte` (V, d_model)
of the embedding unit, used transposed: the head then declares `borrows = {"wte": "embed.wte"}` (local name ->
global tensor name, the form of ParamSpec.tied_to) and the model hands that tensor in with the head's own.
"""
from __future__ import annotations

import numpy as np

from mpitrain.config import ModelConfig
from mpitrain.layers import ops
from mpitrain.layers import tensor_parallel as tensor
from mpitrain.layers.linear import ColumnParallelLinear
from mpitrain.layers.norm import Norm
from mpitrain.layers.tensor_parallel import TensorParallel, split_spec

PROJECTION = "projection"  # the name the linear knows the (d_model, V/t) weight by


class LMHead:
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        self.tp, self.tied = tp, cfg.arch == "gpt2"
        self.vocab_first, self.vocab_columns, self.vocab_real = tensor.vocab_shard(cfg.vocab_size, tp)
        self.norm = Norm("layernorm" if self.tied else "rmsnorm", "norm", cfg.d_model, cfg.norm_eps, tp)
        self.specs = list(self.norm.specs)
        self.borrows = {"wte": "embed.wte"} if self.tied else {}
        if not self.tied:
            self.specs.append(split_spec("w_lm", (cfg.d_model, cfg.vocab_size), 1, tp, "normal", cfg.init_std,
                                         per_rank=self.vocab_columns))
        self.projection = ColumnParallelLinear(tp, cfg.d_model, [PROJECTION])
        self.partial_grads = list(self.norm.partial_grads)

    def local(self, tensors: dict) -> dict:
        """The head's tensors plus the projection's (d_model, V/t) view: the transposed embedding when tied."""
        return {**tensors, PROJECTION: tensors["wte"].T if self.tied else tensors["w_lm"]}

    def logits(self, params, x):
        """Logits over the whole vocabulary (generation): a single-rank model only."""
        if self.tp.size > 1:
            raise ValueError("generation needs the whole vocabulary on one rank: sample with a tp = 1 model "
                             "(training builds one from the gathered weights at the end)")
        h, _ = self.norm.forward(params, x)
        return ops.linear_forward(h, self.local(params)[PROJECTION])[0]

    def forward(self, params, x, ctx):
        """(sum of token losses, saved); the target token ids are ctx["targets"]."""
        h, norm = self.norm.forward(params, x)
        (logits,), h = self.projection.forward(self.local(params), h)
        logits = tensor.mask_vocab_padding(logits, self.vocab_real)
        loss_sum, loss = tensor.vocab_parallel_cross_entropy_forward(self.tp, logits, ctx["targets"], self.vocab_first)
        return loss_sum, {"norm": norm, "h": h, "loss": loss}

    def backward(self, params, grads, saved, dloss, deferred=None):
        dlogits = tensor.vocab_parallel_cross_entropy_backward(saved["loss"], dloss)
        dh = self.projection.backward(self.local(params), self.local(grads), saved["h"], [dlogits], deferred)
        return self.norm.backward(params, grads, saved["norm"], dh)

    def saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        """The final norm's, the entered input, the softmax probabilities of this rank's columns, the local targets."""
        rows = batch * seq_len
        return (self.norm.saved_arrays(batch, seq_len, dtype) + self.projection.saved_arrays(batch, seq_len, dtype)
                + [((rows, self.vocab_columns), dtype), ((rows,), np.dtype(np.int64))])
