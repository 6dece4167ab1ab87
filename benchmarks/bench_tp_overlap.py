"""Exposed tensor-parallel communication and step time with and without parallel.tp_overlap, side by side.

    mpiexec -n 2 python benchmarks/bench_tp_overlap.py [--latency 0.02] [--seq 512 --d-model 512 --d-ff 2048]

One MLP pair under sequence parallelism (a column-parallel up projection, a row-parallel down projection; forward and
backward) is run for --steps steps in each mode, alternating, on the tp group of all ranks. The tp group's operations
get a deterministic transfer time (MPITRAIN_COMM_LATENCY, comm/latency.py), which compute can hide; on one host the
transfers themselves are memory copies. Exposed tp time is what the step breakdown (profile/breakdown.py) charges to
waits on the tp group. Prints per-mode means (step: the slowest rank; exposed tp: the most and the least over the
ranks), the ratios, and the model of
mpitrain.layers.tp_overlap.exposed_seconds for the measured chunk matmul time; then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.02, help="seconds per tp operation (0: none)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4, help="steps per mode")
    return parser.parse_args()


def main():
    args = parse_args()
    os.environ["MPITRAIN_COMM_LATENCY"] = f"tp={args.latency}"  # read when the group is made
    from mpi4py import MPI

    from mpitrain.comm.group import Group
    from mpitrain.comm.operations import ProgressRecord
    from mpitrain.layers.linear import ColumnParallelLinear, RowParallelLinear
    from mpitrain.layers.tensor_parallel import TensorParallel
    from mpitrain.layers.tp_overlap import exposed_seconds
    from mpitrain.profile.breakdown import Breakdown, exposed_of_group

    world = MPI.COMM_WORLD
    progress = ProgressRecord(world.Get_rank())
    breakdown = Breakdown(delays={})
    progress.listener = breakdown
    group = Group(world, "tp", progress)
    t, c, f = group.size, args.d_model, args.d_ff
    rng = np.random.default_rng(world.Get_rank())
    params = {"w_up": rng.standard_normal((c, f // t)) * 0.02, "w_down": rng.standard_normal((f // t, c)) * 0.02}
    x = rng.standard_normal((args.batch, args.seq // t, c))
    dy = rng.standard_normal(x.shape)
    measured = {False: [], True: []}
    for step in range(2 * args.steps + 2):
        overlap = bool(step % 2)
        tp = TensorParallel(group, True, overlap=overlap)
        up, down = ColumnParallelLinear(tp, c, ["w_up"]), RowParallelLinear(tp, f // t, "w_down")
        grads = {name: np.zeros_like(value) for name, value in params.items()}
        world.Barrier()
        breakdown.start_step()
        (h,), saved_up = up.forward(params, x)
        _, saved_down = down.forward(params, h)
        up.backward(params, grads, saved_up, [down.backward(params, grads, saved_down, dy)])
        parts = breakdown.finish_step()
        if step >= 2:  # the first of each mode warms up
            measured[overlap].append((parts["step_s"], exposed_of_group(parts, "tp")))
    start = time.perf_counter()
    x.reshape(-1, c) @ params["w_up"]
    chunk_matmul_s = time.perf_counter() - start  # one chunk of the up projection
    every = world.gather(measured)
    if world.Get_rank() != 0:
        return
    steps = range(args.steps)
    # step time: the slowest rank; exposed tp: also the least over the ranks, per step (a rank waiting for a peer
    # that the machine's load held back is not the communication's doing)
    step_s = {mode: statistics.mean(max(rank[mode][i][0] for rank in every) for i in steps) for mode in (False, True)}
    worst = {mode: statistics.mean(max(rank[mode][i][1] for rank in every) for i in steps) for mode in (False, True)}
    least = {mode: statistics.mean(min(rank[mode][i][1] for rank in every) for i in steps) for mode in (False, True)}
    model = {mode: 4 * exposed_seconds(0, t, 1.0, chunk_matmul_s * t, mode, args.latency) for mode in (False, True)}
    print(f"tp = {t}, latency {1e3 * args.latency:.0f} ms per tp operation, chunk matmul {1e3 * chunk_matmul_s:.1f} ms")
    print(f"{'':12}{'step':>10}{'exposed tp (max rank)':>23}{'(min rank)':>12}{'model, 4 ops':>14}")
    for mode, name in ((False, "plain"), (True, "tp_overlap")):
        print(f"{name:12}{1e3 * step_s[mode]:7.1f} ms{1e3 * worst[mode]:20.1f} ms{1e3 * least[mode]:9.1f} ms"
              f"{1e3 * model[mode]:11.1f} ms")
    ratios = {"step_ratio": step_s[True] / step_s[False], "exposed_tp_ratio_max_rank": worst[True] / worst[False],
              "exposed_tp_ratio_min_rank": least[True] / least[False]}
    print("ratios (overlap / plain): " + ", ".join(f"{key} {value:.2f}" for key, value in ratios.items()))
    print(json.dumps({"tp": t, "latency_s": args.latency, "chunk_matmul_s": chunk_matmul_s, "step_s": step_s,
                      "exposed_tp_max_rank_s": worst, "exposed_tp_min_rank_s": least, **ratios}))


if __name__ == "__main__":
    main()
