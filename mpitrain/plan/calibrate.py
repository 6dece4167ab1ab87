"""`mpitrain plan calibrate`: measure this host into a cluster file (configs/clusters/this-machine.toml), a rank
standing for a GPU and the host for one node. About half a minute:

    peak_flops            float32 512^3 matmul on one rank's share of the cores (its BLAS threads), the better of
                          two readings half a minute apart
    gemm_rows_half, ...   the GEMM shape curve: (rows x cols) @ (cols x cols) products timed over a grid, fitted to
                          rows/(rows + r0) * cols/(cols + c0) (mpitrain/plan/cost.gemm_shape_factor)
    hbm_bandwidth         a numpy copy (read + write)
    [intra], [inter]      all_reduce alpha-beta between the ranks (`mpitrain bench comm`)
    unit_overhead_s       seconds of Python and dispatch per unit and micro-batch (forward + backward), from
                          one-process steps of a model too small to compute anything (tiny, 1 vs 9 blocks)
    step_overhead_s       what such a step costs beyond its forward, backward and optimizer (data, bookkeeping)
    optimizer_bandwidth   the optimizer step's bytes (ADAM_BYTES_PER_PARAM per parameter) over its measured time
    matmul_efficiency     the fraction of the peak the matmuls of a real step reach: the step's forward and
                          backward time, less the modelled elementwise and overhead parts, against its matmul FLOPs
    efficiency_rows, ...  the same at micro-batches of EFFICIENCY_MICRO_BATCHES sequences (caches spill as a
                          micro-batch grows: per token, 2048 rows ran ~1.3x slower than 1024 here, two ranks at once)
    contention            how much slower a rank computes while every rank computes than alone (the ranks share
                          the memory bandwidth and caches): a pipeline's fill and drain run alone
    comm_overlap = 0      MPI over shared memory copies bytes with the same cores that compute (no DMA engine, no
                          progress thread): communication does not hide behind compute here
    skew_intervals_s, ... how much longer the slower of the ranks takes between two synchronizations, as a fraction
                          of the interval, at two intervals: the copies' steps in lockstep (a whole step between
                          barriers; the faster of two runs) and a barrier after every block-sized chunk of work
                          (one MLP forward of the calibration model on a rank's share of a micro-batch; the quieter
                          of two 2 s loops); ranks that share a host's caches and memory drift apart, by 4-9% over
                          a step here and 5-20% over a block, varying from minute to minute

The one-process steps run `ranks` copies at once, as the ranks of a layout do: the cores, caches and memory
bandwidth are shared then as they are in a training run. The copies are the ranks of one mpiexec job, each training
alone (COMM_SELF) but starting every step together (a barrier on the world): copies started as separate processes
drift apart, and the fastest step of one was often run while the others were still importing or initialising.
On this 2-core VM that read matmul efficiency 0.91 and contention 1.02, and bench_plan found 2 of 13 layouts within
15% (all predicted too fast); in lockstep, taking the median step (the statistic `bench step`, and so
benchmarks/bench_plan.py, reports), it reads 0.76 and 1.08, and 9 of 13 are within 15%.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from mpitrain.backend import make_backend
from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.launcher import find_mpiexec
from mpitrain.plan.clusters import CLUSTER_DIR, cluster_from_numbers
from mpitrain.plan.cost import ADAM_BYTES_PER_PARAM, Layout, estimate
from mpitrain.profile.comm_bench import memcpy_bandwidth
from mpitrain.profile.flops import measure_matmul_peak

CALIBRATION_MODEL = "configs/bench-small.toml"
OVERHEAD_MODEL = "configs/tiny.toml"
OVERHEAD_BLOCKS = (1, 9)
OVERHEAD_MICRO_BATCHES = 8  # micro-batch 1 of the tiny model's global batch 8
GEMM_ROWS = (128, 512, 2048)
EFFICIENCY_MICRO_BATCHES = (2, 8)
GEMM_COLS = (32, 64, 128, 256, 512)


def calibrate(out_path: Path, ranks: int, say=print) -> dict:
    """Measure this host (module docstring) and write a cluster file; returns its numbers."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // ranks)
    peak = _matmul_peak(threads)
    with threadpool_limits(threads):  # a rank's BLAS runs on its share of the cores (the launcher's setting)
        rows_half, cols_half = fit_gemm_curve(measure_gemm_grid())
    bandwidth = memcpy_bandwidth() * 1e9 * 2  # a copy reads and writes each byte
    fit = _all_reduce_fit(ranks)
    # busbw is what each rank's link carries under the ring: the Link's bandwidth * efficiency
    link = {"bandwidth": fit["busbw_GBps"] * 1e9, "efficiency": 1.0,
            "latency": max(fit["alpha_s"] / max(2 * (ranks - 1), 1), 1e-7)}
    numbers = {"name": f"this machine ({cores} cores, {ranks} ranks)", "gpus_per_node": ranks,
               "memory_gb": _host_memory_bytes() / ranks / 1e9, "reserved_gb": 0.2, "compute": "float32",
               "peak_flops": peak, "matmul_efficiency": 1.0, "hbm_bandwidth": bandwidth,
               "host_bandwidth": bandwidth, "gemm_rows_half": rows_half, "gemm_cols_half": cols_half,
               "comm_overlap": 0.0}
    numbers.update(_step_numbers(numbers, link, ranks, threads))
    numbers.update(_skew_numbers(numbers.pop("step_skew"), ranks, threads))
    _write(out_path, numbers, link, threads)
    say(f"wrote {out_path}: matmul {numbers['peak_flops'] / 1e9:.1f} GFLOP/s per rank at "
        f"{100 * numbers['matmul_efficiency']:.0f}% in a step (GEMM curve r0 {rows_half:.0f}, c0 {cols_half:.0f}), "
        f"memory {bandwidth / 1e9:.1f} GB/s, "
        f"optimizer {numbers['optimizer_bandwidth'] / 1e9:.2f} GB/s, contention {numbers['contention']:.2f}, overhead "
        f"{1e3 * numbers['unit_overhead_s']:.2f} ms per unit and micro-batch + {1e3 * numbers['step_overhead_s']:.1f} "
        f"ms per step, rank skew {100 * numbers['skew_at_intervals'][0]:.1f}% over "
        f"{1e3 * numbers['skew_intervals_s'][0]:.0f} ms and {100 * numbers['skew_at_intervals'][-1]:.1f}% over "
        f"{1e3 * numbers['skew_intervals_s'][-1]:.0f} ms, all_reduce alpha {1e6 * fit['alpha_s']:.0f} us, "
        f"busbw {fit['busbw_GBps']:.2f} GB/s")
    return numbers


def _matmul_peak(threads: int) -> float:
    """float32 512^3 matmul FLOP/s on `threads` BLAS threads, the best over a second."""
    with threadpool_limits(threads):
        return measure_matmul_peak(make_backend("cpu", "float32"), n=512, seconds=1.0)


def measure_gemm_grid(seconds_each: float = 0.05) -> list[tuple[int, int, float]]:
    """(rows, cols, FLOP/s) of (rows x cols) @ (cols x cols) float32 products, the best of ~seconds_each."""
    rng = np.random.default_rng(0)
    grid = []
    for rows in GEMM_ROWS:
        for cols in GEMM_COLS:
            a = rng.standard_normal((rows, cols), dtype=np.float32)
            b = rng.standard_normal((cols, cols), dtype=np.float32)
            out = a @ b
            best, deadline = float("inf"), time.perf_counter() + seconds_each
            while time.perf_counter() < deadline or best == float("inf"):
                start = time.perf_counter()
                np.matmul(a, b, out=out)
                best = min(best, time.perf_counter() - start)
            grid.append((rows, cols, 2.0 * rows * cols * cols / best))
    return grid


def fit_gemm_curve(grid: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(r0, c0) of FLOP/s ~ A * rows/(rows + r0) * cols/(cols + c0), least squares in logs over a grid of
    half-points (A free: the peak and matmul_efficiency carry the scale)."""
    rows, cols, speed = (np.array(column, dtype=float) for column in zip(*grid))
    candidates = np.geomspace(1, 4096, 97)
    best = (float("inf"), 256.0, 128.0)
    for r0 in candidates:
        for c0 in candidates:
            residual = np.log(speed) - np.log(rows / (rows + r0) * cols / (cols + c0))
            error = float(np.var(residual))
            best = min(best, (error, float(r0), float(c0)))
    return best[1], best[2]


def _all_reduce_fit(ranks: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        fit_path = Path(tmp) / "comm.json"
        command = [sys.executable, "-m", "mpitrain", "bench", "comm", "-n", str(ranks), "--sizes", "4K..16M",
                   "--ops", "all_reduce", "--json", str(fit_path)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not fit_path.is_file():
            raise ConfigError(f"plan calibrate: `{' '.join(command[2:])}` failed: {done.stderr.strip()[-400:]}")
        return json.loads(fit_path.read_text())["fit"]["all_reduce"]["world"]


def _step_numbers(numbers: dict, link: dict, ranks: int, threads: int) -> dict:
    """unit_overhead_s, step_overhead_s, optimizer_bandwidth, matmul_efficiency and contention from one-process
    steps (module docstring), each run as `ranks` copies at once (and the real model alone too)."""
    small, large = (_concurrent_steps(OVERHEAD_MODEL, ranks, threads, [f"model.n_layer={blocks}",
                                                                       "train.micro_batch=1"])
                    for blocks in OVERHEAD_BLOCKS)
    units = OVERHEAD_MICRO_BATCHES * (OVERHEAD_BLOCKS[1] - OVERHEAD_BLOCKS[0])
    unit_overhead = max(0.0, (_median(large, "compute") - _median(small, "compute")) / units)
    step_overhead = max(0.0, _median(small, "step") - _median(small, "compute") - _median(small, "optimizer"))
    cfg = load_config(CLUSTER_DIR.parents[1] / CALIBRATION_MODEL)
    sizes = {b: [] if b == cfg.train.micro_batch else [f"train.global_batch={b}", f"train.micro_batch={b}"]
             for b in EFFICIENCY_MICRO_BATCHES}
    # every size twice, before and after the model alone: other processes only ever slow a run down, so the
    # faster of the two counts (one slow run read the efficiency at 512 rows 0.58 against 0.89)
    alone, runs = [], {b: [] for b in sizes}
    for _ in range(2):
        alone += _concurrent_steps(CALIBRATION_MODEL, 1, threads, [])
        for b, overrides in sizes.items():
            runs[b].append(_concurrent_steps(CALIBRATION_MODEL, ranks, threads, overrides))
    real = min(runs[cfg.train.micro_batch], key=lambda reports: _median(reports, "compute"))
    # the peak again, half a minute later: a slow second read it 65 GFLOP/s against 84, and a step's matmuls
    # then "reached" over 100% of it (clipped to 1: every prediction too slow)
    numbers["peak_flops"] = max(numbers["peak_flops"], _matmul_peak(threads))
    found = {"unit_overhead_s": unit_overhead, "step_overhead_s": step_overhead,
             "optimizer_bandwidth": real[0]["n_params"] * ADAM_BYTES_PER_PARAM / _median(real, "optimizer"),
             "contention": max(1.0, _median(real, "compute") / min(report["compute"] for report in alone)),
             "step_skew": _skew(np.array([report["computes"] for report in real]))}
    cluster = cluster_from_numbers({**numbers, **found}, link, link, "calibration")

    def efficiency(micro_batch: int, reports: list[dict]) -> float:
        at_peak = estimate(cfg, Layout(dp=1, tp=1, pp=1, zero=0, micro_batch=micro_batch), cluster)["parts"]
        compute = _median(reports, "compute") * cfg.train.global_batch / micro_batch  # the layout's whole batch
        matmul_s = compute - at_peak["elementwise"] - (at_peak["overhead"] - step_overhead)
        return min(1.0, at_peak["matmul"] / max(matmul_s, 0.2 * compute))

    by_size = {b: max(efficiency(b, reports) for reports in runs[b]) for b in sizes}
    found["matmul_efficiency"] = by_size[cfg.train.micro_batch]
    found["efficiency_rows"] = [b * cfg.model.seq_len for b in by_size]
    found["efficiency_at_rows"] = list(by_size.values())
    return found


STEP_JOB = """
import json, sys
from mpi4py import MPI
from mpitrain.config import load_config
from mpitrain.train import Trainer
world = MPI.COMM_WORLD
trainer = Trainer(load_config(sys.argv[1], sys.argv[3:]), MPI.COMM_SELF)  # each copy trains alone
results = []
for step in range(int(sys.argv[2])):
    world.Barrier()  # every copy computes at once, as the ranks of a layout do
    results.append(trainer.train_step(step))
computes = [sum(r.breakdown.get(k, 0.0) for k in ("forward", "backward_input", "backward_weight"))
            for r in results[1:]]  # the first warms up; in step order (the rank skew compares the copies' steps)
results = sorted(results[1:], key=lambda result: result.seconds)
median = results[(len(results) - 1) // 2]
parts = median.breakdown
report = {"step": median.seconds, "optimizer": parts.get("optimizer", 0.0), "n_params": trainer.model.n_params,
          "compute": sum(parts.get(k, 0.0) for k in ("forward", "backward_input", "backward_weight")),
          "computes": computes}
for each in world.gather(report) or []:  # one writer: copies printing at once can share a line
    print(json.dumps(each))
"""


def _concurrent_steps(config: str, copies: int, threads: int, overrides: list[str], steps: int = 6) -> list[dict]:
    """The median of `steps` - 1 training steps of one process (its step, forward + backward and optimizer
    seconds), `copies` processes in lockstep (module docstring): one report per copy."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads)}
    command = [find_mpiexec(), "-n", str(copies), sys.executable, "-c", STEP_JOB, config, str(steps),
               "data.synthetic=true", "logging.peak_flops=1e9", f"train.steps={steps}", "train.log_every=1000000",
               *overrides]
    done = subprocess.run(command, cwd=CLUSTER_DIR.parents[1], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise ConfigError(f"plan calibrate: a training step of {config} failed: {done.stderr.strip()[-400:]}")
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(reports) != copies:
        raise ConfigError(f"plan calibrate: {len(reports)} of {copies} copies of {config} reported their steps")
    return reports


SKEW_JOB = """
import json, sys, time
import numpy as np
from mpi4py import MPI
world = MPI.COMM_WORLD
rows, width, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
rng = np.random.default_rng(world.rank)
x = rng.standard_normal((rows, width), dtype=np.float32)
up, down = (rng.standard_normal(shape, dtype=np.float32) for shape in ((width, 4 * width), (4 * width, width)))
chunks, stop = [], time.perf_counter() + seconds
while not chunks or len(chunks) % 4 or not world.allreduce(time.perf_counter() > stop, op=MPI.LOR):
    world.Barrier()
    start = time.perf_counter()
    h = x @ up
    (0.5 * h * (1 + np.tanh(0.8 * h))) @ down  # a block's MLP: GELU between two matmuls
    chunks.append(time.perf_counter() - start)
everyone = world.gather(chunks[1:])
if world.rank == 0:
    print(json.dumps(everyone))
"""


def _skew(chunks: np.ndarray) -> tuple[float, float]:
    """(mean interval, mean of (slowest - mean) / mean) of (ranks, intervals) seconds of work between barriers."""
    mean = chunks.mean(axis=0)
    return float(mean.mean()), float(((chunks.max(axis=0) - mean) / mean).mean())


def _skew_numbers(step_skew: tuple[float, float], ranks: int, threads: int) -> dict:
    """skew_intervals_s and skew_at_intervals (module docstring): a block's work between barriers (SKEW_JOB on
    the calibration model's shape), and the lockstep copies' whole steps."""
    if ranks < 2:  # one rank never waits on another
        return {"skew_intervals_s": [step_skew[0]], "skew_at_intervals": [0.0]}
    cfg = load_config(CLUSTER_DIR.parents[1] / CALIBRATION_MODEL)
    rows, model = cfg.train.micro_batch * cfg.model.seq_len // ranks, cfg.model
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
    command = [find_mpiexec(), "-n", str(ranks), sys.executable, "-c", SKEW_JOB, str(rows), str(model.d_model), "2"]
    runs = []
    for _ in range(2):  # the quieter of two runs, as for the steps: the skew grows with what else the host runs
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise ConfigError(f"plan calibrate: the rank skew loop failed: {done.stderr.strip()[-400:]}")
        chunks = json.loads(done.stdout.strip().splitlines()[-1])
        runs.append(_skew(np.array([c[:min(map(len, chunks))] for c in chunks])))
    block = min(runs, key=lambda run: run[1])
    points = sorted([block, step_skew])
    return {"skew_intervals_s": [p[0] for p in points], "skew_at_intervals": [p[1] for p in points]}


def _median(reports: list[dict], key: str) -> float:
    return statistics.median(report[key] for report in reports)


def _write(out_path: Path, numbers: dict, link: dict, threads: int) -> None:
    lines = ["# Written by `mpitrain plan calibrate`: measured on this host (a rank = a 'GPU'; MPI ranks share one",
             f"# node). matmul: float32 512^3 on {threads} thread(s) and a GEMM shape grid; bandwidth: numpy copy;",
             "# links: all_reduce fit; overheads, optimizer and matmul_efficiency: one-process steps of",
             f"# {OVERHEAD_MODEL} and {CALIBRATION_MODEL}, as many at once as there are ranks",
             "# (mpitrain/plan/calibrate.py).",
             *(f"{key} = {json.dumps(value)}" for key, value in numbers.items())]
    for section in ("intra", "inter"):
        lines += ["", f"[{section}]", *(f"{key} = {json.dumps(value)}" for key, value in link.items())]
    out_path.write_text("\n".join(lines) + "\n")


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 16e9
