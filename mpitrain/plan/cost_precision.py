"""The planner's terms for overlapped tensor parallelism (parallel.tp_overlap) and FP8 GEMMs (precision.fp8): what
plan/cost.py's estimate changes in its matmul, elementwise, tp and cp parts when a layout turns them on.

Collective matmul (layers/tp_overlap.py). Under sequence parallelism each block runs, per micro-batch, 8 tp
collectives of one (b, T/cp, d) activation: the attention's and the MLP's gather before their column-parallel
linear and reduce-scatter after their row-parallel one, forward and backward (the forward's 4 again under full
recomputation, its 2 gathers again under selective: plain ones, no matmul to hide under). With the overlap each
runs as a ring of t - 1 steps under the chunked matmul of its own linear (the forward GEMM, or in backward the
input-gradient GEMM), and leaves `exposed_seconds` on the critical path: per
step, its latency and chunk bytes beyond one chunk's matmul. The chunked GEMMs have rows / t rows, so they run at
gemm_shape_factor(rows / t) instead of (rows): the matmul part grows by their FLOPs times the difference. A MoE
block's experts keep the plain gather and reduce-scatter (layers/moe.py enters the tp region unchunked), so only
its attention's four are overlapped.

FP8 (layers/fp8.py). The GEMMs of the attention projections (Q, K, V, O) and of the MLP or the routed experts run
on FP8 operands; the embedding, the head, the attention core and the router stay in the compute dtype. Those
GEMMs run at the cluster's `fp8_peak_flops` times the fraction of it the bf16 GEMMs reach of theirs
(matmul_efficiency and the shape curve), times FP8_ACHIEVED_RELATIVE: a model assumption, not a measurement (no
real FP8 GEMM has run here: docs/planning.md). A cluster without an FP8 peak (A100) refuses precision.fp8.
Quantization is elementwise HBM traffic, counted as the code quantizes (quantize_calls, tested
against the calls a run makes): a column-parallel linear quantizes its input once and its weights in the forward and
again in the backward, a row-parallel one its input and weight in both, every linear its output gradient once, full
recomputation the forward's operands again, selective recomputation the column-parallel inputs again at the amax
the forward kept (no all-reduce); each call reads its operand twice (the amax pass, then the cast) and
writes the dequantized values (float32, float64 under a float64 compute dtype: layers/fp8.py operand_dtype). Under
sequence parallelism the linears gather those dequantized operands (4 bytes an element under bf16, not fp8 codes:
gathering codes is not built), and a row linear with a bias (gpt2) gathers its output gradient again, unquantized,
for the bias gradient. The per-tensor recipes all-reduce the amaxes of each call over tp (float64, one per tensor of
the call), of inputs and output gradients over cp too; delayed scaling adds one all-reduce over dp x cp a step of
every operand's amax (delayed_amaxes). Memory: plan/memory.py's `fp8` row (layers/fp8.py fp8_extra_bytes) and the
dequantized inputs column-parallel linears save (fp8_saved_widening).
"""
from __future__ import annotations

from mpitrain.config import Config
from mpitrain.config_moe import MoeSettings
from mpitrain.errors import ConfigError
from mpitrain.layers.recompute import forward_runs
from mpitrain.layers.tp_overlap import exposed_seconds
from mpitrain.plan.clusters import Cluster, Link

# FP8 GEMMs reach this times the fraction of the FP8 peak that bf16 GEMMs reach of the bf16 peak (an assumption:
# 1 = the same fraction; docs/planning.md)
FP8_ACHIEVED_RELATIVE = 1.0
AMAX_BYTES = 8  # one float64 amax per tensor of a call on the wire (Fp8Gemms._tensor_amaxes)
# `mpitrain plan --fp8 any`: the first the config accepts. block and mxfp8 are never slower than the per-tensor
# recipes here (no amax all-reduce) nor larger (no scales or history kept); block first, its scale grid is coarser
FP8_RECIPES = ("block", "mxfp8", "delayed", "tensor")


def fp8_speedup(cluster: Cluster, recipe: str) -> float:
    """How many times faster an FP8 GEMM runs than the same GEMM in the compute dtype (1 for precision.fp8 =
    "none"); ConfigError naming the cluster where it has no FP8 peak."""
    if recipe == "none":
        return 1.0
    if cluster.fp8_peak_flops <= 0:
        raise ConfigError(f"precision.fp8 = {recipe!r}: cluster {cluster.name!r} has no FP8 tensor cores "
                          f"(fp8_peak_flops absent in {cluster.source}); plan it without FP8")
    return cluster.fp8_peak_flops * FP8_ACHIEVED_RELATIVE / cluster.peak_flops


def block_linears(m_cfg, moe_block: bool) -> list[tuple[str, int, int, int]]:
    """The FP8 linears of one block, whole (not split over tp): (name, K, N, picks per token); a MoE block's
    experts are counted once per pick (top_k), its attention once."""
    d, heads, kv = m_cfg.d_model, m_cfg.n_head * m_cfg.head_dim, m_cfg.kv_heads * m_cfg.head_dim
    ups = 2 if m_cfg.arch == "llama" else 1
    picks = MoeSettings.of(m_cfg).top_k if moe_block else 1
    return [("qkv", d, heads + 2 * kv, 1), ("out", heads, d, 1), ("up", d, ups * m_cfg.ff_dim, picks),
            ("down", m_cfg.ff_dim, d, picks)]


def block_kinds(m_cfg, layers: int) -> dict[bool, int]:
    """How many of the first `layers` blocks are dense (False) and MoE (True)."""
    settings = MoeSettings.of(m_cfg)  # parsed once: the search asks for every layout
    moe = sum(settings.is_moe_block(index) for index in range(layers)) if settings.experts else 0
    return {False: layers - moe, True: moe}


def fp8_flops_per_token(cfg: Config, recompute: str | None = None) -> tuple[float, float]:
    """(dense, expert) training FLOPs per token of the whole model that run as FP8 GEMMs: 6 per weight a token
    passes (4 for a frozen LoRA base: no weight gradient), 2 more per recomputed forward (memory.recompute = full,
    or `recompute`); the expert part apart, since the busiest ep rank runs it at its load."""
    m_cfg, recompute = cfg.model, recompute or cfg.memory.recompute
    per_weight = (4.0 if cfg.lora.rank > 0 else 6.0) + (2.0 if recompute == "full" else 0.0)
    dense = expert = 0.0
    for moe_block, blocks in block_kinds(m_cfg, m_cfg.n_layer).items():
        for name, k, n, picks in block_linears(m_cfg, moe_block):
            if moe_block and name in ("up", "down"):
                expert += per_weight * k * n * picks * blocks
            else:
                dense += per_weight * k * n * blocks
    return dense, expert


def fp8_matmul_saving(cfg: Config, cluster: Cluster, tokens_per_rank: float, speed: float, load: float = 1.0,
                      recipe: str | None = None, recompute: str | None = None) -> float:
    """Seconds the FP8 GEMMs save on one rank's step: their FLOPs (the experts' at the busiest ep rank's `load`)
    at `speed` (FLOP/s in the compute dtype), less the same at fp8_speedup times that. recipe, recompute: cfg's
    unless given (plan/cost.py's step_lower_bound asks for a layout's on the base config)."""
    speedup = fp8_speedup(cluster, recipe or cfg.precision.fp8)
    if speedup == 1.0:
        return 0.0
    dense, expert = fp8_flops_per_token(cfg, recompute)
    return (dense + load * expert) * tokens_per_rank / speed * (1 - 1 / speedup)


def bound_saving(base: Config, recipe: str, cluster: Cluster, tokens_per_rank: float, speed: float) -> float:
    """fp8_matmul_saving without recomputation, for plan/cost.py's step_lower_bound (0 where the cluster has no FP8:
    estimate refuses the layout there)."""
    if recipe == "none" or cluster.fp8_peak_flops <= 0:
        return 0.0
    return fp8_matmul_saving(base, cluster, tokens_per_rank, speed, 1.0, recipe, "none")


def operand_bytes(element_bytes: int) -> int:
    """Bytes an element of a dequantized FP8 operand takes: float32, float64 under precision.compute = float64
    (layers/fp8.py operand_dtype)."""
    return max(4, element_bytes)


def quantize_calls(cfg: Config, name: str, weights: int, expert: bool) -> list[tuple[str, int]]:
    """One FP8 linear's quantizations per micro-batch as layers/linear.py and layers/moe.py call Fp8Gemms: (operand
    x / w / dy, tensors in the call); `weights` weights share the input (Q/K/V 3, gate/up 2). Each call reduces its
    amaxes in one all-reduce over tp (x and dy over cp too) under the per-tensor recipes, except "x_kept": a
    column-parallel input quantized again at the amax its forward kept (memory.recompute = selective)."""
    if name in ("qkv", "up") and not expert:  # column-parallel: the input once (saved dequantized), W in both passes
        forward, backward = [("x", 1), ("w", weights)], [("w", weights), ("dy", weights)]
        if cfg.memory.recompute == "selective":  # layers/recompute.py restore
            backward = [("x_kept", 1)] + backward
    elif expert and name == "up":  # an expert's gate and up each quantize the shared input and their weight
        forward, backward = [("x", 1), ("w", 1)] * weights, [("x", 1), ("w", weights), ("dy", weights)]
    else:  # row-parallel, an expert's down: the input and weight again in the backward
        forward, backward = [("x", 1), ("w", 1)], [("x", 1), ("w", 1), ("dy", 1)]
    return forward * forward_runs(cfg.memory.recompute) + backward


def rank_linears(cfg: Config, layers: int):
    """(blocks, name, K, N, picks, weights sharing the input, copies on this rank, expert) of the FP8 linears of the
    first `layers` blocks: an expert linear once per expert of this ep rank."""
    m_cfg, moe = cfg.model, MoeSettings.of(cfg.model)
    for moe_block, blocks in block_kinds(m_cfg, layers).items():
        for name, k, n, picks in block_linears(m_cfg, moe_block):
            expert = moe_block and name in ("up", "down")
            weights = 3 if name == "qkv" else (2 if m_cfg.arch == "llama" else 1) if name == "up" else 1
            yield blocks, name, k, n, picks, weights, moe.experts // cfg.parallel.ep if expert else 1, expert


def quantized_bytes(cfg: Config, element_bytes: int, tokens_per_rank: float, layers: int,
                    micro_batches: int) -> float:
    """HBM bytes one rank's FP8 quantization moves per step (tokens_per_rank: the step's tokens through this rank's
    dp x cp share): each call of quantize_calls reads its operand twice (its amax or tile amaxes, then the cast) and
    writes the dequantized values at operand_bytes; weights every micro-batch, a frozen block / mxfp8 weight (LoRA's
    base, cached) never."""
    recipe, t = cfg.precision.fp8, cfg.parallel.tp
    if recipe == "none":
        return 0.0
    cached = cfg.lora.rank > 0 and recipe in ("block", "mxfp8")
    total = 0.0  # elements per step
    for blocks, name, k, n, picks, weights, copies, expert in rank_linears(cfg, layers):
        for operand, keys in quantize_calls(cfg, name, weights, expert):
            if operand in ("x", "x_kept"):  # an expert's calls share the tokens its picks send: copies cancel
                total += blocks * tokens_per_rank * picks * k / t
            elif operand == "dy":
                total += blocks * tokens_per_rank * picks * n * keys / weights / t
            elif not cached:
                total += blocks * copies * micro_batches * k * n * keys / weights / t
    return total * (2 * element_bytes + operand_bytes(element_bytes))


def amax_all_reduces(cfg: Config, layers: int) -> dict[str, tuple[int, int]]:
    """{"tp": (all-reduces, amaxes), "cp": (...)} of one rank per micro-batch under the per-tensor recipes: one per
    quantize_calls call over tp, the x and dy calls over cp too; zeros for block and mxfp8 (no reduction)."""
    counts = {"tp": [0, 0], "cp": [0, 0]}
    if cfg.precision.fp8 in ("tensor", "delayed"):
        for blocks, name, _, _, _, weights, copies, expert in rank_linears(cfg, layers):
            for operand, keys in quantize_calls(cfg, name, weights, expert):
                for group in {"x_kept": (), "w": ("tp",)}.get(operand, ("tp", "cp")):
                    counts[group][0] += blocks * copies
                    counts[group][1] += blocks * copies * keys
    return {group: (calls, keys) for group, (calls, keys) in counts.items()}


def delayed_amaxes(cfg: Config, layers: int) -> int:
    """Amaxes delayed scaling reduces over dp x cp at a step's end (fp8_delayed.end_delayed_step): one per operand
    key, each linear's input and each of its weights and their output gradients (per expert of this ep rank)."""
    return sum(blocks * copies * (1 + 2 * weights) for blocks, _, _, _, _, weights, copies, _ in
               rank_linears(cfg, layers))


def small_all_reduce(link: Link, nbytes: float, n: int, times: float = 1.0) -> float:
    """Seconds of `times` ring all-reduces of `nbytes` over n ranks (plan/cost.py's ring, all-reduce)."""
    return times * link.seconds(2 * (n - 1) / n * nbytes, 2 * (n - 1)) if n > 1 else 0.0


def tp_collectives(cfg: Config, element_bytes: int, moe_block: bool) -> list[tuple[str, float, bool]]:
    """One block's tp collectives per micro-batch: (the linear whose GEMM the overlap hides it under, bytes per
    element on the wire, overlapped). An FP8 linear gathers its dequantized input (forward) or output gradient
    (a row linear's backward) at operand_bytes; a row linear with a bias (gpt2) gathers its unquantized output
    gradient again for the bias gradient (layers/linear.py); a MoE block's MLP collectives are the plain ones.
    Selective recomputation under sequence parallelism gathers qkv's and the MLP's inputs again in backward, plainly
    (layers/recompute.py restore): qkv's and a dense up's quantized first (dequantized on the wire), the MoE's not."""
    fp8 = cfg.precision.fp8 != "none"
    overlap = cfg.parallel.tp_overlap
    gathered = operand_bytes(element_bytes) if fp8 else element_bytes
    forward = [("qkv", gathered, overlap), ("out", element_bytes, overlap)]
    forward += [("up", element_bytes, False), ("down", element_bytes, False)] if moe_block else \
        [("up", gathered, overlap), ("down", element_bytes, overlap)]
    backward = [(name, element_bytes if name in ("qkv", "up") or (moe_block and name == "down") else gathered, on)
                for name, _, on in forward]  # a row linear's output gradient is gathered, a column one's scattered
    if fp8 and cfg.model.arch == "gpt2":  # the bias gradient's gather, plain
        backward += [("out", element_bytes, False)] + ([] if moe_block else [("down", element_bytes, False)])
    if cfg.memory.recompute == "selective" and cfg.parallel.sequence_parallel:
        backward += [("qkv", gathered, False), ("up", element_bytes if moe_block else gathered, False)]
    return forward * forward_runs(cfg.memory.recompute) + backward


def tp_micro_seconds(cfg: Config, work, link: Link, speed: float, speedup: float = 1.0) -> float:
    """Exposed tp communication per micro-batch, collective by collective (tp_overlap.exposed_seconds): without the
    overlap and FP8, plan/cost.py's ring term. `speed`: FLOP/s of the chunked GEMMs in the compute dtype, FP8 ones
    `speedup` times faster; work: plan/cost.py's RankWork."""
    m_cfg, t = cfg.model, cfg.parallel.tp
    if t <= 1:
        return 0.0
    rows = work.rows
    elements = rows * m_cfg.d_model  # a micro-batch's (b, T/cp, d) activation, gathered whole
    gemm_speed = speed * speedup  # every overlapped linear is an FP8 linear when precision.fp8 is on
    total = 0.0
    for moe_block, blocks in block_kinds(m_cfg, work.layers).items():
        shapes = {name: (k, n) for name, k, n, _ in block_linears(m_cfg, moe_block)}
        for name, wire_bytes, overlapped in tp_collectives(cfg, work.element_bytes, moe_block):
            k, n = shapes[name]
            total += blocks * exposed_seconds(elements * wire_bytes, t, link.bandwidth * link.efficiency,
                                              2 * rows * k * n / t / gemm_speed, overlapped, link.latency)
    return total


def chunked_matmul_seconds(cfg: Config, work, speed: float, speedup: float, slowdown: float) -> float:
    """Seconds per micro-batch the overlap's chunked GEMMs add: the FLOPs of the linears whose collectives it hides
    (their forward and input-gradient GEMMs, the forward again under full recomputation) at `speed` x `speedup`,
    times slowdown - 1 (slowdown: the shape factor of rows over that of rows / tp)."""
    m_cfg, p = cfg.model, cfg.parallel
    if not p.tp_overlap or p.tp <= 1:
        return 0.0
    flops = 0.0
    for moe_block, blocks in block_kinds(m_cfg, work.layers).items():
        shapes = {name: (k, n) for name, k, n, _ in block_linears(m_cfg, moe_block)}
        for name, _, overlapped in tp_collectives(cfg, work.element_bytes, moe_block):
            k, n = shapes[name]
            flops += blocks * 2 * work.rows * k * n / p.tp * overlapped
    return flops / (speed * speedup) * (slowdown - 1)


def precision_terms(cfg: Config, cluster: Cluster, work, compute: dict, comm: dict, shapes: tuple, links: dict,
                    load: float) -> tuple[dict, dict, float]:
    """plan/cost.py's hook: (compute, comm, seconds per step) with parallel.tp_overlap and precision.fp8 costed.
    compute and comm: compute_seconds' and communication_seconds' dicts (new ones returned); shapes: gemm_shape_factor
    at the micro-batch's rows and at rows / tp; links: {"tp", "cp", "dp"}: each group's Link (dp: the dp x cp
    group); load: the busiest ep rank's expert load (1 without experts). The seconds per step: delayed scaling's
    amax all-reduce over dp x cp."""
    p, recipe, m = cfg.parallel, cfg.precision.fp8, work.micro_batches
    if not p.tp_overlap and recipe == "none":
        return compute, comm, 0.0
    speedup = fp8_speedup(cluster, recipe)
    speed = cluster.peak_flops * cluster.matmul_efficiency_at(work.rows) * shapes[0]
    matmul = compute["matmul"] - fp8_matmul_saving(cfg, cluster, work.tokens / work.world, speed, load) + \
        m * chunked_matmul_seconds(cfg, work, speed, speedup, shapes[0] / shapes[1])
    casts = quantized_bytes(cfg, work.element_bytes, work.tokens / (p.dp * p.cp), work.layers, m)
    elementwise = compute["elementwise"] + casts / cluster.hbm_bandwidth
    amax = amax_all_reduces(cfg, work.layers)  # per micro-batch: (all-reduces, amaxes) over tp and over cp

    def amax_seconds(group: str, n: int) -> float:
        calls, keys = amax[group]
        return small_all_reduce(links[group], AMAX_BYTES * keys / calls, n, calls) if calls else 0.0

    tp = tp_micro_seconds(cfg, work, links["tp"], speed, speedup) + amax_seconds("tp", p.tp)
    cp_ring = comm["cp_ring"] + amax_seconds("cp", p.cp)  # the token group
    delayed = small_all_reduce(links["dp"], AMAX_BYTES * delayed_amaxes(cfg, work.layers), p.dp * p.cp) \
        if recipe == "delayed" else 0.0
    compute = {**compute, "matmul": matmul, "elementwise": elementwise,
               "micro": (matmul + elementwise + compute["overhead"]) / m}
    return compute, {**comm, "tp": tp, "cp_ring": cp_ring}, delayed
