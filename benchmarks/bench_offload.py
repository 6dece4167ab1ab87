#!/usr/bin/env python
"""Offloading's cost, side by side: memory.offload = none against disk (memory-mapped files streamed in chunks).

    python benchmarks/bench_offload.py [--config configs/bench-small.toml] [--compute bfloat16] [--rounds 3]

Two measurements, each variant in its own subprocess, interleaved in rounds (A B, then B A, ...; the machine is
noisy: each variant's best round is the headline, the median is in the JSON):
  1. the optimizer step alone (AdamW over the config's parameter count, fp32 master + moments): in memory against
     streamed from the files, at the configured chunk size;
  2. whole training steps (`python -m mpitrain bench step`, 1 rank), none against disk.
The slowdown is disk / none of the time. The files are written through the page cache: with enough free memory the
kernel keeps them there, so this measures the streaming copies, not a disk's bandwidth (which a real run pays when
the state is larger than free memory). The last line printed is one JSON object with every number.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker_optimizer(config: str, compute: str, offload: str, chunk_mb: float, steps: int) -> dict:
    """Median seconds of AdamW steps over this config's parameters (master weights and moments as a run keeps them)."""
    import numpy as np

    from mpitrain.backend import make_backend
    from mpitrain.config import load_config
    from mpitrain.model.gpt import GPT
    from mpitrain.optim.adamw import AdamW, AdamWHyper
    from mpitrain.state.offload import make_placement
    from mpitrain.state.replicated import ReplicatedState

    cfg = load_config(config, [f"memory.offload={offload}", f"memory.offload_chunk_mb={chunk_mb}"])
    backend = make_backend("cpu", compute)
    model = GPT(cfg.model, backend)
    with tempfile.TemporaryDirectory() as scratch:
        placement = make_placement(cfg.memory, "adamw", backend, 0, Path(scratch))
        state = ReplicatedState(model.layouts, backend, 0, placement=placement)
        state.grads.data[...] = np.random.default_rng(0).standard_normal(state.grads.size).astype(backend.dtype)
        optimizer = AdamW(state.optimizer_segments(), AdamWHyper(), placement=placement)
        times = []
        for _ in range(steps + 1):  # the first step faults the files' pages in: not timed
            start = time.perf_counter()
            optimizer.step(1e-3)
            state.after_step()
            times.append(time.perf_counter() - start)
        return {"seconds": statistics.median(times[1:]), "n_params": model.n_params,
                "moved_bytes": getattr(placement, "moved_nbytes", 0)}


def run_worker(args: list[str], threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
    out = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/bench-small.toml")
    parser.add_argument("--compute", default="bfloat16", help="bfloat16: fp32 master + moments move (12 B/param)")
    parser.add_argument("--chunk-mb", type=float, default=16.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "OFFLOAD"), help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        print(json.dumps(worker_optimizer(a.config, a.compute, a.worker[1], a.chunk_mb, a.steps)))
        return
    scratch = tempfile.mkdtemp(prefix="bench-offload-")
    variants = {}
    for offload in ("none", "disk"):
        variants[f"optimizer_{offload}"] = [sys.executable, __file__, "--config", a.config, "--compute", a.compute,
                                            "--chunk-mb", str(a.chunk_mb), "--steps", str(a.steps),
                                            "--worker", "optimizer", offload]
        variants[f"train_step_{offload}"] = [
            sys.executable, "-m", "mpitrain", "bench", "step", a.config, "--steps", str(a.steps),
            "--set", f"precision.compute={a.compute}", "--set", f"memory.offload={offload}",
            "--set", f"memory.offload_dir={scratch}", "--set", f"memory.offload_chunk_mb={a.chunk_mb}"]
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    extra = {}
    for round_index in range(a.rounds):
        order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
        for name in order:
            result = run_worker(variants[name], a.threads)
            seconds[name].append(result.get("seconds", result.get("step_time_s")))
            extra.setdefault("n_params", result.get("n_params"))
            if result.get("moved_bytes"):
                extra["moved_bytes"] = result["moved_bytes"]
    best = {name: min(values) for name, values in seconds.items()}
    print(f"{a.config}, {a.compute}, {extra.get('n_params'):,} parameters, {extra.get('moved_bytes', 0):,} bytes "
          f"offloaded, chunks of {a.chunk_mb} MB, {a.threads} threads, best of {a.rounds} rounds:")
    print(f"  {'':<12} {'none':>10} {'disk':>10} {'slowdown':>9}")
    ratios = {}
    for kind in ("optimizer", "train_step"):
        none, disk = best[f"{kind}_none"], best[f"{kind}_disk"]
        ratios[kind] = disk / none
        print(f"  {kind:<12} {none * 1e3:>8.1f}ms {disk * 1e3:>8.1f}ms {ratios[kind]:>8.2f}x")
    print(json.dumps({"config": a.config, "compute": a.compute, "chunk_mb": a.chunk_mb, "threads": a.threads,
                      "seconds": seconds, "best": best, "slowdown": ratios, **extra,
                      "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
