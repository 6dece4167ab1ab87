"""The array backend: numpy on CPUs, CuPy on NVIDIA GPUs, behind one name, `xp`.

Model and parallel code receive a `Backend` and call `backend.xp`, never numpy directly, so the GPU path is the same
code; the ops pick their fused CuPy kernels themselves (mpitrain/kernels/dispatch.py). Host-side work (data loading,
checkpoints, logging) uses numpy and moves arrays with `to_host`/`from_host`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from mpitrain.errors import ConfigError

COMPUTE_DTYPES = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
                  "float16": np.float16}
MASTER_DTYPES = {"float32": np.float32}
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class Backend:
    device: str  # "cpu" | "cuda"
    xp: Any  # the numpy or cupy module
    dtype: Any  # compute dtype (numpy dtype object): parameters, gradients and activations as the ops see them
    master_dtype: Any = None  # optimizer dtype (fp32 master weights and moments); None: the compute dtype

    @property
    def optimizer_dtype(self):
        return self.master_dtype or self.dtype

    @property
    def mixed(self) -> bool:
        """Compute in a lower precision than the master weights: a separate fp32 master copy is kept."""
        return self.optimizer_dtype != self.dtype

    def empty(self, shape, dtype=None, host: bool = True):
        """A buffer to receive into. host: where MPI groups need it (MPI never sees GPU memory: it is not assumed
        CUDA-aware, so GPU arrays cross it through the host; docs/architecture.md, Backends); device groups (NCCL)
        will ask for host=False."""
        return (np if host else self.xp).empty(shape, dtype=dtype or self.dtype)

    def to_host(self, array) -> np.ndarray:
        return array if self.xp is np else self.xp.asnumpy(array)

    def from_host(self, array: np.ndarray, dtype=None):
        return self.xp.asarray(array, dtype=dtype)

    def synchronize(self) -> None:
        """Wait for queued device work, so that timers measure work done, not work launched."""
        if self.xp is not np:
            self.xp.cuda.Stream.null.synchronize()


def array_module(array):
    """numpy or cupy, whichever owns `array`: lets math functions work on both without a backend argument."""
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def wire_view(array):
    """The array as MPI can carry it: bfloat16 has no MPI datatype (nor a DLPack one), so it travels as its bits,
    uint16 (copies only: never reduce with MPI on this view). Other dtypes unchanged."""
    return array.view(np.uint16) if array.dtype == BFLOAT16 else array


def to_host(array) -> np.ndarray:
    """A numpy copy (or the array itself) of a numpy or cupy array."""
    return array if isinstance(array, np.ndarray) else array.get()


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep large freed blocks instead of returning them to the OS.

    Every forward/backward op makes temporaries of several MB; by default each comes fresh from the kernel as
    zeroed pages, a page fault per page, a sizeable share of a CPU step (benchmarks/README.md, "Measurements
    behind the CPU kernels").
    Returns False where the C library is not glibc (nothing changes there)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20) and mallopt(m_trim_threshold, 4 << 30)
                and mallopt(m_top_pad, 256 << 20))


def make_backend(device: str = "cpu", compute: str = "float32", local_rank: int = 0,
                 master: str = "float32") -> Backend:
    """master: the optimizer's dtype when compute is lower (bfloat16, float16); float32/float64 runs keep one copy."""
    if compute not in COMPUTE_DTYPES:
        raise ConfigError(f"precision.compute = {compute!r} is not supported here; allowed: {sorted(COMPUTE_DTYPES)}")
    if master not in MASTER_DTYPES:
        raise ConfigError(f"precision.master = {master!r} is not supported; allowed: {sorted(MASTER_DTYPES)}")
    dtype = np.dtype(COMPUTE_DTYPES[compute])
    master_dtype = np.dtype(MASTER_DTYPES[master])
    master_dtype = None if dtype.itemsize >= master_dtype.itemsize else master_dtype  # float32/64: one copy
    if device == "cpu":
        keep_freed_memory()
        return Backend("cpu", np, dtype, master_dtype)
    if device == "cuda":
        try:
            import cupy
        except ImportError as exc:
            raise ConfigError("device = 'cuda' needs CuPy: pip install 'mpitrain[cuda12]' (or cuda13)") from exc
        n_devices = cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(local_rank % n_devices).use()  # one GPU per rank on a node; shared GPUs only in tests
        return Backend("cuda", cupy, dtype, master_dtype)
    raise ConfigError(f"device = {device!r} is not allowed; allowed: 'cpu', 'cuda'")


def nbytes_of(tree) -> int:
    """Bytes held by the arrays in a nested tuple/list/dict (how activation memory is counted from saved state).

    An array saved twice (one input feeding three projections) is counted once, and a view counts its base's bytes
    only once too, so the number is what the saved state really keeps alive.
    """
    seen: dict[int, int] = {}

    def visit(node):
        if node is None:
            return
        if isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, (tuple, list)):
            for value in node:
                visit(value)
        elif hasattr(node, "nbytes") and hasattr(node, "shape"):
            owner = node
            while getattr(owner, "base", None) is not None and hasattr(owner.base, "nbytes"):
                owner = owner.base
            seen[id(owner)] = max(seen.get(id(owner), 0), int(owner.nbytes))

    visit(tree)
    return sum(seen.values())
