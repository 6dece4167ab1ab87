"""CuPy arrays faked over host memory, for the GPU path's Python-level checks on a machine without a GPU driver.

With CuPy installed and no driver, `import cupy` works and a `cupy.ndarray` can be made over host memory; its
views, reshapes and dtype views work, and whatever launches device work (a kernel, a memset, a device query)
raises `cupy.cuda.runtime.CUDARuntimeError`. So a test can check that a GPU path gets past CuPy's and numpy's
Python-level type checks (which fail with TypeError or ValueError before any device work) by expecting that error.
Inside `host_allocator`, `cupy.empty` and `empty_like` hand out host memory too (`cupy.zeros` still needs a memset).

Never hand these arrays to a real GPU: a kernel would read host addresses. `fake_cupy()` therefore skips where a
GPU is usable (the real GPU tests run there instead).
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from mpitrain.kernels import cupy_status


def fake_cupy():
    """The cupy module, or skip: without CuPy installed, or with a GPU (use real device arrays there)."""
    cupy = pytest.importorskip("cupy", reason="fake device arrays need CuPy installed (pip install -e "
                                              "'.[gpu-check]'); no GPU or driver is needed")
    if cupy_status()[0]:
        pytest.skip("a GPU is usable here: the GPU tests check this path on real device arrays")
    return cupy


def device_work_error(cupy):
    """What CuPy raises once a fake array reaches device work (no driver)."""
    return cupy.cuda.runtime.CUDARuntimeError


def fake_device_array(cupy, host: np.ndarray):
    """A cupy.ndarray over (a contiguous copy of) `host`'s memory; it keeps that memory alive."""
    host = np.ascontiguousarray(host)
    memory = cupy.cuda.UnownedMemory(host.ctypes.data, host.nbytes, host, 0)
    return cupy.ndarray(host.shape, host.dtype, cupy.cuda.MemoryPointer(memory, 0))


@contextlib.contextmanager
def host_allocator(cupy):
    """cupy.empty (and what allocates through it without a kernel) returns fake arrays while inside; this thread
    only."""
    def allocate(nbytes: int):
        host = np.zeros(max(nbytes, 1), np.uint8)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(host.ctypes.data, host.nbytes, host, 0), 0)

    with cupy.cuda.using_allocator(allocate):
        yield
