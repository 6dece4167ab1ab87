"""A decoder-only transformer (or one pipeline stage of it): a list of units and the loops that run them.

The model holds no parameters: `forward`/`backward` ask a *state* object for each unit's parameter and gradient
views. The state decides where they live: one full flat buffer (data parallelism, ZeRO-1/2) or a shard that is
all-gathered just before use and freed after (ZeRO-3). See `mpitrain/parallel/data.py` for the protocol:

    state.acquire(unit, phase) -> dict of parameter views   (phase: "forward" | "backward")
    state.release(unit, phase)                               after the unit's last reader in that phase
    state.grad_views(unit) -> dict of gradient views         (added into by backward)
    state.unit_done(unit)                                    its gradients for this micro-batch are complete

Most units read only their own parameters; the gpt2 head also reads the embedding's `wte` (tied weights), so
"last reader" is tracked per unit and phase.
"""
from __future__ import annotations

import math

from mpitrain.config import ModelConfig
from mpitrain.model import ops
from mpitrain.model.units import Block, Embedding, Head
from mpitrain.parallel.tensor import TensorParallel


class GPT:
    def __init__(self, cfg: ModelConfig, backend, *, tp_group=None, sequence_parallel: bool = False,
                 tp: TensorParallel | None = None):
        """`tp_group`: the tensor-parallel group (None: one rank), handed to every unit together with the mode
        (`sequence_parallel`) as one TensorParallel; or pass that object itself as `tp`."""
        self.cfg, self.backend = cfg, backend
        self.tp = tp or TensorParallel(tp_group, sequence_parallel)
        self.units = ([Embedding(cfg, self.tp)] + [Block(cfg, i, self.tp) for i in range(cfg.n_layer)]
                      + [Head(cfg, self.tp)])
        self.layouts = [u.layout for u in self.units]
        head = len(self.units) - 1
        # reads[i]: the units whose parameters unit i uses
        self.reads = {i: [i] for i in range(len(self.units))}
        if self.units[head].tied:
            self.reads[head].append(0)
        self.last_reader = {"forward": {}, "backward": {}}
        for i in range(len(self.units)):  # forward runs units in ascending order, backward in descending
            for j in self.reads[i]:
                self.last_reader["forward"][j] = max(i, self.last_reader["forward"].get(j, i))
                self.last_reader["backward"][j] = min(i, self.last_reader["backward"].get(j, i))
        self._ctx_cache: dict[int, dict] = {}

    @property
    def n_params(self) -> int:
        """Parameters of the whole model (under tensor parallelism too: global shapes, vocabulary padding excluded)."""
        return sum(math.prod(spec.full_shape) for layout in self.layouts for spec in layout.specs)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6 per matmul weight (forward 2, backward 4) plus attention's 12*L*d*T.

        The weights counted are all but the input embedding tables (a lookup is no matmul); the output projection
        counts, tied or not, since the head's matmul is real work."""
        cfg = self.cfg
        seq_len = seq_len or cfg.seq_len
        embedding = cfg.vocab_size * cfg.d_model + (cfg.seq_len * cfg.d_model if cfg.arch == "gpt2" else 0)
        matmul_weights = self.n_params - embedding + cfg.vocab_size * cfg.d_model
        return 6.0 * matmul_weights + 12.0 * cfg.n_layer * cfg.d_model * seq_len

    def context(self, seq_len: int) -> dict:
        """Per-sequence-length constants shared by all units: positions, causal mask, rotary tables."""
        if seq_len not in self._ctx_cache:
            xp, dtype, cfg = self.backend.xp, self.backend.dtype, self.cfg
            ctx = {"xp": xp, "positions": xp.arange(seq_len), "bias": ops.causal_bias(seq_len, seq_len, xp, dtype)}
            if cfg.arch == "llama":
                ctx["cos"], ctx["sin"] = ops.rope_tables(xp.arange(seq_len), cfg.head_dim, cfg.rope_theta, xp, dtype)
            self._ctx_cache[seq_len] = ctx
        return self._ctx_cache[seq_len]

    # -- parameter access through the state
    def _params(self, state, unit: int, phase: str) -> dict:
        views = {}
        for j in reversed(self.reads[unit]):  # the unit's own tensors win over borrowed ones of the same name
            own = state.acquire(j, phase)
            views.update(own if j == unit else {"wte": own["wte"]})
        return views

    def _grads(self, state, unit: int) -> dict:
        views = {}
        for j in reversed(self.reads[unit]):
            own = state.grad_views(j)
            views.update(own if j == unit else {"wte": own["wte"]})
        return views

    def _after(self, state, unit: int, phase: str) -> None:
        for j in self.reads[unit]:
            if self.last_reader[phase][j] == unit:
                if phase == "backward":
                    state.unit_done(j)
                state.release(j, phase)

    # -- one micro-batch
    def forward(self, state, tokens, targets):
        """Returns (sum of token losses, saved state per unit)."""
        ctx = self.context(tokens.shape[1])
        x, saved = tokens, []
        head = len(self.units) - 1
        for i, unit in enumerate(self.units):
            p = self._params(state, i, "forward")
            if i == head:
                x, s = unit.forward(p, x, targets)
            else:
                x, s = unit.forward(p, x, ctx)
            self._after(state, i, "forward")
            saved.append(s)
        return x, saved

    def backward(self, state, saved, dloss: float) -> None:
        dx = dloss
        for i in reversed(range(len(self.units))):
            dx = self.units[i].backward(self._params(state, i, "backward"), self._grads(state, i), saved[i], dx)
            saved[i] = None  # free this unit's activations as soon as they are used
            self._after(state, i, "backward")

    def last_logits(self, state, tokens):
        """Logits of the last position (generation; a tp = 1 model, see Head.logits)."""
        ctx = self.context(tokens.shape[1])
        x, head = tokens, len(self.units) - 1
        for i, unit in enumerate(self.units):
            p = self._params(state, i, "forward")
            if i == head:
                x = unit.logits(p, x[:, -1:])[:, 0]
            else:
                x, _ = unit.forward(p, x, ctx)
            self._after(state, i, "forward")
        return x
