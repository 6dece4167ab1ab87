"""Clusters for `mpitrain plan`: what a node offers (configs/clusters/*.toml), and `plan calibrate`, which writes
configs/clusters/this-machine.toml from measurements on this host.

A cluster file holds one node's numbers; the planner multiplies nodes as --gpus asks. Links are alpha-beta: one
ring step of a collective costs `latency`, and each byte crosses a link at `bandwidth * efficiency` (the fraction
of the datasheet number that collectives reach). A group whose ranks all sit in one node uses [intra]; one that
spans nodes is limited by [inter], the per-GPU network bandwidth.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from mpitrain.errors import ConfigError

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "configs" / "clusters"


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per direction per GPU
    efficiency: float  # fraction of `bandwidth` that collectives reach
    latency: float  # seconds per ring step

    def seconds(self, nbytes: float, steps: int) -> float:
        return steps * self.latency + nbytes / (self.bandwidth * self.efficiency)


@dataclass(frozen=True)
class Cluster:
    name: str
    source: str
    gpus_per_node: int
    memory_bytes: float
    reserved_bytes: float
    compute: str
    peak_flops: float
    matmul_efficiency: float
    hbm_bandwidth: float
    host_bandwidth: float
    intra: Link
    inter: Link

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes


KEYS = ("name", "gpus_per_node", "memory_gb", "reserved_gb", "compute", "peak_flops", "matmul_efficiency",
        "hbm_bandwidth", "host_bandwidth")


def load_cluster(name_or_path: str) -> Cluster:
    """A cluster file by path, or by name under configs/clusters/ ('h100', 'this-machine')."""
    path = Path(name_or_path)
    if not path.is_file():
        path = CLUSTER_DIR / f"{name_or_path.lower()}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CLUSTER_DIR.glob("*.toml")))
        hint = " (run `mpitrain plan calibrate` to write this-machine)" if "this-machine" in name_or_path else ""
        raise ConfigError(f"CLUSTER {name_or_path!r} is neither a file nor one of {known}{hint}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cluster file {path} is not valid TOML: {exc}") from exc
    missing = [key for key in KEYS if key not in raw] + [s for s in ("intra", "inter") if s not in raw]
    if missing:
        raise ConfigError(f"cluster file {path} lacks {', '.join(missing)}")
    links = {}
    for section in ("intra", "inter"):
        values = raw[section]
        absent = [k for k in ("bandwidth", "efficiency", "latency") if k not in values]
        if absent:
            raise ConfigError(f"cluster file {path}: [{section}] lacks {', '.join(absent)}")
        links[section] = Link(float(values["bandwidth"]), float(values["efficiency"]), float(values["latency"]))
    numbers = {key: float(raw[key]) for key in KEYS[2:] if key != "compute"}
    bad = [key for key, value in numbers.items() if not value > 0] + \
          [f"{s}.{k}" for s, link in links.items() for k, v in vars(link).items() if not v > 0]
    if bad or int(raw["gpus_per_node"]) < 1:
        raise ConfigError(f"cluster file {path}: {', '.join(bad) or 'gpus_per_node'} must be > 0")
    return Cluster(name=str(raw["name"]), source=str(path), gpus_per_node=int(raw["gpus_per_node"]),
                   memory_bytes=numbers["memory_gb"] * 1e9, reserved_bytes=numbers["reserved_gb"] * 1e9,
                   compute=str(raw["compute"]), peak_flops=numbers["peak_flops"],
                   matmul_efficiency=numbers["matmul_efficiency"], hbm_bandwidth=numbers["hbm_bandwidth"],
                   host_bandwidth=numbers["host_bandwidth"], intra=links["intra"], inter=links["inter"])


def calibrate(out_path: Path, ranks: int, say=print) -> dict:
    """Measure this host (matmul FLOP/s at one rank's share of the cores, memory copy bandwidth, MPI alpha-beta
    of all-reduce between `ranks` local ranks through `mpitrain bench comm`) and write a cluster file."""
    from threadpoolctl import threadpool_limits

    from mpitrain.backend import make_backend
    from mpitrain.profile.comm_bench import memcpy_bandwidth
    from mpitrain.profile.flops import measure_matmul_peak

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // ranks)
    with threadpool_limits(threads):  # a rank's BLAS runs on its share of the cores (the launcher's setting)
        peak = measure_matmul_peak(make_backend("cpu", "float32"), n=512, seconds=1.0)
    bandwidth = memcpy_bandwidth() * 1e9 * 2  # a copy reads and writes each byte
    efficiency = _model_efficiency(peak, threads)
    with tempfile.TemporaryDirectory() as tmp:
        fit_path = Path(tmp) / "comm.json"
        command = [sys.executable, "-m", "mpitrain", "bench", "comm", "-n", str(ranks), "--sizes", "4K..16M",
                   "--ops", "all_reduce", "--json", str(fit_path)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not fit_path.is_file():
            raise ConfigError(f"plan calibrate: `{' '.join(command[2:])}` failed: {done.stderr.strip()[-400:]}")
        fit = json.loads(fit_path.read_text())["fit"]["all_reduce"]["world"]
    # busbw is what each rank's link carries under the ring: the Link's bandwidth * efficiency
    link = {"bandwidth": fit["busbw_GBps"] * 1e9, "efficiency": 1.0,
            "latency": max(fit["alpha_s"] / max(2 * (ranks - 1), 1), 1e-7)}
    numbers = {"name": f"this machine ({cores} cores, {ranks} ranks)", "gpus_per_node": ranks,
               "memory_gb": _host_memory_bytes() / ranks / 1e9, "reserved_gb": 0.2, "compute": "float32",
               "peak_flops": peak, "matmul_efficiency": efficiency, "hbm_bandwidth": bandwidth,
               "host_bandwidth": bandwidth}
    lines = ["# Written by `mpitrain plan calibrate`: measured on this host (a rank = a 'GPU'; MPI ranks share one",
             f"# node). matmul: float32 {512}^3 on {threads} thread(s); bandwidth: numpy copy; links: all_reduce fit;",
             f"# matmul_efficiency: one process's MFU on {CALIBRATION_MODEL} over the GEMM shape factor (the",
             "# whole step's work beside the matmuls, Python included, charged to the matmuls).",
             *(f"{key} = {json.dumps(value)}" for key, value in numbers.items())]
    for section in ("intra", "inter"):
        lines += ["", f"[{section}]", *(f"{key} = {json.dumps(value)}" for key, value in link.items())]
    out_path.write_text("\n".join(lines) + "\n")
    say(f"wrote {out_path}: matmul {peak / 1e9:.1f} GFLOP/s per rank, memory {bandwidth / 1e9:.1f} GB/s, "
        f"all_reduce alpha {1e6 * fit['alpha_s']:.0f} us, busbw {fit['busbw_GBps']:.2f} GB/s")
    return numbers


CALIBRATION_MODEL = "configs/bench-small.toml"


def _model_efficiency(peak: float, threads: int) -> float:
    """The fraction of the matmul peak a real training step reaches here (`mpitrain bench step`, one process),
    divided by the GEMM shape factor the cost model applies to that model's shapes."""
    from mpitrain.config import load_config
    from mpitrain.plan.cost import gemm_shape_factor
    root = CLUSTER_DIR.parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "mpitrain", "bench", "step", CALIBRATION_MODEL, "--steps", "3", "--warmup", "1",
               "--set", f"logging.peak_flops={peak}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=root, env=env)
    if done.returncode != 0:
        raise ConfigError(f"plan calibrate: `{' '.join(command[2:])}` failed: {done.stderr.strip()[-400:]}")
    mfu = json.loads(done.stdout.strip().splitlines()[-1])["mfu"]
    cfg = load_config(root / CALIBRATION_MODEL)
    return min(1.0, mfu / gemm_shape_factor(cfg.train.micro_batch * cfg.model.seq_len, cfg.model.d_model))


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 16e9
