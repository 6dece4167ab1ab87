"""Checkpoint save speed against the raw write speed of the same disk, and the training stall of async saving.

    python benchmarks/bench_checkpoint.py [--d-model 512 --layers 8] [--dir /tmp/mpitrain-bench-ckpt]
    mpiexec -n 2 python benchmarks/bench_checkpoint.py --zero 3      # per-rank numbers with 2 writers

Measured in one run, on each rank: (1) raw speed: numpy bytes written with one write() + fsync, as large as this
rank's shard file; (2) a synchronous checkpoint save (write, fsync, SHA-256, commit); (3) an asynchronous save: the
time the training loop is held up (host copies + thread start), and the slowdown of the steps that run while the
writer works, against (2). Prints ratios and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from mpitrain.config import load_config
from mpitrain.train import Trainer


def raw_write_speed(directory: Path, nbytes: int) -> float:
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    path = directory / f"raw-{MPI.COMM_WORLD.rank}.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return nbytes / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--dir", default="/tmp/mpitrain-bench-ckpt")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    directory = Path(args.dir)
    if world.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    world.Barrier()
    cfg = load_config("configs/bench-small.toml", [
        "data.synthetic=true", f"model.d_model={args.d_model}", f"model.n_layer={args.layers}", "model.seq_len=64",
        f"parallel.zero={args.zero}", "train.micro_batch=1", f"train.global_batch={world.size}",
        "logging.peak_flops=1e9", "train.steps=100"])
    trainer = Trainer(cfg, world)
    manager = trainer.checkpoint_manager(directory / "checkpoints", keep=0, echo=lambda text: None)
    step_times = [trainer.train_step(s).seconds for s in range(3)]
    plain_step = statistics.median(step_times)

    world.Barrier()
    start = time.perf_counter()
    manager.save(3)
    sync_seconds = time.perf_counter() - start
    shard = directory / "checkpoints" / "step_00000003" / f"rank_{world.rank:05d}.h5"
    shard_bytes = shard.stat().st_size
    raw = raw_write_speed(directory, max(shard_bytes, 1 << 20))
    save_speed = shard_bytes / sync_seconds

    world.Barrier()
    start = time.perf_counter()
    manager.save_async(4)
    held_up = time.perf_counter() - start
    extra, steps_during = 0.0, 0
    while manager._pending is not None:  # train on while the writer works; commit when all writers are done
        step_start = time.perf_counter()
        trainer.train_step(4 + steps_during)
        manager.poll()
        extra += (time.perf_counter() - step_start) - plain_step
        steps_during += 1
    stall = held_up + max(0.0, extra)
    results = world.gather({"rank": world.rank, "shard_bytes": shard_bytes, "raw_bytes_per_s": raw,
                            "save_bytes_per_s": save_speed, "sync_save_s": sync_seconds, "async_held_up_s": held_up,
                            "async_extra_step_s": extra, "steps_during_async": steps_during,
                            "async_stall_over_sync": stall / sync_seconds})
    if world.rank == 0:
        for r in results:
            print(f"rank {r['rank']}: shard {r['shard_bytes'] / 2**20:.1f} MiB | raw write "
                  f"{r['raw_bytes_per_s'] / 2**20:.0f} MiB/s | checkpoint save {r['save_bytes_per_s'] / 2**20:.0f} "
                  f"MiB/s ({r['save_bytes_per_s'] / r['raw_bytes_per_s']:.2f} of raw; target >= 0.5) | sync save "
                  f"{r['sync_save_s']:.2f} s | async: loop held {r['async_held_up_s'] * 1000:.0f} ms, steps slowed "
                  f"{r['async_extra_step_s'] * 1000:.0f} ms over {r['steps_during_async']} steps -> stall "
                  f"{100 * r['async_stall_over_sync']:.1f}% of a sync save (target < 10%)")
        print(json.dumps({"ranks": results, "plain_step_s": plain_step}))
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
