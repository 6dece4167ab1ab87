"""A decoder-only transformer (or one pipeline rank's part of it): a list of units and the loops that run them.

The model holds no parameters: `forward`/`backward` ask a *state* object for each unit's parameter and gradient
views. The state decides where they live: one full flat buffer (data parallelism, ZeRO-1/2) or a shard that is
all-gathered just before use and freed after (ZeRO-3). See `mpitrain/state/replicated.py` for the protocol:

    state.acquire(unit, phase) -> dict of parameter views   (phase: "forward" | "backward")
    state.release(unit, phase)                               after the unit's last reader in that phase
    state.grad_views(unit) -> dict of gradient views         (added into by backward)
    state.unit_done(unit)                                    its gradients for this micro-batch are complete

Most units read only their own parameters; a unit may also borrow tensors of another (`unit.borrows`, local name ->
global name: gpt2's head reads the embedding's `wte`, tied weights), so "last reader" is tracked per unit and phase.

Pipeline parallelism. The global units are 0 (embedding), 1..n_layer (blocks "blocks.0".. ) and n_layer + 1 (head);
a pipeline rank holds one contiguous range of them per model chunk (`stages`, v ranges under the interleaved
schedule) and runs `forward`/`backward` one chunk at a time. Unit names stay global, so checkpoints reshard across
pp. A unit that borrows from a unit on another rank (gpt2's head on a rank without the embedding) reads a COPY of
that unit (the last local unit, same layout and name, its tensors marked `tied_to` the originals): the pipeline
sums the two copies' gradients after each step so that they get the same update; `tied_copies` names its
tensors, which checkpoints load but never write.

zb1p splits a chunk's backward in two: `backward(..., deferred=work)` computes the input gradient (B) and the cheap
gradients at once and leaves the weight-gradient matmuls in `work`; `backward_weight(state, work, chunk)` (W) runs
them. The state hears `unit_done` only after W.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from mpitrain.backend import make_backend
from mpitrain.config import ModelConfig
from mpitrain.config_moe import MoeSettings
from mpitrain.layers import ops
from mpitrain.layers.attention_core import document_bias
from mpitrain.layers.expert_parallel import ExpertParallel
from mpitrain.layers.lora import apply_lora, with_frozen_sinks
from mpitrain.layers.moe import inactive_params, update_routing_bias
from mpitrain.layers.precision import LOW_PRECISION
from mpitrain.layers.tensor_parallel import TensorParallel
from mpitrain.model.units import Block, Embedding, Head
from mpitrain.state.params import UnitLayout


def rope_table_dtype(compute_dtype):
    """Rotary tables stay float32 under bf16/fp16 compute: 8 bits of mantissa would turn far positions' angles."""
    return np.dtype(np.float32) if compute_dtype in LOW_PRECISION else compute_dtype


class GPT:
    def __init__(self, cfg: ModelConfig, backend, *, tp_group=None, sequence_parallel: bool = False,
                 tp: TensorParallel | None = None, stages: list[tuple[int, int]] | None = None, lora=None,
                 ep_group=None, ep: ExpertParallel | None = None):
        """`tp_group`: the tensor-parallel group (None: one rank), handed to every unit together with the mode
        (`sequence_parallel`) as one TensorParallel; or pass that object itself as `tp`.
        `stages`: the [first, end) global unit ranges of this rank's model chunks, in the order the data visits them
        (None: the whole model, one chunk). `lora`: a LoraConfig with rank > 0 freezes every tensor and adds
        adapters (mpitrain/layers/lora.py). `ep_group` (or `ep`): where the experts of MoE blocks live."""
        self.cfg, self.backend = cfg, backend
        self.tp = tp or TensorParallel(tp_group, sequence_parallel)
        self.ep = ep or ExpertParallel(ep_group, MoeSettings.of(cfg).experts or 1)
        self.aux_losses: dict = {}  # MoE layers add their auxiliary losses of a training step here (pop_aux_losses)
        every = self._all_units()  # layouts only, no arrays: cheap to build whole
        self.lora = lora if lora is not None and lora.rank > 0 else None
        if self.lora:
            apply_lora(every, self.lora.rank, self.lora.alpha, self.lora.targets, self.tp)
        self.n_params = sum(math.prod(spec.full_shape) for unit in every for spec in unit.layout.specs)
        self.n_trainable = sum(math.prod(spec.full_shape) for unit in every for spec in unit.layout.specs
                               if spec.trainable)
        stages = stages or [(0, len(every))]
        self.units, self.chunks = [], []  # chunks[c]: local indices of chunk c's units, in data order
        for first, end in stages:
            self.chunks.append(list(range(len(self.units), len(self.units) + end - first)))
            self.units += every[first:end]
        self.tied_copies: tuple[str, ...] = ()  # tensor names this rank holds as a copy of another rank's
        self.tied_unit: int | None = None  # local index of a unit whose gradient another pipeline rank also has
        self.reads = {i: [i] for i in range(len(self.units))}  # reads[i]: the units whose parameters unit i uses
        self.borrowed = {i: {} for i in range(len(self.units))}  # borrowed[i]: local name -> (unit, tensor name)
        for reader in every:
            for local_name, global_name in reader.borrows.items():
                self._tie(reader, local_name, global_name, every)
        self.layouts = [u.layout for u in self.units]
        self.last_reader = {"forward": {}, "backward": {}}
        for i in range(len(self.units)):  # forward runs units in ascending order, backward in descending
            for j in self.reads[i]:
                self.last_reader["forward"][j] = max(i, self.last_reader["forward"].get(j, i))
                self.last_reader["backward"][j] = min(i, self.last_reader["backward"].get(j, i))
        self._ctx_cache: dict[int, dict] = {}
        self.context_parallel = None  # the rank's ContextParallel under parallel.cp > 1 (parallel/context.py)
        # observe(unit name, output): told each unit's output in training and evaluation forwards (mpitrain doctor
        # parity compares them with a reference); None: nothing is called
        self.observe = None
        self.document_mask = False  # data.document_mask: every stage's forward takes its micro-batch's documents

    def _all_units(self) -> list:
        cfg = self.cfg
        blocks = [Block(cfg, i, self.tp, self.ep) for i in range(cfg.n_layer)]
        return [Embedding(cfg, self.tp)] + blocks + [Head(cfg, self.tp)]

    def _tie(self, reader, local_name: str, global_name: str, every: list) -> None:
        """Unit `reader` reads tensor `global_name` ("embed.wte") of another unit as `local_name`. A rank holding the
        reader but not the owner holds a copy of the owner unit (read only, never run; its tensors marked tied_to
        their originals); a rank holding the owner but not the reader has the original. On both the owner is the
        `tied_unit` whose gradient the pipeline sums between the two ranks after each step (same update)."""
        unit_name, tensor_name = global_name.rsplit(".", 1)
        local = {id(unit): i for i, unit in enumerate(self.units)}
        owner = next((i for i, unit in enumerate(self.units) if unit.layout.name == unit_name), None)
        if id(reader) not in local:
            if owner is not None:
                self.tied_unit = owner
            return
        if owner is None:
            copy = next(unit for unit in every if unit.layout.name == unit_name)
            copy.layout = UnitLayout(unit_name, [replace(spec, tied_to=f"{unit_name}.{spec.name}")
                                                 for spec in copy.layout.specs])
            self.units.append(copy)
            owner = self.tied_unit = len(self.units) - 1
            self.reads[owner], self.borrowed[owner] = [owner], {}
            self.tied_copies += tuple(f"{unit_name}.{spec.name}" for spec in copy.layout.specs)
        self.reads[local[id(reader)]].append(owner)
        self.borrowed[local[id(reader)]][local_name] = (owner, tensor_name)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token of the whole model: 6 per matmul weight (forward 2, backward 4) plus attention's
        12*L*d*T.

        The weights counted are all but the input embedding tables (a lookup is no matmul); the output projection
        counts, tied or not, since the head's matmul is real work."""
        cfg = self.cfg
        seq_len = seq_len or cfg.seq_len
        embedding = cfg.vocab_size * cfg.d_model + (cfg.seq_len * cfg.d_model if cfg.arch == "gpt2" else 0)
        # MoE: a token uses k of the E experts, so only the active parameters count (inactive_params)
        matmul_weights = self.n_params - embedding + cfg.vocab_size * cfg.d_model - inactive_params(cfg)
        flops = 6.0 * matmul_weights + 12.0 * cfg.n_layer * cfg.d_model * seq_len
        if self.lora:  # every base weight is frozen: forward 2 and input gradient 2, no weight gradient (adapters 6)
            flops -= 2.0 * (matmul_weights - self.n_trainable)
        return flops

    def context(self, seq_len: int) -> dict:
        """Per-sequence-length constants shared by all units: positions, causal mask, rotary tables."""
        if seq_len not in self._ctx_cache:
            xp, dtype, cfg = self.backend.xp, self.backend.dtype, self.cfg
            cp = self.context_parallel  # seq_len is then this rank's tokens: its zig-zag chunks' positions
            positions = xp.arange(seq_len) if cp is None else xp.asarray(cp.positions(seq_len))
            ctx = {"xp": xp, "positions": positions, "bias": ops.causal_bias(seq_len, seq_len, xp, dtype)}
            if cfg.arch == "llama":
                ctx["cos"], ctx["sin"] = ops.rope_tables(positions, cfg.head_dim, cfg.rope_theta, xp,
                                                         rope_table_dtype(dtype))
            self._ctx_cache[seq_len] = ctx
        return self._ctx_cache[seq_len]

    def document_context(self, documents) -> dict:
        """What packed documents (mpitrain/data/documents.py: the whole rows' ids and positions, host arrays) change
        in one micro-batch's context: positions inside the documents for the embedding and RoPE, and attention
        kept inside each document: a (B, T, T) mask, or under cp the whole rows' ids and positions, from which ring
        attention builds each chunk pair's mask."""
        xp, dtype, cfg, cp = self.backend.xp, self.backend.dtype, self.cfg, self.context_parallel
        local = documents if cp is None else documents.take(cp.positions(documents.ids.shape[1] // cp.size))
        positions = xp.asarray(local.positions)
        ctx = {"positions": positions}
        if cp is None:
            ids = xp.asarray(local.ids)
            ctx["bias"] = document_bias(ids, positions, ids, positions, xp, dtype)
        else:
            ctx["documents"] = (xp.asarray(documents.ids), xp.asarray(documents.positions))
        if cfg.arch == "llama":
            ctx["cos"], ctx["sin"] = ops.rope_tables(positions, cfg.head_dim, cfg.rope_theta, xp,
                                                     rope_table_dtype(dtype))
        return ctx

    def saved_bytes(self, micro_batch: int, dtype) -> tuple[int, int]:
        """Bytes the saved state of one micro-batch holds on this rank, over all its chunks, by the layers' own
        declaration (`saved_arrays`), and the bytes shared by all micro-batches (the rotary tables of `context`)."""
        def total(arrays):
            return sum(math.prod(shape) * np.dtype(kind).itemsize for shape, kind in arrays)
        seq_len = self.cfg.seq_len // (self.context_parallel.size if self.context_parallel else 1)  # T/c under cp
        per_micro_batch = sum(total(self.units[i].saved_arrays(micro_batch, seq_len, dtype))
                              for chunk in self.chunks for i in chunk)
        rope = [((seq_len, self.cfg.head_dim // 2), rope_table_dtype(dtype))] * 2 if self.cfg.arch == "llama" else []
        if self.document_mask:  # the rotary tables are then each micro-batch's own: counted by _document_arrays
            return per_micro_batch + total(self._document_arrays(micro_batch, seq_len, dtype)), 0
        return per_micro_batch, total(rope)

    def _document_arrays(self, batch: int, seq_len: int, dtype) -> list:
        """What packed documents (data.document_mask) add to one micro-batch's kept state on this rank: the
        embedding's per-row positions (gpt2), the per-row rotary tables (llama), under ring cp the whole rows' ids
        and positions (ring attention's saved state), and where blocks recompute, the (B, T, T) mask in the context they
        keep (a recompute.Shared, which backend.nbytes_of does not open)."""
        units = [self.units[i] for chunk in self.chunks for i in chunk]
        blocks = [unit for unit in units if hasattr(unit, "recompute")]
        int64, arrays = np.dtype(np.int64), []
        if self.cfg.arch == "gpt2" and any(isinstance(unit, Embedding) for unit in units):
            arrays.append(((batch, seq_len), int64))
        if self.cfg.arch == "llama" and blocks:
            arrays += [((batch, seq_len, self.cfg.head_dim // 2), rope_table_dtype(dtype))] * 2
        ring = self.context_parallel is not None and self.context_parallel.kind in ("ring", "hybrid")  # not Ulysses
        if ring and any(block.recompute != "full" for block in blocks):  # selective keeps the ring's core too
            arrays += [((batch, self.cfg.seq_len), int64)] * 2
        if self.context_parallel is None and any(block.recompute != "none" for block in blocks):
            arrays.append(((batch, seq_len, seq_len), dtype))
        return arrays

    def _sequence_length(self, x) -> int:
        """Token ids are (batch, T); activations between units are (batch, T/t, C) under sequence parallelism."""
        if x.ndim == 2 or not self.tp.sequence_parallel:
            return x.shape[1]
        return x.shape[1] * self.tp.size

    # -- parameter access through the state
    def _params(self, state, unit: int, phase: str) -> dict:
        return self._views(unit, lambda j: state.acquire(j, phase))

    def _grads(self, state, unit: int) -> dict:
        if self.lora:  # frozen tensors' sublayers write into throw-away stand-ins
            xp, dtype = self.backend.xp, self.backend.dtype
            return self._views(unit, lambda j: with_frozen_sinks(state.grad_views(j), self.units[j].layout, xp, dtype))
        return self._views(unit, state.grad_views)

    def _views(self, unit: int, views_of) -> dict:
        """The unit's own views plus the tensors it borrows (tied weights), under their local names."""
        owners = {owner: views_of(owner) for owner, _ in self.borrowed[unit].values()}  # once per owner
        views = dict(views_of(unit))
        for local_name, (owner, tensor_name) in self.borrowed[unit].items():
            views[local_name] = owners[owner][tensor_name]
        return views

    def _release(self, state, unit: int, phase: str) -> None:
        for j in self.reads[unit]:
            if self.last_reader[phase][j] == unit:
                state.release(j, phase)

    def _done(self, state, unit: int) -> None:
        """The gradients of the units whose last backward reader is `unit` are complete for this micro-batch."""
        for j in self.reads[unit]:
            if self.last_reader["backward"][j] == unit:
                state.unit_done(j)

    # -- one micro-batch through one chunk
    def forward(self, state, x, targets=None, chunk: int = 0, loss_scale=None, documents=None):
        """x: token ids when the chunk starts with the embedding, else the previous stage's output. Returns
        (output, saved state per unit of the chunk): the sum of token losses when the chunk ends with the head
        (`targets` needed), else the activation for the next stage. documents: the micro-batch's packed documents
        (data.document_mask), on every stage."""
        ctx = self.context(self._sequence_length(x))
        if documents is not None:
            ctx = {**ctx, **self.document_context(documents)}
        if targets is not None:
            ctx = {**ctx, "targets": targets}  # read by the head
        if loss_scale is not None:  # training: MoE layers need the loss scale for their auxiliary losses' gradient
            ctx = {**ctx, "loss_scale": loss_scale, "aux_losses": self.aux_losses}
        saved = []
        for i in self.chunks[chunk]:
            unit = self.units[i]
            params = self._params(state, i, "forward")
            x, unit_saved = unit.forward(params, x, ctx)
            if self.observe is not None:
                self.observe(unit.layout.name, x)
            self._release(state, i, "forward")
            saved.append(unit_saved)
        return x, saved

    def backward(self, state, saved, dy, chunk: int = 0, deferred: dict | None = None):
        """dy: d(loss)/d(output), or the loss scale (1 / tokens of the global batch) when the chunk ends with the
        head. Returns d(loss)/d(input) (None when the chunk starts with the embedding). Each unit's saved state is
        freed as soon as it is used. With `deferred` (a dict, zb1p's B) the weight-gradient matmuls are left in it,
        per unit, for `backward_weight`, and the state is not told the gradients are done."""
        dx = dy
        units = self.chunks[chunk]
        for k in reversed(range(len(units))):
            i = units[k]
            work = None if deferred is None else deferred.setdefault(i, [])
            dx = self.units[i].backward(self._params(state, i, "backward"), self._grads(state, i), saved[k], dx, work)
            saved[k] = None
            if deferred is None:
                self._done(state, i)
            self._release(state, i, "backward")
        return dx

    def backward_weight(self, state, deferred: dict, chunk: int = 0) -> None:
        """zb1p's W: the weight-gradient matmuls a `backward(..., deferred=...)` of this chunk left, unit by unit."""
        for i in reversed(self.chunks[chunk]):
            self.units[i].backward_weight(self._grads(state, i), deferred.pop(i, []))
            self._done(state, i)

    def pop_aux_losses(self) -> dict:
        """The auxiliary losses the MoE layers of this rank added during the training micro-batches since the last
        call (mpitrain/layers/moe.py: "weighted" is their share of the loss sum), and forget them."""
        aux, self.aux_losses = self.aux_losses, {}
        return aux

    def update_routing_biases(self, state, loads: dict) -> None:
        """model.moe.balance = 'bias', after a step: each MoE block of this rank moves its routing bias (a frozen
        tensor, changed in place) by the step's `loads` ({block index: picks per expert over the dp ranks})."""
        moe = MoeSettings.of(self.cfg)
        for i, unit in enumerate(self.units):
            index = getattr(getattr(unit, "mlp", None), "index", None)
            if index in loads:
                update_routing_bias(state.acquire(i, "forward")["router_bias"], loads[index], moe.bias_rate)
                state.frozen_changed(i)  # ZeRO-3: the acquired bias is a gathered copy of the shards
                state.release(i, "forward")

    @property
    def moe_layers(self) -> int:
        """MoE blocks of the whole model, on every pipeline rank alike (the metrics average over them)."""
        moe = MoeSettings.of(self.cfg)
        return sum(moe.is_moe_block(i) for i in range(self.cfg.n_layer))

    def last_logits(self, state, tokens):
        """Logits of the last position (generation; a whole tp = 1 model, see Head.logits)."""
        ctx = self.context(tokens.shape[1])
        x, head = tokens, len(self.units) - 1
        for i, unit in enumerate(self.units):
            params = self._params(state, i, "forward")
            if i == head:
                x = unit.logits(params, x[:, -1:])[:, 0]
            else:
                x, _ = unit.forward(params, x, ctx)
            self._release(state, i, "forward")
        return x

    def decode(self, state, tokens, cache):
        """Logits (B, V) of the last of `tokens` (B, t): the t positions after the `cache.length` that `cache`
        (layers/kv_cache.KVCache) holds, whose keys and values are appended to it. t > 1 is a prefill. A whole
        tp = 1 model, as last_logits; the rotary tables are rows of the full window's, so positions match it."""
        past, t = cache.length, tokens.shape[1]
        if past + t > self.cfg.seq_len:
            raise ValueError(f"decode: {past} cached + {t} new positions exceed model.seq_len {self.cfg.seq_len}")
        window, rows = self.context(self.cfg.seq_len), slice(past, past + t)
        ctx = {"xp": window["xp"], "positions": window["positions"][rows]}
        if "cos" in window:
            ctx["cos"], ctx["sin"] = window["cos"][rows], window["sin"][rows]
        x, head = tokens, len(self.units) - 1
        for i, unit in enumerate(self.units):
            params = self._params(state, i, "forward")
            if i == 0:
                x, _ = unit.forward(params, x, ctx)
            elif i == head:
                x = unit.logits(params, x[:, -1:])[:, 0]
            else:
                x = unit.decode(params, x, ctx, cache.layers[i - 1])
            self._release(state, i, "forward")
        return x


def moe_note(cfg) -> str:
    """What `mpitrain memory` adds to its params row for MoE: experts per rank and active parameters per token."""
    moe, m = MoeSettings.of(cfg.model), cfg.model
    if not moe.experts:
        return ""
    total = GPT(m, make_backend("cpu", "float32")).n_params  # the whole model's count (layouts only, no arrays)
    return (f"; MoE: {moe.experts // cfg.parallel.ep} of {moe.experts} experts per MoE block on each rank, a token "
            f"uses {moe.top_k}: {total - inactive_params(m):,} active of {total:,} parameters")
