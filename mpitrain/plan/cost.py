"""The step-time and memory model of one layout on one cluster: what `mpitrain plan` ranks layouts by.

Memory is mpitrain/plan/memory.py's per-rank report (the arrays the state and the saved activations hold) plus the
transient buffers it leaves out: gradient buckets in flight, and under ZeRO-3 the gathered units (this one and the
prefetched next).

Time of one step on the slowest rank (the first pipeline stage):

    t_micro = matmul FLOPs / (peak * efficiency(shape)) + elementwise bytes / HBM bandwidth
              + unit_overhead_s * units on the rank (fixed cost per unit: launches, Python)
              + tp collectives + cp ring (beyond the attention it hides behind) or Ulysses all-to-alls + MoE all-to-all
              + ZeRO-3 gathers beyond the compute they hide behind + pipeline sends
    t_step  = m * t_micro * (1 + bubble / (1 - bubble) / contention) + exposed gradient reduction + ZeRO-1/2 parameter
              all-gather + optimizer (passes over its state at optimizer_bandwidth; over PCIe when offloaded)
              + rank skew + step_overhead_s

The communication terms (rings, the links groups run on, cp's ring and all-to-alls, gradient reduction) are
plan/cost_comm.py's. GEMM efficiency falls for thin shapes: efficiency * r/(r + r0) * c/(c + c0), with r the rows
(tokens of a micro-batch) and c the columns (d_model / tp) of a rank's GEMMs; r0 = 256 and c0 = 128 unless the
cluster file measured its own (`plan calibrate`). bubble is the schedule's textbook fraction
(parallel/schedule_costs.py); the fill and drain run faster by the cluster's contention where ranks share a host's
memory (1 on GPUs).

Rank skew: ranks that synchronize wait for the slowest. Between two synchronizing operations (a tp collective, a cp
ring step, an ep all-to-all, a ZeRO-2/3 unit's reduce-scatter or gather, a pipeline send, the step's gradient
reduction) each rank computes `interval` = compute / synchronizations; the slower one takes skew_at(interval) x
interval longer than the mean, so the step gains skew_at(interval) x compute (the cluster's measured curve; 0 on
GPUs, where it is absent). Mixture of experts: the ep rank holding the busiest experts sets the pace, so the
experts' matmuls run at the busiest rank's load, capacity_factor times the mean (DROPLESS_EXPERT_LOAD for dropless
routing, GShard's and Switch's customary capacity); the routed rows are gathered, weighted and scattered back
(MOE_ROW_PASSES element passes per pick). Full recomputation runs the forward's elementwise work again; under cp
the ring attention's backward recomputes the scores and probabilities of every pair (2 d T FLOPs per block and token).

Attention: on a cluster computing in bf16/fp16 the estimate assumes cuDNN's fused SDPA (plan/memory.py's "fused"),
unless asked for "unfused": no T x T scores or probabilities are saved or cross HBM (only each row's log-sum-exp), so
recomputation repeats no T x T traffic either, and its matmuls skip the masked half of the scores but recompute
Q K^T in backward (profile/flops.py, fused_attention_discount). Ring attention (cp > 1) keeps the unfused counts.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import numpy as np

from mpitrain.backend import COMPUTE_DTYPES
from mpitrain.config import (
    Config,
    resolve_layout,
    validate_context_parallel,
    validate_pipeline,
    validate_tensor_parallel,
)
from mpitrain.config_checks import validate_fp8_layout, validate_quantized_zero
from mpitrain.config_moe import MoeSettings, validate_moe
from mpitrain.errors import ConfigError
from mpitrain.layout_checks import validate_hierarchical_dp
from mpitrain.parallel import schedule_costs
from mpitrain.parallel.pipeline import stage_layer_counts
from mpitrain.plan.clusters import Cluster
from mpitrain.plan.cost_comm import (  # noqa: F401 (ring, reduction_rings, ulysses_bytes_...: importers' names)
    communication_seconds,
    gradient_sync_seconds,
    group_link,
    pp_link_messages,
    reduction_rings,
    ring,
    tp_collectives_per_block,
    ulysses_bytes_per_micro_batch,
)
from mpitrain.plan.cost_precision import bound_saving, precision_terms
from mpitrain.plan.cost_sharding import node_shares, quantize_seconds
from mpitrain.plan.memory import (
    FUSED_DTYPES,
    default_attention,
    memory_report,
    rank_model,
    rank_param_count,
    reduction_shares,
    shape_key,
)
from mpitrain.plan.pipeline_cost import pipeline_imbalance
from mpitrain.profile.flops import fused_attention_discount, recomputed_flops_per_token

ADAM_BYTES_PER_PARAM = 36  # read master, m, v, grad (4 each), write master, m, v, and the compute-dtype copy
ELEMENTWISE_PASSES = 4  # saved activations are written, read in backward, and their gradients written and read
# per routed pick and MoE layer, in elements of d_model: forward gathers the token's row (read, write) and scales
# and adds the expert output into the token's (3); backward gathers the output gradient (2), the gate's dot
# product (2), scales the rows it sends (2) and adds the returned input gradient into the token's (3)
MOE_ROW_PASSES = 14
DROPLESS_EXPERT_LOAD = 1.25  # busiest expert-parallel rank / mean under dropless routing (capacity factor 1.25)


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    zero: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    offload: str = "none"
    etp: int = 0  # expert tensor parallelism: 0 = tp (experts split like the MLP), 1 = whole experts
    cp_kind: str = "ring"  # context parallelism: ring (K/V passed round), ulysses (all-to-all of heads), hybrid
    dp_reduce: str = "flat"  # gradient reduction: flat, or two_level (inside each node, then across nodes)
    zero_shard: str = "world"  # ZeRO shards over all dp ranks (world) or one node's (node: hybrid sharding)
    zero_gather_dtype: str = "same"  # ZeRO-3 weight all-gather on the wire: same | int8 | fp8
    zero_grad_reduce: str = "exact"  # ZeRO gradient reduce-scatter on the wire: exact | int8 | int4
    tp_overlap: bool = False  # tp collectives chunked behind the GEMMs (collective matmul)
    fp8: str = "none"  # FP8 GEMM recipe: none | tensor | delayed | block | mxfp8

    def describe(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"] + [f"cp{self.cp}"] * (self.cp > 1) + \
                [self.cp_kind] * (self.cp > 1 and self.cp_kind != "ring") + \
                [f"ep{self.ep}"] * (self.ep > 1) + [f"etp{self.etp}"] * (0 < self.etp < self.tp) + \
                [f"zero{self.zero}", f"mb{self.micro_batch}"]
        if self.pp > 1:
            parts.append(self.schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        parts += [f"rc-{self.recompute}"] * (self.recompute != "none") + [f"offload-{self.offload}"] * \
                 (self.offload != "none")
        return " ".join(parts + self.extras())

    def extras(self) -> list[str]:
        """The tokens of the settings beyond the mesh, schedule and memory savers (plan/layout.py reads them back)."""
        return ["two-level"] * (self.dp_reduce == "two_level") + ["shard-node"] * (self.zero_shard == "node") + \
            [f"gather-{self.zero_gather_dtype}"] * (self.zero_gather_dtype != "same") + \
            [f"grad-{self.zero_grad_reduce}"] * (self.zero_grad_reduce != "exact") + \
            ["tp-overlap"] * self.tp_overlap + [f"fp8-{self.fp8}"] * (self.fp8 != "none")


def layout_config(base: Config, layout: Layout, compute: str) -> Config:
    """base with the layout's keys set, validated and resolved (raises ConfigError for an impossible layout)."""
    cfg = copy.copy(base)
    cfg.parallel = copy.copy(base.parallel)
    cfg.train, cfg.memory, cfg.precision = copy.copy(base.train), copy.copy(base.memory), copy.copy(base.precision)
    p = cfg.parallel
    p.dp, p.tp, p.pp, p.cp, p.ep, p.zero = layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.zero
    p.etp, p.cp_kind = layout.etp, layout.cp_kind
    p.dp_reduce, p.zero_shard, p.tp_overlap = layout.dp_reduce, layout.zero_shard, layout.tp_overlap
    p.zero_gather_dtype, p.zero_grad_reduce, cfg.precision.fp8 = layout.zero_gather_dtype, layout.zero_grad_reduce, \
        layout.fp8
    p.sequence_parallel, p.schedule, p.virtual_stages = layout.tp > 1, layout.schedule, layout.virtual_stages
    p.microbatches, p.stage_layers, p.allow_cross_node_tp = 0, [], True
    cfg.train.micro_batch, cfg.train.device = layout.micro_batch, "cpu"  # shapes only: cp's device check aside
    cfg.memory.recompute, cfg.memory.recompute_layers, cfg.memory.offload = layout.recompute, 0, layout.offload
    cfg.precision.compute = compute
    for check in (validate_tensor_parallel, validate_pipeline, validate_context_parallel,
                  validate_moe, validate_fp8_layout, validate_hierarchical_dp,
                  validate_quantized_zero):  # what a layout changes
        check(cfg)
    resolve_layout(cfg, layout.dp * layout.tp * layout.pp * layout.cp)
    return cfg


def gemm_shape_factor(rows: float, cols: float, rows_half: float = 256.0, cols_half: float = 128.0) -> float:
    """The fraction of a large GEMM's speed that a (rows x cols) one reaches (module docstring)."""
    return rows / (rows + rows_half) * cols / (cols + cols_half)


_NUMBERS: dict = {}


def _model_numbers(cfg: Config, model) -> dict:
    """Per-shape numbers that take a walk over every tensor: computed once per shape."""
    key = shape_key(cfg)
    if key not in _NUMBERS:
        _NUMBERS[key] = {"flops_per_token": model.flops_per_token(),
                         "largest_unit": max(layout.size for layout in model.layouts)}
    return _NUMBERS[key]


_MODEL_FLOPS: dict = {}  # model shape -> training FLOPs per token of the whole model (the same on every layout)


def step_lower_bound(base: Config, layout: Layout, cluster: Cluster, attention: str | None = None) -> float:
    """Seconds the step of `layout` takes at least: its matmuls without recomputation at the GEMM shape it runs,
    stretched by its pipeline bubble (estimate's pipeline term); every other part only adds. Cheap (no rank model
    is built), so the search skips layouts this already puts behind the best one found."""
    m_cfg = base.model
    key = repr((m_cfg, base.lora))
    if key not in _MODEL_FLOPS:
        _MODEL_FLOPS[key] = _model_numbers(base, rank_model(base))["flops_per_token"]
    world = layout.dp * layout.tp * layout.pp * layout.cp
    flops = _MODEL_FLOPS[key]
    if cluster_attention(cluster, attention) == "fused" and layout.cp == 1:
        flops -= fused_attention_discount(m_cfg, m_cfg.n_layer, False)
    rows = layout.micro_batch * m_cfg.seq_len // layout.cp
    speed = cluster.peak_flops * cluster.matmul_efficiency_at(rows) * \
        gemm_shape_factor(rows, m_cfg.d_model / layout.tp, cluster.gemm_rows_half, cluster.gemm_cols_half)
    matmul = flops * base.train.global_batch * m_cfg.seq_len / world / speed
    matmul -= bound_saving(base, layout.fp8, cluster, base.train.global_batch * m_cfg.seq_len / world, speed)  # FP8
    micro_batches = base.train.global_batch // (layout.dp * layout.micro_batch)
    if layout.pp == 1 or micro_batches < 1:
        return matmul
    try:
        bubble = schedule_bubble(layout.schedule, layout.pp, micro_batches, layout.virtual_stages)
    except (ValueError, ConfigError):  # a schedule this layout cannot run: estimate refuses it
        return matmul
    return matmul * (1 + bubble / (1 - bubble) / cluster.contention)


@functools.lru_cache(maxsize=4096)  # zbv's is a list schedule built and timed: the search asks thousands of times
def schedule_bubble(kind: str, pp: int, micro_batches: int, virtual_stages: int) -> float:
    """parallel/schedule_costs.py's bubble fraction of the schedule as built."""
    return float(schedule_costs.bubble(kind, pp, micro_batches, virtual_stages))


@dataclass(frozen=True)
class RankWork:
    """What one rank of a layout does in a step: the quantities the parts of the estimate share."""
    element_bytes: int  # of the compute dtype
    world: int
    micro_batches: int
    tokens: int  # of the global batch
    rows: int  # of a micro-batch's GEMMs on one rank (its tokens, T / cp of each row)
    layer_counts: list  # blocks per pipeline chunk
    layers: int  # blocks on one pipeline rank
    moe: MoeSettings
    moe_layers: int  # of this pipeline rank's blocks
    units: int  # the rank's blocks, and the embedding and head (one each on the first and last stage)
    tp_per_layer: int  # tp collectives per block and micro-batch (cost_comm.py tp_collectives_per_block)
    attention: str = "unfused"  # "fused": cuDNN's SDPA (module docstring); ring attention (cp > 1) is never fused

    @classmethod
    def of(cls, cfg: Config, compute: str, attention: str = "unfused") -> RankWork:
        m_cfg, p, t = cfg.model, cfg.parallel, cfg.train
        layer_counts = stage_layer_counts(m_cfg.n_layer, p.pp * p.virtual_stages, p.stage_layers)
        layers = sum(layer_counts) // p.pp
        moe = MoeSettings.of(m_cfg)
        return cls(element_bytes=np.dtype(COMPUTE_DTYPES[compute]).itemsize, world=p.dp * p.tp * p.pp * p.cp,
                   micro_batches=t.global_batch // (p.dp * t.micro_batch), tokens=t.global_batch * m_cfg.seq_len,
                   rows=t.micro_batch * m_cfg.seq_len // p.cp, layer_counts=layer_counts, layers=layers, moe=moe,
                   moe_layers=sum(moe.is_moe_block(i) for i in range(layers)),
                   units=layers + (2 if p.pp == 1 else 1),
                   tp_per_layer=tp_collectives_per_block(cfg.memory.recompute, p.sequence_parallel),
                   attention=attention if p.cp == 1 else "unfused")


def cluster_attention(cluster: Cluster, attention: str | None = None) -> str:
    """The attention path the estimate assumes: `attention` if given, else fused where the cluster computes in
    bf16/fp16 (the GPU presets; a calibrated CPU machine computes in float32)."""
    return attention or default_attention(cluster.compute, on_gpu=cluster.compute in FUSED_DTYPES)


def estimate(base: Config, layout: Layout, cluster: Cluster, attention: str | None = None) -> dict:
    """Memory per rank and step time, by part, of `layout` on `cluster` (module docstring); attention: "fused",
    "unfused" or None (cluster_attention)."""
    cfg = layout_config(base, layout, cluster.compute)
    p, work = cfg.parallel, RankWork.of(cfg, cluster.compute, cluster_attention(cluster, attention))
    shape = _model_numbers(cfg, rank_model(cfg))
    memory = rank_memory(cfg, cluster, work.element_bytes, shape["largest_unit"], work.attention)
    compute = compute_seconds(cfg, cluster, work, shape["flops_per_token"])
    comm, crosses = communication_seconds(cfg, cluster, work)
    compute, comm, fp8_step = precision_terms(cfg, cluster, work, compute, comm, *precision_inputs(cfg, cluster, work))
    zero_micro, reduce_exposed, gather_params = gradient_sync_seconds(cfg, cluster, work, compute["micro"],
                                                                      memory["transient"])
    optimizer = optimizer_seconds(cfg, cluster)
    skew = rank_skew_seconds(cfg, cluster, work, compute["micro"])
    quantize = quantize_seconds(cfg, cluster, reduction_shares(cfg), work.micro_batches, work.element_bytes)

    m = work.micro_batches
    micro = compute["micro"] + comm["tp"] + comm["cp_ring"] + comm["ep_all_to_all"] + comm["pp_send"] + zero_micro
    bubble = schedule_bubble(p.schedule, p.pp, m, p.virtual_stages) if p.pp > 1 else 0.0
    # a rank idles while the others fill and drain the pipeline, work they do with the node to themselves
    pipeline = m * micro * (1 + bubble / (1 - bubble) / cluster.contention)
    step = pipeline + reduce_exposed + fp8_step + gather_params + optimizer + skew + quantize + cluster.step_overhead_s
    parts = {"matmul": compute["matmul"], "elementwise": compute["elementwise"],
             "overhead": compute["overhead"] + cluster.step_overhead_s, "tp": m * comm["tp"],
             "cp_ring": m * comm["cp_ring"], "ep_all_to_all": m * comm["ep_all_to_all"],
             "pp_send": m * comm["pp_send"], "zero_exposed": m * zero_micro + gather_params,
             "dp_reduce": reduce_exposed + fp8_step, "bubble": pipeline - m * micro, "optimizer": optimizer,
             "rank_skew": skew,
             "quantize": quantize}
    return {"layout": dict(layout.__dict__), "name": layout.describe(), "world": work.world, "micro_batches": m,
            "memory": memory, "fits": memory["total"] <= cluster.usable_bytes, "step_s": step, "parts": parts,
            "tokens_per_s": work.tokens / step,
            "mfu": shape["flops_per_token"] * work.tokens / step / (work.world * cluster.peak_flops),
            "bubble": bubble, "crosses": crosses, "bottleneck": bottleneck(parts, crosses, p, cluster)}


def precision_inputs(cfg: Config, cluster: Cluster, work: RankWork) -> tuple:
    """What plan/cost_precision.py's precision_terms takes from this model: the GEMM shape factor at a micro-batch's
    rows and at the rows / tp of tp_overlap's chunks, the tp, cp and dp x cp groups' links, the experts' load."""
    p, cols = cfg.parallel, cfg.model.d_model / cfg.parallel.tp
    shapes = tuple(gemm_shape_factor(rows, cols, cluster.gemm_rows_half, cluster.gemm_cols_half)
                   for rows in (work.rows, work.rows / p.tp))
    links = {name: group_link(cluster, size, p.tp if name != "tp" else 1)[0]
             for name, size in (("tp", p.tp), ("cp", p.cp), ("dp", p.dp * p.cp))}
    load = min(work.moe.capacity_factor or DROPLESS_EXPERT_LOAD, p.ep) if work.moe.experts and p.ep > 1 else 1.0
    return shapes, links, load


def rank_memory(cfg: Config, cluster: Cluster, element_bytes: int, largest_unit: int,
                attention: str = "unfused") -> dict:
    """Bytes per rank: what the fullest pipeline stage holds, and the transient buffers beside it."""
    p = cfg.parallel
    transient = p.bucket_mb * 2**20 * 2  # a bucket being reduced and the next one filling
    if p.zero == 3:  # the unit being computed and the prefetched next one, gathered whole
        transient += 2 * largest_unit * element_bytes
    stages = stage_memory(cfg, attention, cluster.gpus_per_node)
    held = max(stage["total"] for stage in stages.values())  # the fullest stage decides what fits
    total = held + transient
    return {"held": held, "transient": transient, "total": total, "rows": stages["first"]["bytes"],
            "headroom": cluster.usable_bytes - total,
            "stages": {name: stage["total"] for name, stage in stages.items()}}


def compute_seconds(cfg: Config, cluster: Cluster, work: RankWork, model_flops: float) -> dict:
    """Seconds of one rank's step in matmuls, elementwise traffic and fixed per-unit overhead; "micro": their sum
    per micro-batch."""
    m_cfg, p, moe = cfg.model, cfg.parallel, work.moe
    hardware_flops = model_flops + recomputed_flops_per_token(m_cfg, work.layer_counts, cfg.memory.recompute)
    if p.cp > 1 and p.cp_kind in ("ring", "hybrid"):  # ring attention's backward recomputes each pair's scores
        hardware_flops += 2.0 * m_cfg.d_model * m_cfg.seq_len * sum(work.layer_counts)
    if work.attention == "fused":
        hardware_flops -= fused_attention_discount(m_cfg, sum(work.layer_counts), cfg.memory.recompute != "none")
    thin = gemm_shape_factor(work.rows, m_cfg.d_model / p.tp, cluster.gemm_rows_half, cluster.gemm_cols_half)
    matmul = hardware_flops * work.tokens / work.world / (cluster.peak_flops * cluster.matmul_efficiency_at(work.rows)
                                                          * thin)
    if moe.experts and p.ep > 1:  # the experts' matmuls at the busiest ep rank's load
        load = min(moe.capacity_factor or DROPLESS_EXPERT_LOAD, p.ep)
        expert_flops = 6 * moe.top_k * (3 if m_cfg.arch == "llama" else 2) * m_cfg.d_model * m_cfg.ff_dim * \
            sum(moe.is_moe_block(i) for i in range(m_cfg.n_layer))  # per token, whole model
        matmul += (load - 1) * matmul * expert_flops / hardware_flops
    elementwise = elementwise_seconds(cfg, cluster, work)
    # the pipeline runs at its busiest rank's pace: uneven block splits, the head on the last stage (pipeline_cost.py)
    busiest = pipeline_imbalance(m_cfg.n_layer, p.pp, p.virtual_stages, p.schedule, m_cfg.vocab_size, m_cfg.d_model,
                                 hardware_flops, p.stage_layers)
    matmul, elementwise = matmul * busiest, elementwise * busiest
    # a recomputed forward costs a third of a unit's forward and backward again
    overhead = cluster.unit_overhead_s * work.units * work.micro_batches * \
        (4 / 3 if cfg.memory.recompute == "full" else 1)
    return {"matmul": matmul, "elementwise": elementwise, "overhead": overhead,
            "micro": (matmul + elementwise + overhead) / work.micro_batches}


def elementwise_seconds(cfg: Config, cluster: Cluster, work: RankWork) -> float:
    """Elementwise traffic at HBM bandwidth; it does not shrink with recomputation."""
    m_cfg, p, e = cfg.model, cfg.parallel, work.element_bytes
    # Korthikanti et al. 2022's activation bytes per layer and token at 2-byte elements (34 d + 5 heads T), split
    # over tp (and T over cp), read and written a few times; the fused attention keeps its scores on chip and moves
    # only each row's float32 log-sum-exp (2 two-byte elements per head) instead of the 5 heads T
    scores = 2 * m_cfg.n_head if work.attention == "fused" else 5 * m_cfg.n_head * m_cfg.seq_len / p.cp
    per_token = (34 * m_cfg.d_model + scores) / p.tp * e / 2
    # the forward's share of the traffic runs again under full recomputation (selective: attention's part)
    # (and under cp the ring's backward its probabilities, P = exp(S - lse))
    again = ({"full": 34 * m_cfg.d_model + scores, "selective": scores}.get(cfg.memory.recompute, 0.0) +
             scores * (p.cp > 1 and p.cp_kind in ("ring", "hybrid"))) / p.tp * e / 2
    # per token; every tp rank routes all
    routed_rows = MOE_ROW_PASSES * work.moe.top_k * m_cfg.d_model * e * work.moe_layers
    return (ELEMENTWISE_PASSES * per_token * work.layers + ELEMENTWISE_PASSES / 2 * again * work.layers +
            routed_rows) * work.tokens / (p.dp * p.cp) / cluster.hbm_bandwidth


def optimizer_seconds(cfg: Config, cluster: Cluster) -> float:
    """Adam's passes over this rank's shard of the state (over PCIe, both ways, when offloaded)."""
    p = cfg.parallel
    shard = sum(count / (ranks if p.zero >= 1 else 1)
                for count, ranks in node_shares(cfg, reduction_shares(cfg), cluster.gpus_per_node))
    if cfg.memory.offload != "none":  # master weights and moments cross PCIe both ways, Adam runs on the host
        return shard * 2 * 12 / cluster.host_bandwidth + shard * ADAM_BYTES_PER_PARAM / cluster.host_bandwidth
    return shard * ADAM_BYTES_PER_PARAM / cluster.optimizer_bytes_per_s


def rank_skew_seconds(cfg: Config, cluster: Cluster, work: RankWork, compute_micro: float) -> float:
    """What waiting on the slower rank at each synchronization adds to the step (module docstring)."""
    p, layers = cfg.parallel, work.layers
    if work.world <= 1:
        return 0.0
    # synchronizations per micro-batch, and one per step: the gradient reduction
    syncs_micro = work.tp_per_layer * layers * (p.tp > 1) + 3 * layers * (p.cp - 1) + \
        4 * work.moe_layers * (p.ep > 1) + {3: 3 * work.units, 2: work.units}.get(p.zero, 0) * (p.dp * p.cp > 1) + \
        (pp_link_messages(p.schedule, p.pp, p.virtual_stages) if p.pp > 1 else 0)
    compute = work.micro_batches * compute_micro
    return cluster.skew_at(compute / (work.micro_batches * syncs_micro + 1)) * compute


def stage_memory(cfg: Config, attention: str = "unfused", gpus_per_node: int = 0) -> dict:
    """memory_report of the first pipeline stage (the embedding, the most micro-batches in flight) and, under
    pipelining, of the last (the head and its logits): {"first": ..., "last": ...}."""
    pp = cfg.parallel.pp
    ranks = {"first": 0, "last": pp - 1} if pp > 1 else {"first": 0}
    return {name: memory_report(cfg, rank_param_count(cfg, pp_rank), pp_rank, attention, gpus_per_node)
            for name, pp_rank in ranks.items()}


def bottleneck(parts: dict, crosses: dict, p, cluster: Cluster) -> str:
    """The largest part of the step, in words."""
    step = sum(parts.values())
    kind, seconds = max(parts.items(), key=lambda item: item[1])
    share = f"{100 * seconds / step:.0f}% of the step"
    if kind == "matmul":
        return f"compute-bound: matmuls {share}"
    words = {"elementwise": "memory-bound elementwise ops (norms, softmax, activations)",
             "overhead": "fixed per-unit overhead (launches, Python)",
             "tp": f"tp {p.tp} collectives" + (f" cross the node ({cluster.inter.bandwidth / 1e9:.0f} GB/s link)"
                                                if crosses["tp"] else ""),
             "cp_ring": f"cp {p.cp} " + ("all-to-all of heads" if p.cp_kind == "ulysses" else "K/V ring"),
             "ep_all_to_all": f"ep {p.ep} all-to-all",
             "pp_send": "pipeline sends", "zero_exposed": f"ZeRO-{p.zero} parameter gathers",
             "dp_reduce": "gradient reduction" + (" across nodes" if crosses["dp"] else ""),
             "bubble": f"pipeline bubble ({p.schedule}, pp {p.pp})", "optimizer": "optimizer step",
             "rank_skew": "waiting on the slower rank at each synchronization",
             "quantize": "quantizing and dequantizing ZeRO's messages"}
    return f"{words[kind]}: {share}"
