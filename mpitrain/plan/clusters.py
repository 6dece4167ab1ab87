"""Clusters for `mpitrain plan`: what a node offers (configs/clusters/*.toml; `mpitrain plan calibrate` writes
configs/clusters/this-machine.toml from measurements on this host, mpitrain/plan/calibrate.py).

A cluster file holds one node's numbers; the planner multiplies nodes as --gpus asks. Links are alpha-beta: one
ring step of a collective costs `latency`, and each byte crosses a link at `bandwidth * efficiency` (the fraction
of the datasheet number that collectives reach). A group whose ranks all sit in one node uses [intra]; one that
spans nodes is limited by [inter], the per-GPU network bandwidth.

Optional keys (OPTIONAL below; a file without them gets the defaults, which are the model for large GPUs):
gemm_rows_half / gemm_cols_half, the GEMM shape curve's half-points; unit_overhead_s and step_overhead_s, fixed
seconds per unit and micro-batch and per step (kernel launches, Python); optimizer_bandwidth, the bytes/s of the
optimizer's passes over its state (default hbm_bandwidth); comm_overlap, the fraction of the compute that
communication can hide behind (1: NCCL on its own engines; 0: collectives that need the computing cores);
contention, how much slower a rank computes while all the node's ranks compute than alone (1: GPUs, each with its
own memory; above 1: ranks sharing a host's memory bandwidth); efficiency_rows and efficiency_at_rows, the
fraction of the peak a step's matmuls reached at these micro-batch rows (caches spill as a micro-batch grows), which
replace matmul_efficiency where given; skew_intervals_s and skew_at_intervals, how much longer than the mean rank
the slower of ranks that synchronize after every `interval` seconds of compute takes, as a fraction of the interval
(ranks sharing a host's caches and memory drift apart; absent: 0, GPUs that each compute alone). fp8_peak_flops, the
dense FP8 tensor-core FLOP/s (absent: no FP8, and the planner refuses precision.fp8 on the cluster).
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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
    gemm_rows_half: float = 256.0
    gemm_cols_half: float = 128.0
    unit_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    optimizer_bandwidth: float = 0.0  # 0: hbm_bandwidth
    comm_overlap: float = 1.0
    contention: float = 1.0
    efficiency_rows: tuple = ()  # measured matmul_efficiency at these rows per micro-batch (empty: one number)
    efficiency_at_rows: tuple = ()
    skew_intervals_s: tuple = ()  # measured rank skew at these compute intervals between synchronizations (empty: 0)
    skew_at_intervals: tuple = ()
    fp8_peak_flops: float = 0.0  # dense FP8 tensor-core FLOP/s (0: none, precision.fp8 refused; plan/cost_precision.py)

    def matmul_efficiency_at(self, rows: float) -> float:
        """matmul_efficiency, or where the file measured it per micro-batch size, interpolated in log(rows) between
        the measured points (the nearest one outside them)."""
        if not self.efficiency_rows:
            return self.matmul_efficiency
        return float(np.interp(np.log(rows), np.log(self.efficiency_rows), self.efficiency_at_rows))

    def skew_at(self, interval_s: float) -> float:
        """The slower rank's extra time, as a fraction of an interval of `interval_s` seconds of compute between two
        synchronizations: interpolated in log(interval) between the measured points (the nearest one outside them),
        0 where the file measured none."""
        if not self.skew_intervals_s or interval_s <= 0:
            return 0.0
        return float(np.interp(np.log(interval_s), np.log(self.skew_intervals_s), self.skew_at_intervals))

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes

    @property
    def optimizer_bytes_per_s(self) -> float:
        return self.optimizer_bandwidth or self.hbm_bandwidth


KEYS = ("name", "gpus_per_node", "memory_gb", "reserved_gb", "compute", "peak_flops", "matmul_efficiency",
        "hbm_bandwidth", "host_bandwidth")
OPTIONAL = {"gemm_rows_half": 256.0, "gemm_cols_half": 128.0, "unit_overhead_s": 0.0, "step_overhead_s": 0.0,
            "optimizer_bandwidth": 0.0, "comm_overlap": 1.0, "contention": 1.0}


def _number(table: dict, key: str, path, default=None) -> float:
    """table[key] (default where absent) as a float; ConfigError naming the key and the file where it is not one."""
    value = table.get(key, default)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"cluster file {path}: {key} = {value!r} is not a number") from None


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
        links[section] = Link(*(_number(values, key, path) for key in ("bandwidth", "efficiency", "latency")))
    numbers = {key: _number(raw, key, path) for key in KEYS[2:] if key != "compute"}
    bad = [key for key, value in numbers.items() if not value > 0] + \
          [f"{s}.{k}" for s, link in links.items() for k, v in vars(link).items() if not v > 0]
    if bad or int(_number(raw, "gpus_per_node", path)) < 1:
        raise ConfigError(f"cluster file {path}: {', '.join(bad) or 'gpus_per_node'} must be > 0")
    optional = {key: _number(raw, key, path, default) for key, default in OPTIONAL.items()}
    fp8_peak = _number(raw, "fp8_peak_flops", path, 0.0)  # absent: no FP8 tensor cores
    negative = [key for key, value in optional.items() if not value >= 0] + \
        ["comm_overlap"] * (optional["comm_overlap"] > 1) + ["contention"] * (optional["contention"] < 1) + \
        ["fp8_peak_flops"] * (not fp8_peak >= 0)
    if negative:
        raise ConfigError(f"cluster file {path}: {', '.join(negative)} must be >= 0 (comm_overlap at most 1, "
                          "contention at least 1)")
    for points, values, least in (("efficiency_rows", "efficiency_at_rows", "positive"),
                                  ("skew_intervals_s", "skew_at_intervals", "non-negative")):
        at, measured = raw.get(points, []), raw.get(values, [])
        if len(at) != len(measured) or any(not value > 0 for value in at) or at != sorted(at) or \
                any(not (value > 0 if least == "positive" else value >= 0) for value in measured):
            raise ConfigError(f"cluster file {path}: {points} (positive, ascending) and {values} ({least}) must be "
                              "lists of numbers of the same length")
    return cluster_from_numbers({**raw, **numbers, **optional, "fp8_peak_flops": fp8_peak}, links["intra"],
                                links["inter"], str(path))


def cluster_from_numbers(numbers: dict, intra, inter, source: str) -> Cluster:
    """A Cluster from a cluster file's keys (numbers already checked), its two links given as Link or dicts."""
    intra, inter = (link if isinstance(link, Link) else Link(**link) for link in (intra, inter))
    return Cluster(name=str(numbers["name"]), source=source, gpus_per_node=int(numbers["gpus_per_node"]),
                   memory_bytes=numbers["memory_gb"] * 1e9, reserved_bytes=numbers["reserved_gb"] * 1e9,
                   compute=str(numbers["compute"]), peak_flops=numbers["peak_flops"],
                   matmul_efficiency=numbers["matmul_efficiency"], hbm_bandwidth=numbers["hbm_bandwidth"],
                   host_bandwidth=numbers["host_bandwidth"], intra=intra, inter=inter,
                   efficiency_rows=tuple(numbers.get("efficiency_rows", ())),
                   efficiency_at_rows=tuple(numbers.get("efficiency_at_rows", ())),
                   skew_intervals_s=tuple(numbers.get("skew_intervals_s", ())),
                   skew_at_intervals=tuple(numbers.get("skew_at_intervals", ())),
                   fp8_peak_flops=float(numbers.get("fp8_peak_flops", 0.0)),
                   **{key: float(numbers.get(key, default)) for key, default in OPTIONAL.items()})
