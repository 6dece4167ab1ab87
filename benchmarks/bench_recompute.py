#!/usr/bin/env python
"""Activation recomputation: time and saved activations of memory.recompute = none | selective | full.

    OMP_NUM_THREADS=1 python benchmarks/bench_recompute.py [--config configs/bench-small.toml] [--rounds 5]

One process, one model (float32), one micro-batch of the config: each round times forward + backward once per mode,
the modes interleaved (none selective full, then reversed, ...) because the machine is noisy; the headline is each
mode's best round (noise only slows a run down), the median ratio beside it. The optimizer step is left out: it is
the same in every mode (add it to both sides of a ratio to get a whole step's). Also timed: the forward alone (of
none), whose share of forward + backward is what full recomputation should add. Printed beside: the saved
activations of one micro-batch, measured on the arrays really saved (backend.nbytes_of), as ratios to none. The
last line is one JSON object with every number.

The chapter's +30% for full assumes the forward is a third of forward + backward (its FLOPs are); selective adds only
the attention core (two T x T matmuls per head and the softmax) and the MLP nonlinearity.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from mpitrain.backend import make_backend, nbytes_of
from mpitrain.config import load_config
from mpitrain.layers.recompute import RECOMPUTE_MODES, apply_recompute
from mpitrain.model.gpt import GPT
from mpitrain.state.replicated import ReplicatedState


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--config", default="configs/bench-small.toml")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cfg = load_config(args.config)
    backend = make_backend("cpu", "float32")
    model = GPT(cfg.model, backend)
    state = ReplicatedState(model.layouts, backend, cfg.train.seed)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_len))
    times: dict[str, list[float]] = {mode: [] for mode in (*RECOMPUTE_MODES, "forward")}
    saved_bytes = {}
    for round_index in range(args.rounds + 1):  # round 0 warms up (allocator, BLAS) and is not counted
        order = RECOMPUTE_MODES if round_index % 2 == 0 else tuple(reversed(RECOMPUTE_MODES))
        for mode in order:
            apply_recompute(model, mode)
            start = time.perf_counter()
            _, saved = model.forward(state, tokens, tokens)
            forward_seconds = time.perf_counter() - start
            saved_bytes[mode] = nbytes_of(saved)
            model.backward(state, saved, 1.0 / tokens.size)
            if round_index:
                times[mode].append(time.perf_counter() - start)
                if mode == "none":
                    times["forward"].append(forward_seconds)
    best = {mode: min(values) for mode, values in times.items()}
    median = {mode: statistics.median(values) for mode, values in times.items()}
    print(f"{args.config}: micro-batch {cfg.train.micro_batch} x {cfg.model.seq_len} tokens, float32, "
          f"{os.environ.get('OMP_NUM_THREADS', 'all')} thread(s); forward + backward per mode")
    print(f"{'mode':<10} {'best':>9} {'/ none':>7} {'median / none':>14} {'activations':>13} {'/ none':>7}")
    for mode in RECOMPUTE_MODES:
        mib, saved_ratio = saved_bytes[mode] / 2**20, saved_bytes[mode] / saved_bytes["none"]
        print(f"{mode:<10} {best[mode]:>7.3f} s {best[mode] / best['none']:>7.3f} "
              f"{median[mode] / median['none']:>14.3f} {mib:>9.2f} MiB {saved_ratio:>7.3f}")
    print(f"forward alone (none): {best['forward']:.3f} s = {best['forward'] / best['none']:.3f} of forward + backward")
    print(json.dumps({"config": args.config, "seconds": times, "best": best,
                      "ratio_best": {m: best[m] / best["none"] for m in RECOMPUTE_MODES},
                      "ratio_median": {m: median[m] / median["none"] for m in RECOMPUTE_MODES},
                      "forward_share": best["forward"] / best["none"], "activation_bytes": saved_bytes,
                      "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
