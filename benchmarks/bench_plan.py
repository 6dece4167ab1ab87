#!/usr/bin/env python
"""`mpitrain plan` against the clock: predicted vs measured step time of 13 layouts on 2 local ranks.

    OMP_NUM_THREADS=1 python benchmarks/bench_plan.py [--config configs/bench-small.toml] [--steps 3] [--rounds 2]
                                                      [--only a,b] [--no-calibrate]

The cluster is this machine: each of --rounds rounds runs `mpitrain plan calibrate -n 2` and then every layout
(alternating order, so that a burst of load from other processes hits different layouts); other processes only ever
slow a run down, so the quietest calibration (the most matmul FLOP/s reached in a step) is kept, written to
configs/clusters/this-machine.toml, and a layout's measured time is its fastest round; `spread` is its slowest round
over its fastest, the noise the ratio carries (--no-calibrate: use the file there). Each layout runs
`mpitrain bench step` under mpiexec -n 2 (median of --steps timed steps, after 2 warm-up steps). The plan's
prediction for the same layout is printed beside it with the ratio predicted / measured and the predicted per-rank
bytes (the fuller pipeline stage). The layouts cover data parallelism at ZeRO 0-3, tensor parallelism, each
pipeline schedule, context and expert parallelism, full recomputation and optimizer offload.
Nothing is asserted (clock readings belong here, not in tests); the last line counts the layouts within 15%.

    python benchmarks/bench_plan.py --search [--before REV]

times the search itself instead, side by side: `mpitrain plan` of a few models as of git revision REV (default
c76a0c1, before the search was profiled: a rank's MoE note built the whole model once per evaluated layout) and as
now, and now without pruning (search(prune=False)); CPU seconds of one process each (now: the faster of two runs).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from bench_parallel import run  # the same 2-rank `bench step` runner (run as a script: benchmarks/ is on sys.path)

from mpitrain.config import load_config
from mpitrain.plan.calibrate import calibrate
from mpitrain.plan.clusters import CLUSTER_DIR, load_cluster
from mpitrain.plan.cost import Layout, estimate

COMMUNICATION = ("tp", "cp_ring", "ep_all_to_all", "pp_send", "zero_exposed", "dp_reduce")
MOE = ["model.moe={experts = 4, top_k = 2}"]
# name -> (Layout on 2 ranks, the base config's keys it needs). global batch 8: micro-batch 4 on dp 2 is one
# micro-batch per rank; micro-batch 2 on pp 2 is four, the fewest that every schedule (interleaved too) accepts.
LAYOUTS = {
    "dp2-zero0": (Layout(dp=2, tp=1, pp=1, zero=0, micro_batch=4), []),
    "dp2-zero1": (Layout(dp=2, tp=1, pp=1, zero=1, micro_batch=4), []),
    "dp2-zero2": (Layout(dp=2, tp=1, pp=1, zero=2, micro_batch=4), []),
    "dp2-zero3": (Layout(dp=2, tp=1, pp=1, zero=3, micro_batch=4), []),
    "tp2": (Layout(dp=1, tp=2, pp=1, zero=0, micro_batch=4), []),
    "pp2-gpipe": (Layout(dp=1, tp=1, pp=2, zero=0, micro_batch=2, schedule="gpipe"), []),
    "pp2-1f1b": (Layout(dp=1, tp=1, pp=2, zero=0, micro_batch=2, schedule="1f1b"), []),
    "pp2-zb1p": (Layout(dp=1, tp=1, pp=2, zero=0, micro_batch=2, schedule="zb1p"), []),
    "pp2-interleaved": (Layout(dp=1, tp=1, pp=2, zero=0, micro_batch=2, schedule="interleaved",
                               virtual_stages=2), []),
    "cp2": (Layout(dp=1, tp=1, pp=1, cp=2, zero=1, micro_batch=4), []),
    "ep2-moe": (Layout(dp=2, tp=1, pp=1, ep=2, zero=0, micro_batch=4), MOE),
    "dp2-full-recompute": (Layout(dp=2, tp=1, pp=1, zero=1, micro_batch=4, recompute="full"), []),
    "dp2-offload-disk": (Layout(dp=2, tp=1, pp=1, zero=1, micro_batch=4, offload="disk"), []),
}


def overrides(layout: Layout) -> list[str]:
    return [f"parallel.{key}={getattr(layout, key)}" for key in ("dp", "tp", "pp", "cp", "ep", "zero",
                                                                  "virtual_stages")] + [
        f"train.micro_batch={layout.micro_batch}", f"parallel.sequence_parallel={'true' if layout.tp > 1 else 'false'}",
        f"parallel.schedule=\"{layout.schedule}\"", f"memory.recompute=\"{layout.recompute}\"",
        f"memory.offload=\"{layout.offload}\""]


SEARCHES = (("mixtral-8x7b", "h100", 16), ("llama3-70b", "h100", 64), ("llama3-405b", "h100", 8192))
# the same search without pruning, called directly (the command has no switch for it)
PRUNE_OFF = ("import sys; from mpitrain.plan.presets import model_config; from mpitrain.plan.clusters import "
             "load_cluster; from mpitrain.plan.search import search; model, cluster, gpus = ARGV[1], ARGV[2], "
             "int(ARGV[4]); cfg, _ = model_config(model); found = search(cfg, load_cluster(cluster), gpus, "
             "prune=False); print(len(found['fits']) + len(found['too_big']), 'evaluated')")


def search_seconds(argv: list[str], pythonpath: str, prune: bool = True) -> tuple[float, str]:
    """CPU seconds (user + system, this process's child) of one `mpitrain plan` and its first line."""
    import resource
    import subprocess
    import sys
    command = [sys.executable, "-m", "mpitrain.cli", *argv] if prune else \
        [sys.executable, "-c", PRUNE_OFF.replace("ARGV", repr(argv))]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": pythonpath},
                          cwd=pythonpath, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        return float("nan"), done.stderr.strip().splitlines()[-1]
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return cpu, done.stdout.splitlines()[0]


def bench_search(before: str) -> None:
    """The search's time as of `before` and now, side by side (module docstring)."""
    import subprocess
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as old_tree:
        archive = subprocess.run(["git", "archive", before], capture_output=True, cwd=repo, check=True).stdout
        subprocess.run(["tar", "-x", "-C", old_tree], input=archive, check=True)
        print(f"{'search':<32} {'before s':>9} {'now s':>8} {'no prune s':>10} {'speed-up':>8}  evaluated (now)")
        for model, cluster, gpus in SEARCHES:
            argv = ["plan", model, cluster, "--gpus", str(gpus), "--top", "1"]
            old = search_seconds(argv, old_tree)[0]
            now, line = min((search_seconds(argv, str(repo)) for _ in range(2)), key=lambda pair: pair[0])
            unpruned = search_seconds(argv, str(repo), prune=False)[0]
            evaluated = line.split(": ", 1)[-1].split(" evaluated")[0]
            print(f"{model} x {gpus:<18} {old:>9.1f} {now:>8.1f} {unpruned:>10.1f} {old / now:>7.1f}x  {evaluated}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--search", action="store_true", help="time the search, before and now (docstring)")
    parser.add_argument("--before", default="c76a0c1", help="--search: the git revision to compare with")
    parser.add_argument("--config", default="configs/bench-small.toml")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    parser.add_argument("--no-calibrate", action="store_true", help="reuse configs/clusters/this-machine.toml")
    args = parser.parse_args()
    if args.search:
        bench_search(args.before)
        return
    calibrate_each_round = args.no_calibrate is False or not (CLUSTER_DIR / "this-machine.toml").is_file()
    names = args.only.split(",") if args.only else list(LAYOUTS)
    measured: dict[str, list[float]] = {name: [] for name in names}
    fastest: dict[str, dict] = {}  # the fastest round's whole report (its breakdown)
    quietest = (0.0, "")
    with tempfile.TemporaryDirectory() as offload_dir:
        for round_index in range(args.rounds):
            if calibrate_each_round:
                path = Path(offload_dir) / f"calibration-{round_index}.toml"
                numbers = calibrate(path, 2)
                quietest = max(quietest, (numbers["peak_flops"] * numbers["matmul_efficiency"], path.read_text()))
            for name in names if round_index % 2 == 0 else reversed(names):
                layout, extra = LAYOUTS[name]
                settings = overrides(layout) + extra + [f"memory.offload_dir=\"{offload_dir}\""]
                report = run(args.config, settings, args.steps, timeout=900)
                measured[name].append(report["step_time_s"])
                if report["step_time_s"] <= min(measured[name]):
                    fastest[name] = report
                print(f"round {round_index + 1}: {name:<20} {1000 * measured[name][-1]:8.1f} ms", flush=True)
    if calibrate_each_round:
        (CLUSTER_DIR / "this-machine.toml").write_text(quietest[1])
    cluster = load_cluster("this-machine")
    print(f"\n{'layout':<20} {'predicted ms':>12} {'measured ms':>12} {'ratio':>6} {'spread':>6} {'bytes/rank':>11}"
          "  bottleneck")
    rows = {}
    for name in names:
        layout, extra = LAYOUTS[name]
        predicted = estimate(load_config(args.config, extra), layout, cluster)
        best = min(measured[name])
        ratio = predicted["step_s"] / best
        rows[name] = {"predicted_s": predicted["step_s"], "measured_s": best, "rounds_s": measured[name],
                      "ratio": ratio, "predicted_bytes": predicted["memory"]["held"], "parts": predicted["parts"]}
        print(f"{name:<20} {1000 * predicted['step_s']:12.1f} {1000 * best:12.1f} {ratio:6.2f} "
              f"{max(measured[name]) / best:6.2f} {predicted['memory']['held'] / 2**20:9.1f}Mi  "
              f"{predicted['bottleneck']}", flush=True)
    print(f"\nparts of the step, predicted / measured ms (the fastest round's breakdown, max over ranks):\n"
          f"{'layout':<20} {'compute':>15} {'communication':>15} {'bubble':>13} {'optimizer':>13}")
    for name in names:
        predicted, parts = rows[name]["parts"], fastest[name].get("breakdown") or {}
        pairs = [(predicted["matmul"] + predicted["elementwise"] + predicted["overhead"],
                  sum(parts.get(k, 0.0) for k in ("forward", "backward_input", "backward_weight"))),
                 (sum(predicted[k] for k in COMMUNICATION), sum(v for k, v in parts.items() if k.startswith("comm."))),
                 (predicted["bubble"], parts.get("pipeline_bubble", 0.0)),
                 (predicted["optimizer"], parts.get("optimizer", 0.0))]
        print(f"{name:<20} " + " ".join(f"{1000 * a:.0f}/{1000 * b:.0f}".rjust(width)
                                         for width, (a, b) in zip((15, 15, 13, 13), pairs)))
    within = sum(abs(row["ratio"] - 1) <= 0.15 for row in rows.values())
    print(json.dumps({"cluster": cluster.name, "layouts": rows, "load": os.getloadavg()}))
    ratios = sorted(row["ratio"] for row in rows.values())
    print(f"within 15%: {within} of {len(rows)} layouts (ratios {ratios[0]:.2f}-{ratios[-1]:.2f}, "
          f"load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
