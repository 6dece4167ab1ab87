"""`mpitrain bench comm`: how fast each collective is on these ranks, as nccl-tests prints it, and a latency +
bandwidth (alpha-beta) model per operation and group that a planner can read back.

Sizes follow nccl-tests: all_reduce the buffer, all_gather the gathered output, reduce_scatter the input, all_to_all
one rank's send buffer, sendrecv the message each rank sends to its ring neighbour (and receives from the other).
Times are the slowest rank's mean over the timed iterations (a collective is done when the last rank is).

    algbw = size / time
    busbw = algbw x (2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter, all_to_all, 1 for sendrecv)

busbw is what each rank's link carries under the ring algorithm, comparable across ops and rank counts (and with
a memory copy's bandwidth on one host). The fit is time = alpha + size / (busbw_fit / bus_factor), least squares
on relative error so that small and large sizes weigh alike.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np

from mpitrain.comm.failure import abort_on_error
from mpitrain.comm.mesh import Mesh, validate_degrees
from mpitrain.errors import MpitrainError

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "sendrecv")
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text.upper())
    if not match:
        raise MpitrainError(f"--sizes: {text!r} is not a size like 1K, 64M, 4096")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_sizes(text: str, factor: int = 2) -> list[int]:
    """'1K..256M' (doubling, or x `factor`) or '1K,1M,64M'."""
    if ".." in text:
        low, high = (parse_size(part) for part in text.split("..", 1))
        if low < 1 or high < low:
            raise MpitrainError(f"--sizes {text}: expected LOW..HIGH with 1 <= LOW <= HIGH")
        sizes, size = [], low
        while size <= high:
            sizes.append(size)
            size *= factor
        return sizes
    return [parse_size(part) for part in text.split(",") if part.strip()]


def parse_ops(text: str) -> list[str]:
    ops = [op.strip() for op in text.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise MpitrainError(f"--ops: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(OPS)}")
    return ops


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "sendrecv":
        return 1.0
    return (n - 1) / n


def _runner(group, op: str, size: int):
    """A function running `op` once on `group` for a `size`-byte payload (float32 elements, rounded to n blocks)."""
    n = group.size
    elements = max(n, size // 4 // n * n)
    if op == "all_reduce":
        buf = np.ones(elements, np.float32)
        return elements * 4, lambda: group.all_reduce(buf)
    if op == "reduce_scatter":
        send, recv = np.ones(elements, np.float32), np.empty(elements // n, np.float32)
        return elements * 4, lambda: group.reduce_scatter(send, recv)
    if op == "all_gather":
        send, recv = np.ones(elements // n, np.float32), np.empty(elements, np.float32)
        return elements * 4, lambda: group.all_gather(send, recv)
    if op == "all_to_all":
        send, recv = np.ones(elements, np.float32), np.empty(elements, np.float32)
        return elements * 4, lambda: group.all_to_all(send, recv)
    send, recv = np.ones(elements, np.float32), np.empty(elements, np.float32)
    right, left = (group.rank + 1) % n, (group.rank - 1) % n

    def sendrecv():
        receive = group.irecv(recv, left)
        group.send(send, right)
        receive.wait()
    return elements * 4, sendrecv


def time_op(group, op: str, size: int, budget_bytes: int = 256 * 2**20, warmup: int = 2) -> tuple[int, float, int]:
    """(bytes, seconds per call on the slowest rank, iterations): iterations shrink with size (budget_bytes)."""
    nbytes, run = _runner(group, op, size)
    iterations = int(min(50, max(3, budget_bytes // max(nbytes, 1))))
    for _ in range(warmup):
        run()
    group.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    elapsed = (time.perf_counter() - start) / iterations
    return nbytes, group.all_reduce_scalar(elapsed, op="max"), iterations


def fit_alpha_beta(sizes, seconds, factor: float) -> dict:
    """time = alpha + size * beta, least squares weighted by 1/time (relative error)."""
    sizes, seconds = np.asarray(sizes, float), np.asarray(seconds, float)
    weights = 1.0 / seconds
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    alpha, beta = max(float(alpha), 0.0), max(float(beta), 0.0)
    predicted = alpha + beta * sizes
    # beta 0: time did not grow with size (latency-bound sizes, or noise): no bandwidth can be read off
    algbw = 1e-9 / beta if beta > 0 else None
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "algbw_GBps": algbw,
            "busbw_GBps": factor * algbw if algbw else None,
            "max_relative_error": float(np.max(np.abs(predicted - seconds) / seconds))}


def format_size(nbytes: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def run_bench(groups: dict, ops: list[str], sizes: list[int], say) -> dict:
    """Measure every op on every group of more than one rank; `say` prints (rank 0 only). Collective."""
    report = {"results": [], "fit": {}}
    for group_name, group in groups.items():
        if group.size < 2:
            continue
        for op in ops:
            say(f"\n# {op} on group {group_name} ({group.size} ranks)")
            say(f"{'size':>10} {'bytes':>12} {'iters':>6} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
            factor, points = bus_factor(op, group.size), []
            for size in sizes:
                nbytes, seconds, iterations = time_op(group, op, size)
                algbw = nbytes / seconds / 1e9
                row = {"op": op, "group": group_name, "ranks": group.size, "size": nbytes, "time_s": seconds,
                       "algbw_GBps": algbw, "busbw_GBps": algbw * factor}
                report["results"].append(row)
                points.append((nbytes, seconds))
                say(f"{format_size(size):>10} {nbytes:>12} {iterations:>6} {1e6 * seconds:>12.1f} {algbw:>13.3f} "
                    f"{algbw * factor:>13.3f}")
            if len(points) >= 2:
                fit = fit_alpha_beta(*zip(*points), factor)
                report["fit"].setdefault(op, {})[group_name] = dict(fit, ranks=group.size)
                bandwidth = (f"busbw {fit['busbw_GBps']:.3g} GB/s (time = alpha + bytes / algbw "
                             f"{fit['algbw_GBps']:.3g} GB/s" if fit["algbw_GBps"] else
                             "bandwidth not resolved (time did not grow with size: try larger --sizes")
                say(f"fit {op} on {group_name}: alpha {1e6 * fit['alpha_s']:.1f} us, {bandwidth}; "
                    f"worst relative error {100 * fit['max_relative_error']:.0f}%)")
    return report


def memcpy_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """GB/s of a plain memory copy (numpy), the one-host reference for busbw."""
    source, target = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    np.copyto(target, source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def write_report(report: dict, path) -> None:
    with open(path, "w") as out:
        json.dump(report, out, indent=1)


def relaunch(mpiexec: str, n_ranks: int, rank_environment, **options) -> None:
    """Replace this process with `mpiexec -n N python -m mpitrain bench comm --OPTION VALUE ...` (without -n: the
    ranks run in their MPI job; cli.rank_environment sets their BLAS threads and MPICH's yield settings)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    args = [item for key, value in options.items() for item in (f"--{key}", str(value))]
    command = [mpiexec, "-n", str(n_ranks), sys.executable, "-m", "mpitrain", "bench", "comm", *args]
    os.execvpe(command[0], command, rank_environment(n_ranks, cores, os.environ))


def run_world(ops: list[str], sizes: list[int], tp: int, json_path, echo) -> None:
    """The benchmark over this MPI job's ranks: the world group and, with tp > 1, the tp and dp groups of that
    split; rank 0 prints (`echo`) and writes `json_path`."""
    from mpi4py import MPI  # here, not at the top: importing it initialises MPI

    comm = MPI.COMM_WORLD
    if tp < 1 or comm.Get_size() % tp:
        raise MpitrainError(f"--tp {tp} does not divide the {comm.Get_size()} ranks")
    with abort_on_error(comm):
        validate_degrees(comm.Get_size(), dp=comm.Get_size() // max(tp, 1), tp=tp, pp=1, cp=1, ep=1)
        mesh = Mesh(comm, dp=comm.Get_size() // tp, tp=tp, pp=1, cp=1, ep=1)
        say = echo if comm.Get_rank() == 0 else (lambda text: None)
        say(f"bench comm: {comm.Get_size()} ranks, float32 payloads; memory copy {memcpy_bandwidth():.2f} GB/s "
            f"on rank 0")
        groups = {"world": mesh.world} | ({"tp": mesh.tp, "dp": mesh.dp} if tp > 1 else {})
        report = run_bench(groups, ops, sizes, say)
        if comm.Get_rank() == 0:
            report["world_size"] = comm.Get_size()
            write_report(report, json_path)
            say(f"wrote {json_path}")
