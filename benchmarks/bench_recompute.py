#!/usr/bin/env python
"""Activation recomputation: step time and saved activations of memory.recompute = none | selective | full.

    python benchmarks/bench_recompute.py [--config configs/bench-small.toml] [--steps 4] [--warmup 1] [--rounds 3]

Each round runs `python -m mpitrain bench step CONFIG --set memory.recompute=MODE` for the three modes, interleaved
(none selective full, then reversed, ...) because the machine is noisy, one process each with 1 thread (exact thread
counts). Step time is 1 / tokens per second of a run's median step; the headline is each mode's best round (noise
only slows a run down), printed side by side as ratios to none, with the activation bytes of one micro-batch that
`mpitrain memory` declares (tests/test_recompute.py checks that declaration against the arrays really saved).
The last line is one JSON object with every number.

Expect full/none a little under 4/3: full runs each block's forward twice, and a forward is about a third of a
block's training FLOPs (the chapter's +30%); the head and embedding are not recomputed. selective recomputes only
the attention core and the nonlinearity, a few percent at T = 256.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "selective", "full")
THREADS = dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1")


def run_mode(config: str, mode: str, steps: int, warmup: int) -> float:
    """Seconds per training step (`step_time_s` of one `mpitrain bench step` process)."""
    command = [sys.executable, "-m", "mpitrain", "bench", "step", config, "--steps", str(steps), "--warmup",
               str(warmup), "--set", f"memory.recompute={mode}"]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **THREADS},
                         timeout=900)
    if out.returncode != 0:
        sys.exit(f"bench step with memory.recompute = {mode} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["step_time_s"]


def activation_bytes_of(config: str, mode: str) -> int:
    from mpitrain.config import load_config
    from mpitrain.plan.memory import activation_bytes
    return activation_bytes(load_config(config, [f"memory.recompute={mode}"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--config", default="configs/bench-small.toml")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        order = MODES if round_index % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            times[mode].append(run_mode(args.config, mode, args.steps, args.warmup))
    best = {mode: min(values) for mode, values in times.items()}
    median = {mode: statistics.median(values) for mode, values in times.items()}
    saved = {mode: activation_bytes_of(args.config, mode) for mode in MODES}
    print(f"{'mode':<10} {'step (best)':>12} {'/ none':>7} {'median / none':>14} {'activations':>13} {'/ none':>7}")
    for mode in MODES:
        mib, saved_ratio = saved[mode] / 2**20, saved[mode] / saved["none"]
        print(f"{mode:<10} {best[mode]:>10.3f} s {best[mode] / best['none']:>7.3f} "
              f"{median[mode] / median['none']:>14.3f} {mib:>9.2f} MiB {saved_ratio:>7.3f}")
    print(json.dumps({"config": args.config, "seconds_per_step": times, "best": best,
                      "ratio_best": {m: best[m] / best["none"] for m in MODES},
                      "ratio_median": {m: median[m] / median["none"] for m in MODES},
                      "activation_bytes": saved, "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
