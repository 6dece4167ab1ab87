"""Side-by-side step times of parallel layouts on 2 ranks (1 BLAS thread each), measured in one run.

    python benchmarks/bench_parallel.py [--config configs/bench-small.toml] [--rounds 3]

Prints, for each layout, the best and median tokens/s over interleaved rounds, then the ratios the issues ask for:
ZeRO-3 step time / plain DP step time at dp = 2 (target <= 1.15), and the share of the step a tp = 2 rank spends in
tensor-parallel collectives. Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from mpitrain.launcher import find_mpiexec

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {
    "dp2": [],
    "dp2-zero1": ["parallel.zero=1"],
    "dp2-zero2": ["parallel.zero=2"],
    "dp2-zero3": ["parallel.zero=3"],
    "tp2": ["parallel.tp=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
}


def run(config: str, overrides: list[str], steps: int, timeout: float = 600) -> dict:
    """`mpitrain bench step` on 2 ranks of 1 BLAS thread each; its last line (one JSON object), parsed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [find_mpiexec(), "-n", "2", sys.executable, "-m", "mpitrain", "bench", "step", config,
               "--steps", str(steps)]
    for setting in overrides:
        command += ["--set", setting]
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench-small.toml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    names = list(LAYOUTS)
    for round_index in range(args.rounds):  # interleave, alternating the order: drift hits every layout alike
        for name in names if round_index % 2 == 0 else reversed(names):
            results[name].append(run(args.config, ["train.global_batch=16", *LAYOUTS[name]], args.steps))
            print(f"round {round_index + 1}: {name:<10} {results[name][-1]['tokens_per_s']:8.0f} tok/s", flush=True)
    print(f"\n{'layout':<10} {'best tok/s':>11} {'median':>9} {'step ms':>8} {'MFU':>6} {'tp comm':>8}")
    summary = {}
    for name, runs in results.items():
        best = max(runs, key=lambda r: r["tokens_per_s"])
        median = statistics.median(r["tokens_per_s"] for r in runs)
        summary[name] = {"best_tokens_per_s": best["tokens_per_s"], "median_tokens_per_s": median,
                         "step_time_s": best["step_time_s"], "mfu": best["mfu"],
                         "tp_comm_share": best["tp_comm_share"], "comm_bytes_per_step": best["comm_bytes_per_step"]}
        print(f"{name:<10} {best['tokens_per_s']:11.0f} {median:9.0f} {1000 * best['step_time_s']:8.0f} "
              f"{100 * best['mfu']:5.1f}% {100 * best['tp_comm_share']:7.1f}%")
    zero3_ratio = summary["dp2"]["best_tokens_per_s"] / summary["dp2-zero3"]["best_tokens_per_s"]
    print(f"\nZeRO-3 / DP step time at dp = 2: {zero3_ratio:.3f}  (target <= 1.15)")
    for name in ("tp2", "tp2-sp"):
        print(f"{name}: step {1000 * summary[name]['step_time_s']:.0f} ms, "
              f"{100 * summary[name]['tp_comm_share']:.1f}% of it in tensor-parallel collectives")
    print(json.dumps({"layouts": summary, "zero3_over_dp_step_time": zero3_ratio, "load": os.getloadavg()}))


if __name__ == "__main__":
    main()
