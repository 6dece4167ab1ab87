"""Per-rank memory of a layout, from formulas: what `mpitrain memory CONFIG` prints.

Model state (Psi = parameters this rank's pipeline stage and tensor-parallel slice hold, N = data-parallel size,
e = bytes per element of the compute dtype). On CPU the float32/float64 parameters are their own master copy, and
the Adam moments are kept in the same dtype, so:

    ZeRO-0  params e*Psi      grads e*Psi               moments 2e*Psi        (16 Psi bytes at float32)
    ZeRO-1  params e*Psi      grads e*Psi + e*Psi/N     moments 2e*Psi/N      (the shard of reduced gradients)
    ZeRO-2  params e*Psi      grads e*Psi/N             moments 2e*Psi/N
    ZeRO-3  params e*Psi/N    grads e*Psi/N             moments 2e*Psi/N      (16 Psi / N at float32)

With mixed precision (bf16/fp16 compute on GPUs, a later issue) a separate fp32 master copy joins the moments:
2 + 2 + 12 bytes per parameter, and ZeRO-1 shards the 12 (12 Psi / N), as in the ZeRO paper.

Activations are the bytes the saved state of one micro-batch holds (exactly what `nbytes_of(saved)` counts for the
units as written in mpitrain/model/units.py), times the micro-batches in flight (1 without pipelining).
"""
from __future__ import annotations

import numpy as np

from mpitrain.config import Config

STAGE_FORMULAS = {
    0: ("e*Psi", "e*Psi", "2e*Psi"),
    1: ("e*Psi", "e*Psi + e*Psi/N", "2e*Psi/N"),
    2: ("e*Psi", "e*Psi/N", "2e*Psi/N"),
    3: ("e*Psi/N", "e*Psi/N", "2e*Psi/N"),
}


def model_state_bytes(n_params: int, itemsize: int, zero: int, dp: int) -> dict:
    """Bytes of parameters, gradients and optimizer moments one rank keeps between steps (padding not counted)."""
    psi, e, n = n_params, itemsize, dp
    params = e * psi / n if zero == 3 else e * psi
    grads = {0: e * psi, 1: e * psi + e * psi / n, 2: e * psi / n, 3: e * psi / n}[zero]
    moments = 2 * e * psi / n if zero else 2 * e * psi
    return {"params": params, "grads": grads, "optimizer": moments}


def activation_bytes(cfg: Config, micro_batch: int | None = None) -> int:
    """Saved-state bytes of one micro-batch's forward on one rank, counted array by array as units.py saves them
    (exact at tp = 1, where a test compares it with the saved state; under tensor parallelism the split tensors are
    divided by t, and with sequence parallelism the norms too, while the inputs of column-parallel linears are kept
    whole)."""
    m, p = cfg.model, cfg.parallel
    b, t, c, e = micro_batch or cfg.train.micro_batch, m.seq_len, m.d_model, np.dtype(cfg.precision.compute).itemsize
    tp, bt, f = p.tp, b * t, m.ff_dim
    norm_share = tp if p.sequence_parallel else 1  # the norm regions hold 1/t of the sequence under SP
    kv_heads = m.kv_heads // tp if m.kv_heads % tp == 0 else 1  # split, or the one shared head a rank needs
    per_block = (
        2 * (bt * c + bt) // norm_share  # norms 1 and 2: normalised input, 1/std
        + 2 * bt * c  # their outputs, the column-parallel projections' inputs (whole)
        + bt * (c // tp + 2 * kv_heads * m.head_dim)  # q, k, v of this rank's heads
        + b * (m.n_head // tp) * t * t  # attention probabilities
        + bt * c // tp  # attention output, the output projection's input
        + bt * (f // tp) * (1 if m.arch == "gpt2" else 2)  # MLP up (gpt2) or gate and up (llama)
        + bt * f // tp  # activation output, the down projection's input
    )
    vocab = -(-m.vocab_size // tp)
    head = (bt * c + bt) // norm_share + bt * c + bt * vocab  # final norm, its output, softmax probabilities
    rope = t * m.head_dim if m.arch == "llama" else 0  # cos and sin tables, shared by all blocks
    if p.pp == 1:
        return int(e * (m.n_layer * per_block + head + rope) + 2 * bt * 8)  # + int64 token ids and targets
    # with a pipeline: the first stage, which holds the most micro-batches at once (1F1B: p; GPipe: m)
    from mpitrain.parallel.pipeline import rank_stages
    from mpitrain.parallel.schedule import make_schedule, peak_activations
    chunks = rank_stages(m.n_layer, p.pp, p.virtual_stages, 0, p.stage_layers)
    blocks = sum(min(end, m.n_layer + 1) - max(first, 1) for first, end in chunks)
    has_head = any(end == m.n_layer + 2 for _, end in chunks)
    per_micro_batch = e * (blocks * per_block + has_head * head) + bt * 8 * (1 + has_head)
    micro_batches = cfg.train.global_batch // (p.dp * b)
    in_flight = peak_activations(make_schedule(p.schedule, p.pp, micro_batches, p.virtual_stages))[0]
    return int(per_micro_batch * in_flight / p.virtual_stages + e * rope)


def rank_param_count(cfg: Config) -> int:
    """Parameters one rank holds: tp rank 0's pieces (vocabulary padding included) of pipeline rank 0's units."""
    from mpitrain.backend import make_backend
    from mpitrain.layers.tensor_parallel import TensorParallel
    from mpitrain.model.gpt import GPT
    from mpitrain.parallel.pipeline import rank_stages
    p = cfg.parallel
    tp = TensorParallel(None, p.sequence_parallel)
    tp.size = p.tp  # a layout without a group: only the shapes of rank 0's pieces are needed
    stages = rank_stages(cfg.model.n_layer, p.pp, p.virtual_stages, 0, p.stage_layers)
    model = GPT(cfg.model, make_backend("cpu", cfg.precision.compute), tp=tp, stages=stages)
    return sum(layout.size for layout in model.layouts)


def memory_report(cfg: Config, n_params: int) -> dict:
    """The per-rank numbers and formulas for cfg's layout (cfg already resolved for a world size)."""
    p = cfg.parallel
    itemsize = np.dtype(cfg.precision.compute).itemsize
    state = model_state_bytes(n_params, itemsize, p.zero, p.dp)
    activations = activation_bytes(cfg)
    formulas = dict(zip(("params", "grads", "optimizer"), STAGE_FORMULAS[p.zero]))
    in_flight = "one micro-batch" if p.pp == 1 else f"the first stage's micro-batches in flight under {p.schedule}"
    formulas["activations"] = f"saved state of {in_flight} (mpitrain/plan/memory.py)"
    rows = {**state, "activations": activations}
    return {"psi": n_params, "N": p.dp, "e": itemsize, "zero": p.zero, "bytes": rows, "formulas": formulas,
            "total": sum(rows.values())}
