#!/usr/bin/env python
"""`mpitrain plan` against the clock: predicted vs measured step time for a few layouts on 2 local ranks.

    OMP_NUM_THREADS=1 python benchmarks/bench_plan.py [--config configs/bench-small.toml] [--steps 5]

The cluster is configs/clusters/this-machine.toml (written first by `mpitrain plan calibrate -n 2` when missing).
Each layout runs `mpitrain bench step` under mpiexec -n 2 (median of --steps timed steps); the plan's prediction for
the same layout is printed beside it with the ratio, and the predicted per-rank bytes. Nothing is asserted (clock
readings belong here, not in tests); the last line is one JSON object with every number.
"""
from __future__ import annotations

import argparse
import json
import os

from bench_parallel import run  # the same 2-rank `bench step` runner (run as a script: benchmarks/ is on sys.path)

from mpitrain.config import load_config
from mpitrain.plan.clusters import CLUSTER_DIR, calibrate, load_cluster
from mpitrain.plan.cost import Layout, estimate

LAYOUTS = {
    "dp2": Layout(dp=2, tp=1, pp=1, zero=0, micro_batch=4),
    "dp2-zero1": Layout(dp=2, tp=1, pp=1, zero=1, micro_batch=4),
    "dp2-zero3": Layout(dp=2, tp=1, pp=1, zero=3, micro_batch=4),
    "tp2": Layout(dp=1, tp=2, pp=1, zero=0, micro_batch=4),
    "pp2-1f1b": Layout(dp=1, tp=1, pp=2, zero=0, micro_batch=2, schedule="1f1b"),
    "dp2-full-recompute": Layout(dp=2, tp=1, pp=1, zero=1, micro_batch=4, recompute="full"),
}


def overrides(layout: Layout) -> list[str]:
    return [f"parallel.dp={layout.dp}", f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}",
            f"parallel.zero={layout.zero}", f"train.micro_batch={layout.micro_batch}",
            f"parallel.sequence_parallel={'true' if layout.tp > 1 else 'false'}",
            f"parallel.schedule=\"{layout.schedule}\"", f"memory.recompute=\"{layout.recompute}\""]


def measure(config: str, layout: Layout, steps: int) -> dict:
    return run(config, overrides(layout), steps, timeout=900)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench-small.toml")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if not (CLUSTER_DIR / "this-machine.toml").is_file():
        calibrate(CLUSTER_DIR / "this-machine.toml", 2)
    cluster = load_cluster("this-machine")
    base = load_config(args.config)
    print(f"{'layout':<20} {'predicted ms':>12} {'measured ms':>12} {'ratio':>6} {'bytes/rank':>11}  bottleneck")
    rows = {}
    for name, layout in LAYOUTS.items():
        predicted = estimate(base, layout, cluster)
        measured = measure(args.config, layout, args.steps)
        ratio = predicted["step_s"] / measured["step_time_s"]
        rows[name] = {"predicted_s": predicted["step_s"], "measured_s": measured["step_time_s"], "ratio": ratio,
                      "predicted_bytes": predicted["memory"]["held"], "parts": predicted["parts"]}
        print(f"{name:<20} {1000 * predicted['step_s']:12.1f} {1000 * measured['step_time_s']:12.1f} {ratio:6.2f} "
              f"{predicted['memory']['held'] / 2**20:9.1f}Mi  {predicted['bottleneck']}", flush=True)
    print(json.dumps({"cluster": cluster.name, "layouts": rows, "load": os.getloadavg()}))


if __name__ == "__main__":
    main()
