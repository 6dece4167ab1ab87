"""Per-rank memory of a layout, from formulas: what `mpitrain memory CONFIG` prints.

Model state (Psi = parameters this rank's pipeline stage and tensor-parallel slice hold, N = data-parallel size,
e = bytes per element of the compute dtype, o = optimizer bytes per parameter). float32/float64 parameters are their
own master copy and Adam's moments take their dtype (o = 2e); bfloat16/float16 compute keeps an fp32 master copy
beside the fp32 moments (o = 4 + 8 = 12). Master weights and moments are sharded from ZeRO-1 on:

    ZeRO-0  params e*Psi      grads e*Psi      optimizer o*Psi       bf16: 16 Psi     float32: 16 Psi
    ZeRO-1  params e*Psi      grads e*Psi      optimizer o*Psi/N     bf16: 4 + 12/N   float32: 8 + 8/N
    ZeRO-2  params e*Psi      grads e*Psi/N    optimizer o*Psi/N     bf16: 2 + 14/N   float32: 4 + 12/N
    ZeRO-3  params e*Psi/N    grads e*Psi/N    optimizer o*Psi/N     bf16: 16/N       float32: 16/N

(ZeRO-1 writes each reduced gradient shard over its own window of the full gradient, so it keeps no separate shard.)
These are the bytes of the arrays mpitrain/state/ allocates, padding aside (tests/test_zero.py and test_precision.py).

Activations are the bytes the saved state of one micro-batch holds (what `nbytes_of(saved)` counts), as each sublayer
declares it (`saved_arrays`), times the micro-batches in flight (1 without pipelining).

Under pipelining the stages differ: the first holds the embedding and the most micro-batches in flight (1F1B: p), the
last holds the final norm, the head (and, with tied embeddings, a copy of the embedding matrix) and saves the
head's (b, T, V/t) probabilities, but for fewer micro-batches (1F1B: 1). `pp_rank` picks the stage; the default 0
is the first, the rank `mpitrain memory` describes.

Attention (`attention`): "unfused" counts what the blocked numpy core and the cuBLAS core save, the probabilities
(b, h, T, T) of every block; "fused" counts what cuDNN's fused SDPA saves on a GPU in bf16/fp16, the output
(b, h, T, D) and each row's log-sum-exp (b, h, T) instead: no T x T term. Ring attention (parallel.cp > 1) saves
those already, so the two counts agree there.
"""
from __future__ import annotations

import copy
import functools
import math

import numpy as np

from mpitrain.backend import COMPUTE_DTYPES, make_backend
from mpitrain.comm.mesh import Degrees
from mpitrain.config import Config
from mpitrain.config_moe import MoeSettings
from mpitrain.layers.fp8 import fp8_extra_bytes
from mpitrain.layers.linear import ColumnParallelLinear
from mpitrain.layers.moe import MoE, rank_experts
from mpitrain.layers.recompute import apply_recompute
from mpitrain.layers.ring_attention import lse_dtype
from mpitrain.layers.tensor_parallel import TensorParallel
from mpitrain.model.gpt import GPT, moe_note
from mpitrain.optim.footprint import optimizer_row
from mpitrain.parallel.context import ContextParallel, apply_context_parallel
from mpitrain.parallel.pipeline import rank_stages
from mpitrain.parallel.schedule import make_schedule, placement_of
from mpitrain.plan.cost_sharding import node_shares
from mpitrain.state.frozen import split_frozen
from mpitrain.state.offload import offloaded_bytes

SHARDED = {"params": (3,), "grads": (2, 3), "optimizer": (1, 2, 3)}  # the ZeRO stages that split each kind
ATTENTION_PATHS = ("fused", "unfused")
FUSED_DTYPES = ("bfloat16", "float16")  # what cuDNN's fused SDPA takes


def default_attention(compute: str, on_gpu: bool) -> str:
    """The attention path a run takes: cuDNN's fused SDPA for bf16/fp16 on a GPU, else the unfused core."""
    return "fused" if on_gpu and compute in FUSED_DTYPES else "unfused"


def bytes_per_param(compute: str) -> dict:
    """Bytes per parameter of each kind of model state, before sharding."""
    e = np.dtype(COMPUTE_DTYPES[compute]).itemsize
    return {"params": e, "grads": e, "optimizer": 12 if e < 4 else 2 * e}


def model_state_bytes(n_params: int, compute: str, zero: int, dp: int) -> dict:
    """Bytes of parameters, gradients and optimizer state (master + moments) one rank keeps between steps (padding
    not counted)."""
    return {kind: n_params * each / (dp if zero in SHARDED[kind] else 1)
            for kind, each in bytes_per_param(compute).items()}


def state_formulas(compute: str, zero: int) -> dict:
    """The formula of each row, and the whole state's bytes per parameter (e.g. "4 + 12/N" for bf16 at ZeRO-1)."""
    each = bytes_per_param(compute)
    names = {"params": "e*Psi", "grads": "e*Psi", "optimizer": "12*Psi (fp32 master 4 + moments 8)"
             if each["optimizer"] == 12 else "2e*Psi (moments; the params are the master)"}
    formulas = {kind: name.replace("Psi", "Psi/N", 1) if zero in SHARDED[kind] else name
                for kind, name in names.items()}
    whole = sum(v for k, v in each.items() if zero not in SHARDED[k])
    split = sum(v for k, v in each.items() if zero in SHARDED[k])
    formulas["state"] = " + ".join(([str(whole)] if whole else []) + ([f"{split}/N"] if split else [])) + \
        " bytes per parameter"
    return formulas


def activation_bytes(cfg: Config, micro_batch: int | None = None, pp_rank: int = 0, attention: str = "unfused") -> int:
    """Saved-state bytes of one micro-batch's forward on one rank (tp rank 0 of pipeline stage `pp_rank`): the arrays
    each sublayer declares that it saves (`saved_arrays` in mpitrain/layers, the declaration the layers are tested
    against), plus the rotary tables shared by all micro-batches; with a pipeline, times the micro-batches the stage
    holds at once (1F1B: p - pp_rank; GPipe: m). zb1p's backward_input hands a micro-batch's saved state over to its
    deferred weight-gradient work (each matmul's input and output gradient) until backward_weight: the peak is the
    schedule's worst mix of the two. attention: "fused" or "unfused" (module docstring)."""
    p = cfg.parallel
    b = micro_batch or cfg.train.micro_batch
    per_micro_batch, shared = saved_bytes_per_micro_batch(cfg, b, pp_rank)
    per_micro_batch += fp8_saved_widening(cfg, b, pp_rank)  # precision.fp8: dequantized inputs saved wider
    if attention == "fused":
        per_micro_batch -= fused_attention_saving(cfg, b, pp_rank)
    if p.pp == 1:
        return per_micro_batch + shared
    micro_batches = cfg.train.global_batch // (p.dp * b)
    deferred = deferred_bytes_per_micro_batch(cfg, b, pp_rank) if p.schedule in ("zb1p", "zbv", "dualpipev") else 0
    holdings = _stage_holdings(p.schedule, p.pp, micro_batches, p.virtual_stages)[pp_rank]
    peak = max(per_micro_batch * saved + deferred * waiting for saved, waiting in holdings)
    return int(peak / p.virtual_stages + shared)


def fp8_saved_widening(cfg: Config, micro_batch: int, pp_rank: int = 0) -> int:
    """precision.fp8: the bytes one micro-batch's saved state grows by because a column-parallel linear (qkv, a dense
    MLP's up) saves the dequantized input it gathered, float32 (layers/fp8.py operand_dtype) where the compute dtype
    is narrower; in blocks that keep their saved state (selective and full recomputation enter the input again in
    the block's backward, out of the kept state), and not where LoRA adapters make the linear save its unquantized
    input (layers/linear.py)."""
    itemsize = np.dtype(COMPUTE_DTYPES[cfg.precision.compute]).itemsize
    if cfg.precision.fp8 == "none" or itemsize >= 4:
        return 0
    model = rank_model(cfg, pp_rank)
    seq_len = cfg.model.seq_len // cfg.parallel.cp  # as GPT.saved_bytes declares
    elements = 0
    for unit in (model.units[i] for chunk in model.chunks for i in chunk):
        if getattr(unit, "recompute", None) != "none":  # not a block, or a recomputed one
            continue
        for linear in (unit.attention.qkv, getattr(unit.mlp, "up", None)):  # MoE: its experts quantize routed rows
            if isinstance(linear, ColumnParallelLinear) and not linear.adapters:
                elements += sum(math.prod(shape) for shape, _ in linear.saved_arrays(micro_batch, seq_len, None))
    return elements * (4 - itemsize)


SHARED_INPUTS = ({"wq", "wk", "wv"}, {"w_fc", "w_gate", "w_up"}, {"expert_w_gate", "expert_w_up"})


def deferred_bytes_per_micro_batch(cfg: Config, micro_batch: int, pp_rank: int = 0) -> int:
    """The weight-gradient work zb1p defers per micro-batch on pipeline rank pp_rank: each matmul weight's output
    gradient and its input (one input for weights that read the same one: q/k/v, gate/up) over b * T/cp rows; the
    head reads the tied embedding transposed. The embedding's lookup table defers nothing, nor does a MoE layer
    (layers/moe.py takes its router's and experts' weight gradients in B). Under precision.fp8 the FP8 linears'
    items hold their dequantized x and dy (layers/linear.py), float32 (layers/fp8.py operand_dtype); the head and
    LoRA's adapters hold the compute dtype."""
    rows = micro_batch * cfg.model.seq_len // cfg.parallel.cp
    itemsize = np.dtype(COMPUTE_DTYPES[cfg.precision.compute]).itemsize
    plain, fp8 = _deferred_per_row(cfg, pp_rank)
    return int(rows * (plain * itemsize + fp8 * max(4, itemsize)))


def _deferred_per_row(cfg: Config, pp_rank: int) -> tuple[float, float]:
    """Elements of deferred work per row of a micro-batch (deferred_bytes_per_micro_batch): (in the compute dtype,
    in the FP8 linears' operand dtype), cached by shape and whether precision.fp8 is on."""
    fp8_on = cfg.precision.fp8 != "none"
    key = (shape_key(cfg, pp_rank), fp8_on)
    if key in _DEFERRED:
        return _DEFERRED[key]
    model = rank_model(cfg, pp_rank)
    elements = {False: 0.0, True: 0.0}  # widened by FP8 or not
    for unit in model.units:
        name = unit.layout.name
        if name == "embed":
            continue
        weights = [spec for spec in unit.layout.specs if len(spec.shape) >= 2 and spec.trainable]
        if name == "head":  # (d, V/t) of its own, or the embedding's (V/t, d) borrowed
            tables = [spec.shape for layout in model.layouts for spec in layout.specs if spec.name == "wte"]
            vocab = next((math.prod(spec.shape) for spec in weights), None) or math.prod(tables[0])
            elements[False] += cfg.model.d_model + vocab // cfg.model.d_model
            continue
        fp8_weights = _fp8_weights(unit) if fp8_on else set()
        moe = getattr(unit, "mlp", None)
        moe_weights = {spec.name for spec in moe.specs} if isinstance(moe, MoE) else set()
        read = set()
        for spec in weights:
            if spec.name in moe_weights:
                continue
            n_in, n_out = spec.shape[-2:]
            group = next((frozenset(g) for g in SHARED_INPUTS if spec.name in g), spec.name)
            elements[spec.name in fp8_weights] += n_out + (n_in if group not in read else 0)
            read.add(group)
    _DEFERRED[key] = (elements[False], elements[True])
    return _DEFERRED[key]


def _fp8_weights(block) -> set:
    """The weights of a block's FP8 linears (layers/fp8.py apply_fp8): the attention's qkv and out, a dense MLP's up
    and down."""
    linears = [block.attention.qkv, block.attention.out]
    if not isinstance(block.mlp, MoE):
        linears += [block.mlp.up, block.mlp.down]
    return {name for linear in linears for name in getattr(linear, "weights", [getattr(linear, "weight", None)])}


def saved_bytes_per_micro_batch(cfg: Config, micro_batch: int, pp_rank: int = 0) -> tuple[int, int]:
    """rank_model(cfg, pp_rank).saved_bytes(micro_batch, compute dtype), cached by shape."""
    key = (shape_key(cfg, pp_rank), micro_batch)
    if key not in _SAVED:
        dtype = np.dtype(COMPUTE_DTYPES[cfg.precision.compute])
        _SAVED[key] = rank_model(cfg, pp_rank).saved_bytes(micro_batch, dtype)
    return _SAVED[key]


def fused_attention_saving(cfg: Config, micro_batch: int, pp_rank: int = 0) -> int:
    """Bytes of one micro-batch's saved state that the fused attention does not keep on pipeline rank pp_rank: each
    block that keeps its attention's saved state (memory.recompute none there) holds the output (b, h, T, D) and
    the log-sum-exp (b, h, T) instead of the probabilities (b, h, T, T); h: this tp rank's query heads. Nothing under
    ring attention (parallel.cp > 1), which already keeps only those."""
    if cfg.parallel.cp > 1:
        return 0
    dtype = np.dtype(COMPUTE_DTYPES[cfg.precision.compute])
    b, t = micro_batch, cfg.model.seq_len
    saving = 0
    for unit in rank_model(cfg, pp_rank).units:
        attention = getattr(unit, "attention", None)
        if attention is None or unit.recompute != "none":
            continue
        rows = b * attention.heads * t
        saving += rows * t * dtype.itemsize - rows * (attention.head_dim * dtype.itemsize + lse_dtype(dtype).itemsize)
    return saving


@functools.lru_cache(maxsize=512)  # mpitrain plan asks for the same schedules thousands of times
def _stage_holdings(kind: str, pp: int, micro_batches: int, virtual_stages: int) -> tuple:
    """Per pipeline rank, the (saved, deferred) counts of (micro-batch, chunk) pairs it holds after each of its
    instructions: forwards whose backward has not run, and (zb1p) backward_inputs whose backward_weight has not.
    Beyond 2p micro-batches only GPipe's counts still grow (the others stop at their warm-up depth), so the schedule
    is built with at most 2p (a multiple of p, as interleaved needs)."""
    if kind != "gpipe":
        micro_batches = min(micro_batches, 2 * pp)
    return tuple(holdings(program) for program in make_schedule(kind, pp, micro_batches, virtual_stages))


def holdings(program) -> tuple:
    """The distinct (saved, deferred) counts one rank's program passes through (_stage_holdings)."""
    change = {"forward": (1, 0), "backward": (-1, 0), "backward_input": (-1, 1), "backward_weight": (0, -1)}
    saved = deferred = 0
    points = set()
    for ins in program:
        more_saved, more_deferred = change.get(ins.op, (0, 0))
        saved, deferred = saved + more_saved, deferred + more_deferred
        points.add((saved, deferred))
    return tuple(sorted(points))


_RANK_MODELS: dict = {}  # shape key -> model: mpitrain plan evaluates thousands of layouts of a few shapes
_SAVED: dict = {}  # (shape key, micro-batch) -> saved_bytes
_PARAMS: dict = {}  # shape key -> rank_param_count
_SPLIT: dict = {}  # shape key -> split_frozen of the layouts
_DEFERRED: dict = {}  # (shape key, fp8 on) -> zb1p's deferred elements per row (compute dtype, fp8 operands)
_SHARES: dict = {}  # shape key -> (dense, expert) trainable parameters: a walk over every spec, once per shape


def shape_key(cfg: Config, pp_rank: int = 0) -> str:
    p, m = cfg.parallel, cfg.memory
    return repr((cfg.model, cfg.lora, cfg.precision.compute, p.tp, p.sequence_parallel, p.pp, p.virtual_stages,
                 placement_of(p.schedule),
                 p.stage_layers, p.cp, p.cp_kind, p.ep, p.etp, m.recompute, m.recompute_layers, cfg.data.document_mask,
                 pp_rank))


def rank_model(cfg: Config, pp_rank: int = 0):
    """The model of tp rank 0 and pipeline rank `pp_rank`, built without a group: only its shapes are used (and
    cached by them: callers only read it)."""
    key = shape_key(cfg, pp_rank)
    if key not in _RANK_MODELS:
        if len(_RANK_MODELS) > 1024:  # a 405B search on 1,024 GPUs builds ~255
            for cache in (_RANK_MODELS, _SAVED, _PARAMS, _SPLIT, _DEFERRED, _SHARES):
                cache.clear()
        _RANK_MODELS[key] = _build_rank_model(cfg, pp_rank)
    return _RANK_MODELS[key]


def _build_rank_model(cfg: Config, pp_rank: int):
    """The rank model; under recomputation, the one without (built or cached) with its blocks copied and their mode
    set: apply_recompute only sets each block's `recompute`, and building every block's layout is the costly part."""
    if cfg.memory.recompute != "none":
        plain_cfg = copy.copy(cfg)
        plain_cfg.memory = copy.copy(cfg.memory)
        plain_cfg.memory.recompute, plain_cfg.memory.recompute_layers = "none", 0
        plain = rank_model(plain_cfg, pp_rank)
        model = copy.copy(plain)
        model.units = [copy.copy(unit) for unit in plain.units]
        model._ctx_cache = {}
        apply_recompute(model, cfg.memory.recompute, cfg.memory.recompute_layers)
        return model
    return _build_plain_rank_model(cfg, pp_rank)


def _build_plain_rank_model(cfg: Config, pp_rank: int):
    p = cfg.parallel
    tp = TensorParallel(None, p.sequence_parallel)
    tp.size = p.tp  # a layout without a group: only the shapes of rank 0's pieces are needed
    stages = rank_stages(cfg.model.n_layer, p.pp, p.virtual_stages, pp_rank, p.stage_layers, placement_of(p.schedule))
    model = GPT(cfg.model, _shape_backend(cfg.precision.compute), tp=tp, stages=stages, lora=cfg.lora,
                ep=rank_experts(cfg))  # model.moe: ep rank 0's share of the experts
    apply_recompute(model, cfg.memory.recompute, cfg.memory.recompute_layers)
    apply_context_parallel(model, ContextParallel(None, size=p.cp, kind=p.cp_kind))  # activations of T/cp tokens
    model.document_mask = cfg.data.document_mask  # packed documents' per-row positions, tables and masks
    return model


@functools.lru_cache(maxsize=8)  # make_backend asks ldconfig for libc each time: a process per call
def _shape_backend(compute: str):
    return make_backend("cpu", compute)


def split_rank_layouts(cfg: Config, pp_rank: int = 0):
    """split_frozen of the rank model's layouts (trainable, frozen), cached by shape like the model."""
    key = shape_key(cfg, pp_rank)
    if key not in _SPLIT:
        _SPLIT[key] = split_frozen(rank_model(cfg, pp_rank).layouts)
    return _SPLIT[key]


def rank_param_count(cfg: Config, pp_rank: int = 0) -> int:
    """Parameters one rank holds: tp rank 0's pieces (vocabulary padding included) of pipeline rank pp_rank's units
    (tied copies included)."""
    key = shape_key(cfg, pp_rank)
    if key not in _PARAMS:
        _PARAMS[key] = sum(layout.size for layout in rank_model(cfg, pp_rank).layouts)
    return _PARAMS[key]


def reduction_shares(cfg: Config, pp_rank: int = 0) -> list[tuple[int, int]]:
    """[(trainable parameters of this rank, the ranks that reduce their gradients and ZeRO-shard them)]: dp x cp (cp
    ranks hold the same parameters); experts on their own mesh (ep > 1 or etp != tp) over expert_dp, the
    tp * cp * dp / (etp * ep) ranks that hold the same expert pieces (state/zero.py split_by_reduction). Frozen
    tensors (LoRA's base) are neither reduced nor sharded."""
    p, key = cfg.parallel, shape_key(cfg, pp_rank)
    if key not in _SHARES:
        trainable, _ = split_rank_layouts(cfg, pp_rank)
        experts = sum(spec.size for layout in trainable for spec in layout.specs if spec.reduce_over == "expert_dp")
        _SHARES[key] = (sum(spec.size for layout in trainable for spec in layout.specs) - experts, experts)
    dense, experts = _SHARES[key]
    return [(dense, p.dp * p.cp)] + ([(experts, expert_degrees(cfg).expert_dp)] if experts else [])


def expert_degrees(cfg: Config) -> Degrees:
    p = cfg.parallel
    return Degrees(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp)


_MOE_NOTES: dict = {}  # (model, ep) -> moe_note: it builds the whole model to count its parameters


def _moe_note(cfg: Config) -> str:
    """moe_note(cfg), once per model shape and ep (mpitrain plan asks thousands of times)."""
    key = (repr(cfg.model), cfg.parallel.ep)
    if key not in _MOE_NOTES:
        _MOE_NOTES[key] = moe_note(cfg)
    return _MOE_NOTES[key]


def expert_mesh_note(cfg: Config) -> str:
    """model.moe: the two meshes of a pipeline stage, attention tp x cp x dp and experts etp x ep x edp."""
    if not MoeSettings.of(cfg.model).experts:
        return ""
    return f"; meshes per stage: {expert_degrees(cfg).describe_meshes()}"


def memory_report(cfg: Config, n_params: int, pp_rank: int = 0, attention: str = "unfused",
                  gpus_per_node: int = 0) -> dict:
    """The per-rank numbers and formulas for cfg's layout (cfg already resolved for a world size), on pipeline rank
    pp_rank (n_params: rank_param_count(cfg, pp_rank)); attention: "fused" or "unfused" (module docstring);
    gpus_per_node: where parallel.zero_shard = "node" shards ZeRO over one node's ranks (0: one node holds all)."""
    p = cfg.parallel
    itemsize = np.dtype(COMPUTE_DTYPES[cfg.precision.compute]).itemsize
    trainable, frozen_layouts = split_rank_layouts(cfg, pp_rank)
    frozen = sum(layout.size for layout in frozen_layouts or [])  # lora: the base
    state: dict = {}
    shares = node_shares(cfg, reduction_shares(cfg, pp_rank), gpus_per_node)  # zero_shard = node: a node's ranks
    for count, ranks in shares:  # ZeRO shards over the ranks that reduce the gradients
        for kind, value in model_state_bytes(count, cfg.precision.compute, p.zero, ranks).items():
            state[kind] = state.get(kind, 0) + value
    # no gradient, no optimizer state; whole on every rank, or sharded like the parameters at ZeRO-3
    state["params"] += frozen * itemsize / (shares[0][1] if p.zero == 3 else 1)
    activations = activation_bytes(cfg, pp_rank=pp_rank, attention=attention)
    formulas = state_formulas(cfg.precision.compute, p.zero)
    if frozen:
        formulas["params"] += f" + e*{frozen:,} frozen (LoRA: Psi counts only the {n_params - frozen:,} adapters)"
        formulas["state"] = formulas["state"].replace("per parameter", f"per adapter parameter, {itemsize} per frozen")
    lean = optimizer_row(cfg, trainable)  # optim.name = adafactor | adam8bit | sgd
    if lean:
        state["optimizer"], formulas["optimizer"] = lean
        formulas["state"] = "params + grads + optimizer rows"
    replicas = cfg.train.thread_replicas  # > 1: each thread replica but the first adds into its own gradients
    if replicas > 1:
        state["grads"] += (replicas - 1) * sum(layout.size for layout in trainable) * itemsize
        formulas["grads"] += f" + {replicas - 1} x e*Psi (train.thread_replicas = {replicas}: replicas' own)"
        formulas["state"] += f" + {replicas - 1} x e (thread replicas' gradients)"
    stage = "the first" if pp_rank == 0 else "the last" if pp_rank == p.pp - 1 else f"pipeline rank {pp_rank}'s"
    in_flight = "one micro-batch" if p.pp == 1 else f"{stage} stage's micro-batches in flight under {p.schedule}"
    formulas["activations"] = f"saved state of {in_flight} (mpitrain/plan/memory.py)"
    if fp8_saved_widening(cfg, cfg.train.micro_batch, pp_rank):
        formulas["activations"] += f", precision.fp8 = {cfg.precision.fp8!r}: qkv / up inputs saved as float32"
    formulas["params"] += _moe_note(cfg) + expert_mesh_note(cfg)  # model.moe: experts held here, both meshes
    if p.cp > 1:
        formulas["activations"] += f", {cfg.model.seq_len // p.cp} of {cfg.model.seq_len} tokens (parallel.cp)"
    elif attention == "fused":
        formulas["activations"] += ", fused attention (output and log-sum-exp, no T x T probabilities)"
    if cfg.memory.recompute != "none":  # the blocks' declaration already follows the mode
        blocks = f"first {cfg.memory.recompute_layers} blocks" if cfg.memory.recompute_layers else "all blocks"
        formulas["activations"] += f", memory.recompute = {cfg.memory.recompute} ({blocks} of each stage)"
    rows = {**state, "state": sum(state.values()), "activations": activations}  # "state": the subtotal
    moved, where = offloaded_bytes(cfg.memory, cfg.train.device, state["optimizer"])
    if moved:  # memory.offload: the optimizer row stays listed, but leaves the device's subtotal
        rows["state"] -= moved
        rows["offloaded"], formulas["offloaded"] = moved, where
        formulas["state"] += ", less the offloaded row"
    fp8 = fp8_extra_bytes(cfg)  # precision.fp8: its scales, amax history, a frozen base's cached weights
    if any(fp8.values()):
        rows["fp8"] = sum(fp8.values())
        formulas["fp8"] = f"precision.fp8 = {cfg.precision.fp8!r}: " + ", ".join(
            f"{kind.replace('_', ' ')} {value:,} B" for kind, value in fp8.items())
    return {"psi": n_params, "N": p.dp * p.cp, "e": itemsize, "zero": p.zero, "bytes": rows, "formulas": formulas,
            "total": rows["state"] + activations + rows.get("fp8", 0)}
