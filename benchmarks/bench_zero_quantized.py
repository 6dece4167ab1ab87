"""Quantized ZeRO-3 communication (parallel.zero_gather_dtype / zero_grad_reduce) beside the exact run: the error it
costs after N steps and the bytes it saves, measured on 4 ranks in one MPI job.

    python benchmarks/bench_zero_quantized.py [--config configs/tiny.toml] [--steps 20] [--compute float32]
                                              [--set optim.name=sgd ...]

For each wire format: the largest relative loss difference over the steps, the last step's, the relative norm of the
master weights' difference after the last step, and the bytes one rank sends per step (all-gathers, gradient
reduction) as a fraction of the exact run's. Synthetic data (the batch a function of the step), so every run sees the
same batches. Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = [("same", "exact"), ("int8", "exact"), ("fp8", "exact"), ("same", "int8"), ("same", "int4"),
         ("fp8", "int8"), ("int8", "int4")]


def measure(config: str, steps: int, compute: str, block: int, settings: list[str]) -> dict:
    """Runs inside the MPI job: every mode's losses, master weights and bytes, compared on rank 0."""
    import numpy as np
    from mpi4py import MPI

    from mpitrain.config import load_config
    from mpitrain.train import Trainer

    world, rows, exact = MPI.COMM_WORLD, {}, None
    for gather, grads in MODES:
        cfg = load_config(config, ["data.synthetic=true", "logging.peak_flops=1e9", "parallel.zero=3",
                                   "train.global_batch=16", "train.micro_batch=2", f"precision.compute={compute}",
                                   f"train.steps={steps}", f"parallel.zero_gather_dtype={gather}",
                                   f"parallel.zero_grad_reduce={grads}", f"parallel.zero_quant_block={block}",
                                   *settings])
        trainer = Trainer(cfg, world)
        losses = [trainer.train_step(step).loss for step in range(steps)]
        sent = trainer.state.group.counters()
        params = np.concatenate([s.params for s in trainer.state.optimizer_segments()]).astype(np.float64)
        exact = exact or (losses, params, sent)
        loss_errors = [abs(a - b) / abs(b) for a, b in zip(losses, exact[0])]
        difference = world.allreduce(float(np.sum((params - exact[1]) ** 2)))
        norm = world.allreduce(float(np.sum(exact[1] ** 2)))
        exact_reduce = exact[2]["reduce_scatter"]
        rows[f"{gather}/{grads}"] = {
            "max_loss_error": max(loss_errors), "last_loss_error": loss_errors[-1],
            "param_error": (difference / norm) ** 0.5,
            "gather_fraction": sent["all_gather"] / exact[2]["all_gather"],
            "reduce_fraction": (sent["reduce_scatter"] + sent["all_to_all"]) / exact_reduce}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compute", default="float32")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], help="more config overrides, e.g. optim.name=sgd")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # set on the MPI job's ranks
    args = parser.parse_args()
    if args.inside:
        rows = measure(args.config, args.steps, args.compute, args.block, args.set)
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == 0:
            print(json.dumps(rows))
        return
    from mpitrain.launcher import find_mpiexec
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "PYTHONPATH": str(REPO)}
    command = [find_mpiexec(), "-n", str(args.ranks), sys.executable, __file__, "--inside", "--config", args.config,
               "--steps", str(args.steps), "--compute", args.compute, "--block", str(args.block),
               *(f"--set={setting}" for setting in args.set)]
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{out.stderr}")
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{args.ranks} ranks, ZeRO-3, {args.compute}, {args.steps} steps, blocks of {args.block}, {args.config}",
          *args.set)
    print(f"{'gather/grads':<13} {'max loss err':>12} {'last loss err':>13} {'param err':>10} {'gather bytes':>12} "
          f"{'grad bytes':>10}")
    for mode, row in rows.items():
        print(f"{mode:<13} {row['max_loss_error']:12.2e} {row['last_loss_error']:13.2e} {row['param_error']:10.2e} "
              f"{row['gather_fraction']:12.3f} {row['reduce_fraction']:10.3f}")
    print(json.dumps({"ranks": args.ranks, "steps": args.steps, "compute": args.compute, "settings": args.set,
                      "rows": rows}))


if __name__ == "__main__":
    main()
