"""The published record: runs whose layout and throughput are published (configs/clusters/record/published.toml),
what the planner predicts for them, and the fit of the GPU clusters' constants to the calibration runs.

A run's prediction is the estimate of its published layout (plan/cost.py); the fields its source leaves out (the
micro-batch, the interleaving depth, the recomputation where unstated) are the planner's fastest that fits. The
published figure is either achieved TFLOP/s per GPU in its source's count (PUBLISHED_COUNT: Narayanan's Eq. 3,
which includes the recomputed forward, 96 B s l h^2 (1 + s/6h + V/16lh) per step; Megatron-Core's, which does not)
or a model FLOPs utilisation (the planner's MFU).

    python -m mpitrain.plan.record           the table: each run's predicted and published figure, and the errors
    python -m mpitrain.plan.record --fit [a100|h100]   the grid search over the fitted constants on that cluster's
                                                       calibration runs (docs/planning.md)
"""
from __future__ import annotations

import argparse
import itertools
import tomllib
from dataclasses import replace
from pathlib import Path

from mpitrain.config import config_from_dict, validate
from mpitrain.errors import ConfigError
from mpitrain.plan.clusters import CLUSTER_DIR, Cluster, load_cluster
from mpitrain.plan.cost import Layout, estimate
from mpitrain.plan.presets import model_config

RECORD = CLUSTER_DIR / "record" / "published.toml"
MICRO_BATCHES = (1, 2, 4, 8)


def load_record(path: Path = RECORD) -> dict:
    """{"calibration": [run, ...], "held_out": [run, ...]} (ConfigError naming the file where it is unreadable)."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"record file {path}: {exc}") from exc
    return {"calibration": raw.get("calibration", []), "held_out": raw.get("held_out", [])}


def run_config(run: dict):
    """The mpitrain config of a run's model and global batch."""
    if "preset" in run:
        cfg, _ = model_config(run["preset"])
    else:
        cfg = config_from_dict({"model": dict(run["model"]), "data": {"synthetic": True},
                                "train": {"global_batch": run["global_batch"], "micro_batch": 1}}, run["name"])
    cfg.train.global_batch = run["global_batch"]
    validate(cfg)
    return cfg


def megatron_flops_per_step(cfg) -> float:
    """Narayanan et al. 2021, Eq. 3: FLOPs of one step with full recomputation, 96 B s l h^2 (1 + s/6h + V/16lh)."""
    m, batch = cfg.model, cfg.train.global_batch
    s, h, layers, vocab = m.seq_len, m.d_model, m.n_layer, m.vocab_size
    return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def megatron_core_flops_per_step(cfg) -> float:
    """Megatron-Core's count (megatron/training/training.py num_floating_point_operations), no recomputation:
    12 B s l h^2 ((1 + g/a + s/h) q/h + f/h * gated + V/2lh), g the key/value heads, a the heads, q = a * head_dim,
    f the MLP width, gated 3/2 for SwiGLU; for GPT-3 shapes 72 B s l h^2 (1 + s/6h + V/12lh)."""
    m, batch = cfg.model, cfg.train.global_batch
    s, h, layers, vocab = m.seq_len, m.d_model, m.n_layer, m.vocab_size
    attention = (1 + m.kv_heads / m.n_head + s / h) * m.n_head * m.head_dim / h
    mlp = m.ff_dim / h * (1.5 if m.arch == "llama" else 1.0)
    return 12 * batch * s * layers * h * h * (attention + mlp + vocab / (2 * layers * h))


# how each source counts the FLOPs of its published TFLOP/s
PUBLISHED_COUNT = {"narayanan-t1": megatron_flops_per_step, "narayanan-t2": megatron_flops_per_step,
                   "megatron-lm-readme": megatron_core_flops_per_step}


def published_layouts(run: dict, cfg):
    """The layouts that agree with what the source publishes; the rest is searched."""
    tp, pp, cp = run["tp"], run["pp"], run.get("cp", 1)
    dp = run["gpus"] // (tp * pp * cp)
    per_stage = cfg.model.n_layer // pp
    schedules = [("1f1b", 1)] if pp == 1 else [("1f1b", 1)] + [
        ("interleaved", v) for v in range(2, max(per_stage, 1) + 1) if per_stage % v == 0 or v <= per_stage // 2]
    recomputes = [run["recompute"]] if "recompute" in run else ["none", "selective", "full"]
    micro_batches = [run["micro_batch"]] if "micro_batch" in run else MICRO_BATCHES
    for micro_batch, (schedule, v), recompute in itertools.product(micro_batches, schedules, recomputes):
        yield Layout(dp, tp, pp, cp, zero=run.get("zero", 0 if run["source"].startswith("narayanan") else 1),
                     micro_batch=micro_batch, recompute=recompute, schedule=schedule, virtual_stages=v, etp=tp,
                     tp_overlap=run.get("tp_overlap", False) and tp > 1)


def predict(run: dict, cluster: Cluster | None = None) -> dict:
    """The planner's figure for a run (module docstring): {"predicted", "published", "error", "result"}."""
    cfg = run_config(run)
    cluster = cluster or load_cluster(run["cluster"])
    attention = "unfused" if run["source"].startswith("narayanan") else None  # 2021: no flash attention
    if run["source"].startswith("narayanan"):
        run = {"recompute": "full", **run}  # Table 1 and 2 runs recompute every layer (Eq. 3 counts it)
    best = None
    for layout in published_layouts(run, cfg):
        try:
            result = estimate(cfg, layout, cluster, attention)
        except ConfigError:
            continue
        if result["fits"] and (best is None or result["step_s"] < best["step_s"]):
            best = result
    if best is None:
        raise ConfigError(f"record run {run['name']}: no layout of the published one fits on {cluster.name}")
    if "tflops" in run:
        predicted = PUBLISHED_COUNT[run["source"]](cfg) / (best["step_s"] * run["gpus"]) / 1e12
        published = run["tflops"]
    else:
        predicted, published = best["mfu"], run["mfu"]
    return {"name": run["name"], "predicted": predicted, "published": published,
            "error": predicted / published - 1, "result": best}


def mean_abs_error(runs: list, cluster_for) -> float:
    return sum(abs(predict(run, cluster_for(run))["error"]) for run in runs) / len(runs)


# the constants fitted to the calibration runs: the cluster-file keys, and the values tried (docs/planning.md)
FIT_GRID = {"matmul_efficiency": (0.55, 0.60, 0.63, 0.65, 0.68, 0.70, 0.72, 0.75, 0.80),
            "gemm_cols_half": (64.0, 128.0, 256.0, 512.0),
            "comm_overlap": (0.0, 0.25, 0.5, 0.75, 1.0),
            "inter_efficiency": (0.5, 0.6, 0.7, 0.8)}


def with_constants(cluster: Cluster, values: dict) -> Cluster:
    """cluster with the fitted keys set (inter_efficiency: the inter-node link's collective efficiency)."""
    changes = {k: v for k, v in values.items() if k != "inter_efficiency"}
    if "inter_efficiency" in values:
        changes["inter"] = replace(cluster.inter, efficiency=values["inter_efficiency"])
    return replace(cluster, **changes)


def fit(runs: list, base: Cluster, grid: dict = FIT_GRID, passes: int = 2, say=print) -> tuple[dict, float]:
    """Coordinate descent over the grid (each constant in turn set to its best value, the others held), `passes`
    times: the values with the least mean absolute relative error over `runs`, and that error."""
    values = {key: getattr(base, key) if key != "inter_efficiency" else base.inter.efficiency for key in grid}
    error = mean_abs_error(runs, lambda run: with_constants(base, values))
    for _ in range(passes):
        for key, tried in grid.items():
            for value in tried:
                trial = {**values, key: value}
                trial_error = mean_abs_error(runs, lambda run, t=trial: with_constants(base, t))
                if trial_error < error:
                    values, error = trial, trial_error
            say(f"  {key} = {values[key]}: mean |error| {100 * error:.1f}%")
    return values, error


def table(record: dict) -> str:
    lines = [f"{'set':<12} {'run':<18} {'predicted':>10} {'published':>10} {'error':>7}  layout"]
    for kind, runs in record.items():
        errors = []
        for run in runs:
            found = predict(run)
            errors.append(abs(found["error"]))
            lines.append(f"{kind:<12} {found['name']:<18} {found['predicted']:>10.3f} {found['published']:>10.3f} "
                         f"{100 * found['error']:>+6.1f}%  {found['result']['name']}")
        lines.append(f"{kind}: mean |error| {100 * sum(errors) / len(errors):.1f}% over {len(errors)} runs")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", metavar="CLUSTER", nargs="?", const="a100",
                        help="grid-search the fitted constants on CLUSTER's calibration runs (a100 or h100)")
    args = parser.parse_args(argv)
    try:
        record = load_record()
    except ConfigError as exc:  # an unreadable record file: its one line, exit status 1
        parser.exit(1, f"{exc}\n")
    if args.fit:
        runs = [run for run in record["calibration"] if run["cluster"] == args.fit]
        if not runs:  # a user's mistake: argparse's one line and exit status 2, no traceback
            fitted = sorted({run["cluster"] for run in record["calibration"]})
            parser.error(f"--fit {args.fit}: {RECORD} has no calibration run on that cluster (it has: "
                         f"{', '.join(fitted)})")
        values, error = fit(runs, load_cluster(args.fit))
        print(f"fitted on {len(runs)} {args.fit} runs: {values}, mean |error| {100 * error:.1f}%")
        return
    print(table(record))


if __name__ == "__main__":
    main()
