"""One FP8 GEMM through cuBLASLt: C = X @ Y^T with X (M, K) and Y (N, K) both K-contiguous, fp8 codes as uint8 bit
patterns (CuPy has no fp8 dtype), fp32 accumulation (CUBLAS_COMPUTE_32F), fp32 output, per-operand scales.

Layout. cuBLASLt's FP8 GEMM takes only "TN" in its column-major terms: A transposed, B not, so both operands lie
with the reduction dimension K contiguous. A row-major (N, K) array is a column-major K x N matrix; as A with
TRANSA = T it is op(A) = N x K; a row-major (M, K) array is B = K x M with TRANSB = N; D = op(A) op(B) is N x M
column-major, which is the row-major (M, N) C. So Y goes in as A and X as B, and the caller hands both operands
K-contiguous (transposed copies of the codes where the product needs them). M, N and K must be multiples of 16.

Scales (`Fp8Operand.mode`), each a float32 dequantization multiplier (scale_inv) read by cuBLASLt on the device:
    scalar   one for the operand (A_SCALE_POINTER / B_SCALE_POINTER, mode SCALAR_32F): tensor, delayed recipes
    vec128   one per row and 128 consecutive K (VEC128_32F, cuBLAS >= 12.9, Hopper): the block recipe's 1x128 tiles
    blk128   one per 128 x 128 block (BLK128x128_32F): the block recipe's weights
Block scale grids go in cuBLAS's compact layout (as Transformer Engine hands them over, no swizzle): vec128 as
(K/128, rows rounded up to 4), rows contiguous; blk128 as (rows/128, K/128 rounded up to 4), K-blocks contiguous.
MXFP8 (VEC32_UE8M0) runs on Blackwell only: on Hopper the mxfp8 recipe keeps the emulation.

The binding is nvmath-python's `nvmath.bindings.cublasLt` (raw pointers, enums read from it). `Fp8Lt` takes any
module with its names, so tests drive it with a fake that records what it is told and computes what cuBLASLt would.

UNTESTED ON A DEVICE: every call is checked on the CPU through that fake (tests/test_fp8_gemm.py); the GPU test
(test_cublaslt_fp8_gemm_on_the_gpu) has not run yet.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from mpitrain.backend import array_module
from mpitrain.kernels.dispatch import import_optional

CUDA_TYPE = {"e4m3": 28, "e5m2": 29, "float32": 0}  # cudaDataType_t: CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, CUDA_R_32F
COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
OP_N, OP_T = 0, 1  # cublasOperation_t
ALIGN = 16  # cuBLASLt FP8: dims and leading dims multiples of 16
SCALE_BLOCK = 128
WORKSPACE_BYTES = 32 << 20
LT_RECIPES = ("tensor", "delayed", "block")  # precision.fp8 recipes whose GEMMs cuBLASLt runs on Hopper
FP8_BITS = {"e4m3": (3, 7), "e5m2": (2, 15)}  # mantissa bits, exponent bias


class Fp8Operand(NamedTuple):
    """One GEMM operand: `codes` (rows, K) uint8 fp8 bit patterns, K contiguous; `scale_inv` float32 (one value,
    or a block grid already in cuBLAS's layout: cublas_scales); `mode` "scalar", "vec128" or "blk128"."""
    codes: object
    fmt: str
    scale_inv: object
    mode: str


def import_cublaslt():
    """(nvmath's cublasLt binding module, '') or (None, why not)."""
    return import_optional("nvmath.bindings.cublasLt",
                           "nvmath-python not installed (pip install -e '.[cuda13]', or '.[cuda12]')", "nvmath-python")


def fp8_bits(values, fmt: str):
    """Values already on the fp8 grid of `fmt` (float32, as the quantizers of layers/fp8.py give them on CuPy) ->
    their uint8 bit patterns, by arithmetic (CuPy has no fp8 dtype): sign, biased exponent, mantissa; subnormals
    where the exponent is below the format's smallest normal one. NaN is never handed in (every cast clips)."""
    xp = array_module(values)
    m_bits, bias = FP8_BITS[fmt]
    v = xp.asarray(values, dtype=np.float32)
    sign = xp.signbit(v).astype(np.uint8) << 7
    mag = xp.abs(v).astype(np.float64)
    mantissa, exponent = xp.frexp(xp.where(mag > 0, mag, 1.0))  # mag = mantissa 2^exponent, mantissa in [0.5, 1)
    biased = exponent - 1 + bias
    normal_code = (biased << m_bits) + xp.rint((mantissa * 2 - 1) * (1 << m_bits)).astype(np.int64)
    subnormal_code = xp.rint(mag * 2.0 ** (bias - 1 + m_bits)).astype(np.int64)  # units of the smallest step
    code = xp.where(biased >= 1, normal_code, subnormal_code)
    return (sign | xp.where(mag > 0, code, 0).astype(np.uint8)).astype(np.uint8)


def cublas_scales(grid, mode: str):
    """A block-scale grid -> cuBLAS's compact layout (float32, C-contiguous). vec128: grid (rows, K/128) ->
    (K/128, rows rounded up to 4); blk128: grid (rows/128, K/128) -> (rows/128, K/128 rounded up to 4); the padding
    is 1 (never read for real rows). scalar: the one value as a (1,) array."""
    xp = array_module(grid)
    grid = xp.asarray(grid, dtype=np.float32)
    if mode == "scalar":
        return grid.reshape(1).copy()
    if mode == "vec128":
        grid = grid.T
    rows, cols = grid.shape
    out = xp.ones((rows, -(-cols // 4) * 4), dtype=np.float32)
    out[:, :cols] = grid
    return out


def unsupported_reason(m: int, n: int, k: int, x: Fp8Operand, y: Fp8Operand) -> str:
    """Why cuBLASLt's FP8 GEMM cannot take C = X @ Y^T ('' when it can): checked before any call, so such shapes
    keep the emulation instead of failing inside the library."""
    if min(m, n, k) <= 0:
        return f"an empty GEMM ({m} x {n} x {k})"
    if m % ALIGN or n % ALIGN or k % ALIGN:
        return f"FP8 GEMMs take dims that are multiples of {ALIGN}, not {m} x {n} x {k}"
    if x.fmt == "e5m2" and y.fmt == "e5m2":
        return "e5m2 x e5m2 has no FP8 GEMM"
    blocked = {x.mode, y.mode} - {"scalar"}
    if blocked and (k % SCALE_BLOCK or "scalar" in {x.mode, y.mode} or x.mode == y.mode == "blk128"):
        return f"block scales need K a multiple of {SCALE_BLOCK}, both operands block-scaled, not 128x128 by 128x128"
    return ""


def device_pointer(array) -> int:
    """The address of an array's first element: CuPy's device pointer (numpy's host pointer for a fake binding)."""
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr


class Fp8Lt:
    """The cuBLASLt handle, workspace and enums of one binding (nvmath's `cublasLt`, or a fake in tests); `matmul`
    runs one FP8 GEMM. Descriptors are made and destroyed per call (they are cheap next to an FP8 GEMM's size)."""

    def __init__(self, lt, stream_pointer=lambda: 0):
        self.lt, self.stream_pointer = lt, stream_pointer
        self._handle, self._workspace = None, None
        self._lock = threading.Lock()
        desc, self.scale_modes = lt.MatmulDescAttribute, lt.MatmulMatrixScale
        self.attr = {name: int(getattr(desc, name)) for name in (
            "TRANSA", "TRANSB", "A_SCALE_POINTER", "B_SCALE_POINTER", "A_SCALE_MODE", "B_SCALE_MODE")}
        self.mode = {"scalar": int(self.scale_modes.SCALAR_32F), "vec128": int(self.scale_modes.VEC128_32F),
                     "blk128": int(self.scale_modes.BLK128x128_32F)}

    def _resources(self, xp):
        with self._lock:
            if self._handle is None:
                self._handle = self.lt.create()
                self._workspace = xp.empty(WORKSPACE_BYTES, dtype=np.uint8)
        return self._handle, self._workspace

    def _set(self, desc, attr: str, value, dtype) -> None:
        box = np.array([value], dtype=dtype)  # the binding copies the attribute out of this host buffer
        self.lt.matmul_desc_set_attribute(desc, self.attr[attr], box.ctypes.data, box.nbytes)

    def matmul(self, x: Fp8Operand, y: Fp8Operand):
        """C = X @ Y^T, float32 (M, N), on the arrays' device; X and Y as Fp8Operand (rows, K), K contiguous."""
        (m, k), n = x.codes.shape, y.codes.shape[0]
        why = unsupported_reason(m, n, k, x, y)
        if why:
            raise ValueError(f"cuBLASLt FP8 GEMM: {why}")
        xp = array_module(x.codes)
        handle, workspace = self._resources(xp)
        out = xp.empty((m, n), dtype=np.float32)
        lt, made = self.lt, []
        desc = lt.matmul_desc_create(COMPUTE_32F, CUDA_TYPE["float32"])
        try:
            self._describe(desc, x, y)
            a = lt.matrix_layout_create(CUDA_TYPE[y.fmt], k, n, k)  # Y (N, K) row-major: column-major K x N
            b = lt.matrix_layout_create(CUDA_TYPE[x.fmt], k, m, k)  # X (M, K) row-major: column-major K x M
            d = lt.matrix_layout_create(CUDA_TYPE["float32"], n, m, n)  # C (M, N) row-major: column-major N x M
            made = [a, b, d]
            algo = self._heuristic(handle, desc, a, b, d)
            alpha, beta = np.ones(1, np.float32), np.zeros(1, np.float32)  # host scalars (default pointer mode)
            lt.matmul(handle, desc, alpha.ctypes.data, device_pointer(y.codes), a, device_pointer(x.codes), b,
                      beta.ctypes.data, device_pointer(out), d, device_pointer(out), d, algo.ptr,
                      device_pointer(workspace), WORKSPACE_BYTES, self.stream_pointer())
        finally:
            for layout in made:
                lt.matrix_layout_destroy(layout)
            lt.matmul_desc_destroy(desc)
        return out

    def _describe(self, desc, x: Fp8Operand, y: Fp8Operand) -> None:
        """TN and the scales: A is Y, B is X (module docstring)."""
        self._set(desc, "TRANSA", OP_T, np.int32)
        self._set(desc, "TRANSB", OP_N, np.int32)
        for side, operand in (("A", y), ("B", x)):
            self._set(desc, f"{side}_SCALE_POINTER", device_pointer(operand.scale_inv), np.int64)
            if operand.mode != "scalar":  # the attribute exists from cuBLAS 12.8; scalar is its default
                self._set(desc, f"{side}_SCALE_MODE", self.mode[operand.mode], np.int32)

    def _heuristic(self, handle, desc, a, b, d):
        """cuBLASLt's first algorithm for this GEMM within the workspace (its struct's address is the algo's)."""
        lt = self.lt
        preference = lt.matmul_preference_create()
        try:
            limit = np.array([WORKSPACE_BYTES], dtype=np.uint64)
            lt.matmul_preference_set_attribute(preference, int(lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES),
                                               limit.ctypes.data, limit.nbytes)
            result, found = lt.MatmulHeuristicResult(1), np.zeros(1, dtype=np.int32)
            lt.matmul_algo_get_heuristic(handle, desc, a, b, d, d, preference, 1, result.ptr, found.ctypes.data)
        finally:
            lt.matmul_preference_destroy(preference)
        if found[0] < 1:
            raise RuntimeError("cuBLASLt found no FP8 GEMM algorithm for this shape and these scales")
        return result


_DEVICE_LT: dict = {}


def device_lt():
    """(the Fp8Lt over nvmath's binding on CuPy's current stream, '') or (None, why not); built once."""
    if "lt" not in _DEVICE_LT:
        lt, why = import_cublaslt()
        if lt is not None:
            import cupy
            _DEVICE_LT["lt"] = (Fp8Lt(lt, lambda: cupy.cuda.get_current_stream().ptr), "")
        else:
            _DEVICE_LT["lt"] = (None, why)
    return _DEVICE_LT["lt"]


def describe_fp8_path(recipe: str, dtype) -> list[str]:
    """The banner's line on where a cuda run's FP8 GEMMs run (none without FP8)."""
    if recipe == "none":
        return []
    if recipe not in LT_RECIPES or np.dtype(dtype) == np.float64:
        why = "mxfp8 needs Blackwell's VEC32_UE8M0" if recipe == "mxfp8" else "no FP8 GEMM accumulates in float64"
        return [f"fp8 {recipe}: emulated on the device (dequantized operands, GEMMs in float32: {why})"]
    lt, why = device_lt()
    if lt is None:
        return [f"fp8 {recipe}: emulated on the device ({why})"]
    wgrad = "; the weight gradient emulated (row-wise scales)" if recipe == "block" else ""
    return [f"fp8 {recipe}: FP8 GEMMs through cuBLASLt: untested on a device{wgrad}"]
