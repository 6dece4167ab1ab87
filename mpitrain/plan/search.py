"""`mpitrain plan`: enumerate layouts of a model on a cluster, keep those that fit, rank them by predicted step time,
and say why the obvious alternatives lost.

The space: dp x tp x pp x cp = the GPUs, ep (from dp x cp, and the tp ranks' token shares at etp = 1) and
etp (1 or tp) for MoE; ZeRO stage; micro-batch; recomputation; pipeline schedule (1f1b,
interleaved with 2, 4 or 8 chunks per rank, zb1p, zbv, dualpipev where a step has at least 2p micro-batches; gpipe
has 1f1b's bubble with m instead of p micro-batches in flight, so it never wins); optimizer offload (tried only
where the layout does not fit without it); where the gradient group (dp x cp) spans nodes with several of its
ranks on each, the two-level reduction and ZeRO sharded over a node (parallel.dp_reduce, zero_shard), and where cp
does, hybrid cp (plan/cost_sharding.py); ZeRO++'s quantized wire only when asked (allow: "quantized-comm"). Layouts
mpitrain itself refuses (mpitrain.config's checks) are skipped; tp beyond a node is kept, so that the table can say
what it costs.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

from mpitrain.config import Config, to_toml, validate
from mpitrain.config_moe import MoeSettings
from mpitrain.errors import ConfigError
from mpitrain.plan.clusters import Cluster, load_cluster
from mpitrain.plan.cost import Layout, cluster_attention, estimate, layout_config, step_lower_bound
from mpitrain.plan.cost_precision import FP8_RECIPES, fp8_speedup
from mpitrain.plan.cost_sharding import hybrid_cp_worth_trying, sync_settings
from mpitrain.plan.presets import model_config

GB = 1e9
MICRO_BATCHES = (1, 2, 4, 8)
MAX_PP = 16  # deeper pipelines leave a stage only a few blocks at the sizes we plan
# chunks per rank of the interleaved schedule: its bubble shrinks v times, and at pp 16 with 32 micro-batches (Llama 3
# 405B on 8,192 GPUs) v = 2 still idles 19% of the step where v = 8 idles 5% (docs/planning.md, the 405B finding)
INTERLEAVING = (2, 4, 8)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfg: Config, gpus: int, cluster: Cluster, allow: tuple = ()):
    """Every layout worth evaluating, cheapest in memory savings first within each mesh."""
    m = cfg.model
    experts = MoeSettings.of(m).experts
    long_context = m.seq_len >= 16384
    for tp in divisors(gpus):
        if tp > 2 * cluster.gpus_per_node or m.n_head % tp:
            continue
        for cp in divisors(gpus // tp):
            if cp > 1 and not long_context:
                continue
            for pp in divisors(gpus // (tp * cp)):
                if pp > min(MAX_PP, m.n_layer // 2) and pp > 1:
                    continue
                dp = gpus // (tp * cp * pp)
                for etp, ep in _expert_meshes(experts, dp * cp, tp):
                    yield from _settings(cfg, Layout(dp, tp, pp, cp, ep, etp=etp), cluster, allow)


def _expert_meshes(experts: int, holders: int, tp: int):
    """(etp, ep) of the experts' own mesh (comm/mesh.py): ep drawn from the dp x cp ranks with experts split over tp,
    and whole experts (etp = 1) only where ep reaches into the tp ranks' token shares, beyond what dp x cp holds."""
    if not experts:
        yield tp, 1
        return
    for ep in divisors(holders * tp):
        if experts % ep == 0:
            yield (tp, ep) if holders % ep == 0 else (1, ep)


def _settings(cfg: Config, mesh: Layout, cluster: Cluster, allow: tuple = ()):
    schedules = [("1f1b", 1)] if mesh.pp == 1 else [("1f1b", 1), ("zb1p", 1)] + \
        [("interleaved", v) for v in INTERLEAVING if cfg.model.n_layer >= v * mesh.pp] + \
        ([("zbv", 2), ("dualpipev", 2)] if cfg.model.n_layer >= 2 * mesh.pp else [])
    zeros = [0, 1, 2, 3] if mesh.pp == 1 else [0, 1, 2]  # ZeRO-3 under pp: regathers
    recomputes = ["none", "full"] if mesh.cp > 1 else ["none", "selective", "full"]
    # Ulysses where the heads split over tp x cp (its all-to-alls against the ring's K/V passes; config refuses the
    # rest)
    cp_kinds = ["ring"] + ["ulysses"] * (mesh.cp > 1 and cfg.model.n_head % (mesh.tp * mesh.cp) == 0) + \
        ["hybrid"] * hybrid_cp_worth_trying(cfg, mesh, cluster.gpus_per_node)  # cp across nodes: plan/cost_sharding.py
    for micro_batch, (schedule, v), zero, cp_kind in itertools.product(MICRO_BATCHES, schedules, zeros, cp_kinds):
        if cfg.train.global_batch % (mesh.dp * micro_batch):
            continue
        if schedule == "dualpipev" and cfg.train.global_batch // (mesh.dp * micro_batch) < 2 * mesh.pp:
            continue  # DualPipeV needs 2p micro-batches (mpitrain.config refuses fewer): not worth an estimate
        # recomputation only adds FLOPs: the search stops at the first mode that fits
        for sync in sync_settings(cfg, mesh, cluster.gpus_per_node, zero, allow):  # two-level, node shards, ZeRO++
            yield [Layout(mesh.dp, mesh.tp, mesh.pp, mesh.cp, mesh.ep, zero, micro_batch, recompute, schedule, v,
                          etp=mesh.etp, cp_kind=cp_kind, **sync) for recompute in recomputes]


def precision_variants(cfg: Config, group: list[Layout], fp8: str, compute: str) -> list[list[Layout]]:
    """A group of layouts (one per recomputation mode) as the search tries it: parallel.tp_overlap on wherever
    tp > 1 (exact; in the 70B-on-64-H100 search the plain variant of all 4,863 pairs was never faster, so it is
    left to --layout), and precision.fp8 = `fp8` (FP8 changes the numerics: only when asked). "any": the first
    recipe of FP8_RECIPES the config accepts for the mesh (block first: in the model it is never slower and never
    larger than the others; plan/cost_precision.py)."""
    recipe = fp8
    if fp8 == "any":
        recipe = next((r for r in FP8_RECIPES if _accepts(cfg, replace(group[0], fp8=r), compute)), FP8_RECIPES[0])
    return [[replace(layout, tp_overlap=layout.tp > 1, fp8=recipe) for layout in group]]


def _accepts(cfg: Config, layout: Layout, compute: str) -> bool:
    try:
        layout_config(cfg, layout, compute)
    except ConfigError:
        return False
    return True


def search(cfg: Config, cluster: Cluster, gpus: int, attention: str | None = None, prune: bool = True,
           fp8: str = "none", allow: tuple = ()) -> dict:
    """All evaluated layouts: {'fits': [...] best first, 'too_big': [...] nearest first, 'refused': {why: count},
    'pruned': count}; attention: "fused", "unfused" or None, the cluster's default (plan/cost.py,
    cluster_attention). prune: skip the layouts whose step_lower_bound is already slower than the best layout that
    fits so far (they cannot win; benchmarks/bench_plan.py --search times the search with and without)."""
    fits, too_big, refused = [], [], {}
    best_step, pruned = float("inf"), 0
    groups = [variant for group in candidate_layouts(cfg, gpus, cluster, allow)
              for variant in precision_variants(cfg, group, fp8, cluster.compute)]
    if prune:  # the most promising first, so that the best step found early rules out the most
        bounds = [step_lower_bound(cfg, group[0], cluster, attention) for group in groups]
        order = sorted(range(len(groups)), key=lambda i: bounds[i])
        groups = [(bounds[i], groups[i]) for i in order]
    else:
        groups = [(0.0, group) for group in groups]
    zbv_fits = set()  # zbv layouts that fit without recomputation
    for bound, by_recompute in groups:
        if bound > best_step or (prune and _zbv_twin(by_recompute[0]) in zbv_fits):
            pruned += len(by_recompute)  # its matmuls and bubble alone are slower than a layout that fits
            continue
        for layout in by_recompute:
            try:
                result = estimate(cfg, layout, cluster, attention)
                if not result["fits"] and layout.zero >= 1 and layout.recompute == "full":  # the last resort:
                    offloaded = estimate(cfg, _with(layout, offload="host"), cluster, attention)  # optimizer state off
                    result = offloaded if offloaded["fits"] else result
            except ConfigError as exc:
                reason = str(exc).split(";")[0]
                refused[reason] = refused.get(reason, 0) + 1
                continue
            (fits if result["fits"] else too_big).append(result)
            if result["fits"]:
                best_step = min(best_step, result["step_s"])
                if layout.schedule == "zbv" and layout is by_recompute[0]:
                    zbv_fits.add(layout.describe())
                break
    fits.sort(key=lambda r: (r["step_s"], r["memory"]["total"], r["name"]))
    too_big.sort(key=lambda r: (-r["memory"]["headroom"], r["name"]))
    return {"fits": fits, "too_big": too_big, "refused": refused, "pruned": pruned}


def _zbv_twin(layout: Layout) -> str | None:
    """A dualpipev layout's zbv twin: the same V, parts and messages with half the bubble, (p-1)/(6m+p-1) against
    (p-1)/(3m+p-1). Where the twin fits without recomputation (its smaller bound evaluates it first), the
    dualpipev layout cannot win."""
    return _with(layout, schedule="zbv").describe() if layout.schedule == "dualpipev" else None


def _with(layout: Layout, **changes) -> Layout:
    return Layout(**{**layout.__dict__, **changes})


def alternatives(found: dict, cluster: Cluster) -> list[str]:
    """Why the obvious alternatives to the best layout lost: the best of each other tp, pp, cp, ZeRO stage and
    recomputation mode, or the nearest miss where none of them fits."""
    if not found["fits"]:
        return []
    best = found["fits"][0]
    lines = []
    for key in ("tp", "pp", "cp", "ep", "zero", "recompute", "micro_batch", "dp_reduce", "zero_shard"):
        values = {r["layout"][key] for r in found["fits"] + found["too_big"]} - {best["layout"][key]}
        for value in sorted(values, key=str):
            same = [r for r in found["fits"] if r["layout"][key] == value]
            if same:
                rival = same[0]
                lines.append(f"{key} {value}: {rival['name']} is {rival['step_s'] / best['step_s']:.2f}x slower: "
                             f"{_why_slower(rival, best, cluster)}")
            else:
                missed = [r for r in found["too_big"] if r["layout"][key] == value]
                if missed:
                    rival = missed[0]
                    lines.append(f"{key} {value}: no layout fits; nearest {rival['name']} does not fit by "
                                 f"{-rival['memory']['headroom'] / GB:.1f} GB")
    faster = sorted((r for r in found["too_big"] if r["step_s"] < best["step_s"]),
                    key=lambda r: -r["memory"]["headroom"])
    for rival in faster[:3]:  # what the memory limit cost: the faster layouts that came nearest to fitting
        lines.append(f"{rival['name']} would be {best['step_s'] / rival['step_s']:.2f}x faster but does not fit by "
                     f"{-rival['memory']['headroom'] / GB:.1f} GB (needs {rival['memory']['total'] / GB:.1f} of "
                     f"{cluster.usable_bytes / GB:.0f} GB usable)")
    return lines


def _why_slower(rival: dict, best: dict, cluster: Cluster) -> str:
    grown = max(rival["parts"], key=lambda k: rival["parts"][k] - best["parts"][k])
    delta = rival["parts"][grown] - best["parts"][grown]
    words = {"matmul": "thinner GEMMs / more recomputed FLOPs", "elementwise": "more elementwise traffic",
             "overhead": "more units or micro-batches, each with its fixed overhead",
             "tp": "more tensor-parallel traffic", "cp_ring": "the cp ring is exposed",
             "ep_all_to_all": "all-to-all of routed tokens", "pp_send": "more pipeline sends",
             "zero_exposed": "ZeRO parameter gathers", "dp_reduce": "gradient reduction is exposed",
             "bubble": "a larger pipeline bubble", "optimizer": "a slower optimizer step",
             "rank_skew": "more synchronizations, each waiting on the slower rank",
             "quantize": "quantizing ZeRO's messages"}
    if grown == "matmul":
        recompute = rival["layout"]["recompute"]
        more = recompute != best["layout"]["recompute"] and recompute != "none"
        words["matmul"] = f"recomputes more (memory.recompute = {recompute})" if more else "thinner GEMMs"
    crossing = [k for k, crosses in rival["crosses"].items() if crosses and not best["crosses"][k]]
    where = ""
    if crossing:
        size = rival["layout"].get(crossing[0], "")
        where = f" ({crossing[0]} {size} crosses the node: {cluster.inter.bandwidth / GB:.0f} GB/s link)"
    return f"{words[grown]} +{_seconds(delta)}{where}"


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value >= 0.1 else f"{1000 * value:.2f} ms"


def format_table(found: dict, cluster: Cluster, top: int) -> str:
    rows = found["fits"][:top]
    width = max([44] + [len(r["name"]) for r in rows])  # the names grow with the settings beyond the mesh
    header = (f"{'#':>2}  {'layout':<{width}} {'mem/rank GB':>11} {'headroom':>9} {'step s':>8} {'tokens/s':>10} "
              f"{'MFU':>6}  bottleneck")
    lines = [header]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:>2}  {r['name']:<{width}} {r['memory']['total'] / GB:>11.1f} "
                     f"{r['memory']['headroom'] / GB:>8.1f}G {r['step_s']:>8.3f} {r['tokens_per_s']:>10.0f} "
                     f"{100 * r['mfu']:>5.1f}%  {r['bottleneck']}")
    return "\n".join(lines)


def attention_line(cluster: Cluster, attention: str | None = None) -> str:
    """One line: which attention the estimates assume."""
    if cluster_attention(cluster, attention) == "fused":
        return (f"attention: assumed fused (cuDNN SDPA, {cluster.compute}): no T x T scores saved or moved "
                f"(--attention unfused for the cuBLAS count; ring attention under cp > 1 stays unfused)")
    return "attention: unfused (T x T probabilities saved and moved)"


def report(found: dict, cluster: Cluster, model_name: str, cfg: Config, gpus: int, top: int,
           attention: str | None = None) -> str:
    """The findings, then which attention they assume (last: the table's rows stay where scripts read them)."""
    fp8 = any(r["layout"]["fp8"] != "none" for r in found["fits"][:top])
    return _findings(found, cluster, model_name, cfg, gpus, top) + "\n" + attention_line(cluster, attention) + \
        ("\nMFU counts the bf16 peak; FP8 GEMMs assumed at the cluster's FP8 peak (docs/planning.md)" if fp8 else "")


def _findings(found: dict, cluster: Cluster, model_name: str, cfg: Config, gpus: int, top: int) -> str:
    fits = found["fits"]
    evaluated = len(fits) + len(found["too_big"])
    lines = [(f"{model_name} on {gpus} x {cluster.name} ({math.ceil(gpus / cluster.gpus_per_node)} node(s)), "
             f"seq {cfg.model.seq_len}, global batch {cfg.train.global_batch}, {cluster.compute}: {evaluated} layouts "
             f"evaluated, {len(fits)} fit in {cluster.usable_bytes / GB:.0f} GB usable per GPU")]
    if not evaluated:
        lines.append(f"no layout to evaluate: train.global_batch = {cfg.train.global_batch} must be a multiple of dp x "
                     f"micro-batch, and mpitrain's checks refused the rest ({sum(found['refused'].values())}, e.g. "
                     f"{next(iter(found['refused']), 'none')})")
        return "\n".join(lines)
    if not fits:
        nearest = found["too_big"][:top]
        lines.append("nothing fits; nearest misses:")
        lines += [f"  {r['name']}: does not fit by {-r['memory']['headroom'] / GB:.1f} GB" for r in nearest]
        return "\n".join(lines)
    lines += [format_table(found, cluster, top), "", "why not:"]
    lines += [f"  {line}" for line in alternatives(found, cluster)]
    if found.get("pruned"):
        lines.append(f"  not evaluated: {found['pruned']} layouts whose matmuls and pipeline bubble alone are slower "
                     "than the best")
    if found["refused"]:
        lines.append(f"  refused by mpitrain's config checks: {sum(found['refused'].values())} layouts, e.g. "
                     f"{next(iter(found['refused']))}")
    return "\n".join(lines)


def as_json(found: dict, cluster: Cluster, top: int) -> str:
    return json.dumps({"fits": found["fits"][:top], "nearest_misses": found["too_big"][:top],
                       "why_not": alternatives(found, cluster), "refused": found["refused"]}, indent=1)


def emit_config(cfg: Config, result: dict, cluster: Cluster, path: str | Path) -> None:
    """The chosen layout as an mpitrain config (loadable by mpitrain.config.load_config)."""
    layout = Layout(**result["layout"])
    chosen = layout_config(cfg, layout, cluster.compute)
    chosen.parallel.dp = 0  # from the world size at launch (sbatch slurm/train.sbatch)
    chosen.parallel.allow_cross_node_tp = layout.tp > cluster.gpus_per_node
    chosen.train.device = "cuda" if cluster.compute in ("bfloat16", "float16") and layout.cp == 1 else "cpu"
    chosen.train.collectives = "nccl" if chosen.train.device == "cuda" else "mpi"
    header = (f"# mpitrain plan: {result['name']} on {result['world']} x {cluster.name}; predicted step "
              f"{result['step_s']:.3f} s, {result['memory']['total'] / GB:.1f} GB per rank, MFU "
              f"{100 * result['mfu']:.1f}%\n")
    Path(path).write_text(header + to_toml(chosen))


def plan(model: str, cluster_name: str, gpus: int | None, seq: int | None, global_batch: int | None,
         attention: str | None = None, fp8: str = "none", allow: tuple = ()) -> tuple:
    """Load MODEL (preset or config file) and CLUSTER, apply the overrides and search (attention: search's).
    Returns (cfg, name, cluster, found, gpus)."""
    cfg, name = model_config(model)
    cluster = load_cluster(cluster_name)
    gpus = gpus or cluster.gpus_per_node
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: need at least one GPU")
    if seq:
        cfg.model.seq_len = seq
    if global_batch:
        cfg.train.global_batch = global_batch
    validate(cfg)
    fp8_speedup(cluster, fp8)  # --fp8 on a cluster without FP8: one line naming it
    return cfg, name, cluster, search(cfg, cluster, gpus, attention, fp8=fp8, allow=allow), gpus


def evaluate_layout(model: str, cluster_name: str, text: str, sets: tuple, gpus: int | None, seq: int | None,
                    global_batch: int | None, attention: str | None = None) -> str:
    """`mpitrain plan MODEL CLUSTER --layout TEXT [--set KEY=VALUE ...]`: the layout alone, explained (plan/layout.py),
    with the nearest faster layout of the search over the same GPUs."""
    from mpitrain.plan.layout import explain, layout_for, nearest_better, parse_layout
    if not cluster_name:
        raise ConfigError("missing CLUSTER (h100, h200, a100, b200, this-machine or a .toml file)")
    layout, world = layout_for(parse_layout(text, tuple(sets)), gpus)
    cfg, _, cluster, found, _ = plan(model, cluster_name, world, seq, global_batch, attention)
    result = estimate(cfg, layout, cluster, attention)
    best = found["fits"][0] if found["fits"] else None
    return explain(result, cluster, nearest_better(result, found["fits"]), best) + "\n" + \
        attention_line(cluster, attention)
