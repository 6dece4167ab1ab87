"""Which code runs an op: its own (numpy or CuPy) code, or a fused twin in mpitrain/kernels for CuPy arrays.

The ops of mpitrain/layers/ops.py name their twins where they are defined, with the decorators below (see
docs/architecture.md, Backends). numpy arrays always run the op's own code, so CPU runs and tests never reach a
kernel; nothing here imports CuPy, which kernels/fused.py and kernels/attention.py load at a kernel's first use.

    gpu_twin                    CuPy arrays of any dtype; bf16/fp16 are cast to float32 around the kernel by the
                                same rule as the numpy ops (layers/precision.py), the accumulators kept in theirs
    gpu_twin_in_low_precision   bf16/fp16 CuPy arrays, in their own dtype: the linears' GEMMs on tensor cores
                                (cuBLAS accumulates in fp32); fp32/fp64 CuPy linears keep the op's code
    gpu_twin_for_gemm_dtypes    bf16/fp16/fp32 CuPy arrays: attention (cuDNN's fused SDPA for bf16/fp16 where
                                installed, else strided-batched GEMMs; float64 keeps the op's code, CuPy's matmul)
"""

from __future__ import annotations

import functools

import numpy as np

from mpitrain.backend import array_module
from mpitrain.layers.precision import computes_in_float32, low_precision_dtype

GEMM_DTYPES = frozenset({"bfloat16", "float16", "float32"})


def import_optional(module: str, install_hint: str, what: str):
    """(the module, '') or (None, why not) for an optional NVIDIA library: not installed (install_hint says how), or
    installed but failing to import (a broken install raises its own errors; say which)."""
    import importlib
    try:
        return importlib.import_module(module), ""
    except ImportError:
        return None, install_hint
    except Exception as exc:  # noqa: BLE001
        return None, f"{what} failed to import ({type(exc).__name__}: {exc})"


def cupy_status() -> tuple[bool, str]:
    """(usable, why not): CuPy importable and at least one GPU visible."""
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed (pip install 'mpitrain[cuda12]' or cuda13)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 (CuPy raises its own runtime errors without a driver)
        return False, f"CuPy sees no CUDA device ({type(exc).__name__}: {exc})"
    return (count > 0, "" if count else "CuPy sees no CUDA device")


def _first_array(args):
    for value in args:
        if hasattr(value, "dtype"):
            return value
        if isinstance(value, (tuple, list)) and value:
            return _first_array(value)
    return None


def _route(original, twin, use_twin):
    """`original` for numpy arrays; `twin` for CuPy arrays that `use_twin(first array, args)` accepts."""

    @functools.wraps(original)
    def op(*args, **kwargs):
        first = _first_array(args)
        if first is not None and array_module(first) is not np and use_twin(first, args):
            return twin(*args, **kwargs)
        return original(*args, **kwargs)

    return op


def gpu_twin(twin, accumulators=()):
    """Decorator of an op: CuPy arrays go to `twin` under the cast rule; `accumulators` name the twin's arguments
    that it adds into (kept in their dtype, as the op's own computes_in_float32 declares them)."""
    return lambda original: _route(original, computes_in_float32(*accumulators)(twin), lambda first, args: True)


def gpu_twin_in_low_precision(twin):
    """Decorator of a linear op: bf16/fp16 CuPy arrays go to `twin` in their own dtype."""
    return lambda original: _route(original, twin, lambda first, args: low_precision_dtype(args) is not None)


def gpu_twin_for_gemm_dtypes(twin):
    """Decorator of an attention op: bf16/fp16/fp32 CuPy arrays go to `twin`."""
    return lambda original: _route(original, twin, lambda first, args: np.dtype(first.dtype).name in GEMM_DTYPES)
