"""What `mpitrain launch` and `mpitrain train` need to start ranks well on one machine: the mpiexec to use, BLAS
threads and MPICH's yield settings per rank, and where a run writes (for the restart supervisor)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import click

from mpitrain.config import load_config
from mpitrain.errors import MpitrainError


def warn_unset_threads(comm) -> None:
    """Several ranks on one machine each start as many BLAS threads as there are cores unless told otherwise:
    N ranks then fight over the cores (often several times slower). `mpitrain launch` sets the threads; say so."""
    local = comm.Split_type(split_type=_mpi_shared_type(), key=comm.Get_rank()) if comm.Get_size() > 1 else None
    ranks_here = local.Get_size() if local is not None else 1
    if local is not None:
        local.Free()
    if comm.Get_rank() == 0 and ranks_here > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        click.echo(f"warning: OMP_NUM_THREADS is not set, so each of the {ranks_here} ranks on this machine may use "
                   f"all {cores} cores for BLAS; export OMP_NUM_THREADS={max(1, cores // ranks_here)} or start with "
                   f"`mpitrain launch -n N`", err=True)


def _mpi_shared_type():
    from mpi4py import MPI
    return MPI.COMM_TYPE_SHARED


def find_mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise MpitrainError("no mpiexec found beside this Python or on PATH; pip install 'mpitrain[mpich]' "
                            "or load your cluster's MPI module")
    return found


def rank_environment(n_ranks: int, cores: int, base: dict) -> dict:
    """BLAS threads per rank (cores / ranks) and, when ranks outnumber cores, MPICH's yield settings: without them
    ranks spin on the cores that others need to compute."""
    env = dict(base)
    threads = str(max(1, cores // n_ranks))
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(key, threads)
    if n_ranks > cores:
        env.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "1")
        env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "true")
    return env


def run_locations(config: str, train_args: list[str]) -> tuple[Path, Path]:
    """The run directory and checkpoint directory that `mpitrain train CONFIG *train_args` will use."""
    out, overrides = None, []
    for i, arg in enumerate(train_args):
        value = train_args[i + 1] if i + 1 < len(train_args) else None
        if arg == "--out":
            out = value
        elif arg.startswith("--out="):
            out = arg.split("=", 1)[1]
        elif arg == "--set" and value is not None:
            overrides.append(value)
        elif arg.startswith("--set="):
            overrides.append(arg.split("=", 1)[1])
    cfg = load_config(config, overrides)
    run_dir = Path(out) if out else default_run_dir(config)
    return run_dir, cfg.checkpoint.directory(run_dir)


def default_run_dir(config_path: str | None) -> Path:
    """RUN_DIR when `mpitrain train` is given no --out: $MPITRAIN_RUNS (default runs/) / the config's name."""
    stem = Path(config_path).stem if config_path else "default"
    return Path(os.environ.get("MPITRAIN_RUNS", "runs")) / stem
