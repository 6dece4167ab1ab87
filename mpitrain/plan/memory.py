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

Activations are the bytes the saved state of one micro-batch holds (what `nbytes_of(saved)` counts), as each sublayer
declares it (`saved_arrays`), times the micro-batches in flight (1 without pipelining).
"""
from __future__ import annotations

import numpy as np

from mpitrain.backend import COMPUTE_DTYPES
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
    """Saved-state bytes of one micro-batch's forward on one rank (tp rank 0 of the first pipeline stage): the arrays
    each sublayer declares that it saves (`saved_arrays` in mpitrain/layers, the declaration the layers are tested
    against), plus the rotary tables shared by all micro-batches; with a pipeline, times the micro-batches the first
    stage holds at once (1F1B: p; GPipe: m), which is the most of any stage."""
    p = cfg.parallel
    b = micro_batch or cfg.train.micro_batch
    per_micro_batch, shared = rank_model(cfg).saved_bytes(b, np.dtype(COMPUTE_DTYPES[cfg.precision.compute]))
    if p.pp == 1:
        return per_micro_batch + shared
    from mpitrain.parallel.schedule import make_schedule, peak_activations
    micro_batches = cfg.train.global_batch // (p.dp * b)
    in_flight = peak_activations(make_schedule(p.schedule, p.pp, micro_batches, p.virtual_stages))[0]
    return int(per_micro_batch * in_flight / p.virtual_stages + shared)


def rank_model(cfg: Config):
    """The model of tp rank 0 and pipeline rank 0, built without a group: only its shapes are used."""
    from mpitrain.backend import make_backend
    from mpitrain.layers.tensor_parallel import TensorParallel
    from mpitrain.model.gpt import GPT
    from mpitrain.parallel.pipeline import rank_stages
    p = cfg.parallel
    tp = TensorParallel(None, p.sequence_parallel)
    tp.size = p.tp  # a layout without a group: only the shapes of rank 0's pieces are needed
    stages = rank_stages(cfg.model.n_layer, p.pp, p.virtual_stages, 0, p.stage_layers)
    return GPT(cfg.model, make_backend("cpu", cfg.precision.compute), tp=tp, stages=stages)


def rank_param_count(cfg: Config) -> int:
    """Parameters one rank holds: tp rank 0's pieces (vocabulary padding included) of pipeline rank 0's units."""
    return sum(layout.size for layout in rank_model(cfg).layouts)


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
