"""Route the ops to the fused kernels for CuPy arrays, without touching the ops' code: `install()` wraps the
functions of mpitrain/layers/ops.py that have a fused twin (the layers call them as `ops.name`) and AdamW's
per-segment update. numpy arrays keep going to the originals, so CPU runs and tests are unchanged. Low-precision
arrays are cast to float32 around the kernels by the same rule as the numpy ops (layers/precision.py), except in
the linears: bf16/fp16 CuPy linears run as GEMMs in their own dtype (tensor cores, fp32 accumulation in cuBLAS).
"""

from __future__ import annotations

import functools

import numpy as np

from mpitrain.backend import array_module
from mpitrain.layers.precision import computes_in_float32, low_precision_dtype

# Linears whose bf16/fp16 CuPy arrays skip the cast rule (native GEMMs); fp32/fp64 ones keep the ops' code.
NATIVE_LOW_PRECISION_OPS = ("linear_forward", "linear_input_grad", "add_weight_grad", "add_bias_grad")
# Attention's batched products: cuBLAS strided-batched GEMM for CuPy bf16/fp16/fp32 (float64 keeps CuPy's matmul).
ATTENTION_OPS = ("attention_forward", "attention_backward")
GEMM_DTYPES = frozenset({"bfloat16", "float16", "float32"})
# op -> the arguments it adds into (kept in their dtype by the cast rule, as ops.py declares them)
FUSED_OPS = {"layernorm_forward": (), "layernorm_backward": ("dw", "db"), "rmsnorm_forward": (),
             "rmsnorm_backward": ("dw",), "gelu_forward": (), "gelu_backward": (), "swiglu_forward": (),
             "swiglu_backward": (), "rope_forward": (), "rope_backward": ()}


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


def _route(original, twin, use_twin, call=None):
    """`original` for numpy arrays; `call` (default: `twin`) for CuPy arrays that `use_twin(first, args)` accepts.
    The wrapper keeps `twin` as `fused_twin`, which also marks an op as already installed."""
    call = call or twin

    @functools.wraps(original)
    def op(*args, **kwargs):
        first = _first_array(args)
        if first is not None and array_module(first) is not np and use_twin(first, args):
            return call(*args, **kwargs)
        return original(*args, **kwargs)

    op.fused_twin = twin
    return op


def _dispatching(name: str, original, fused_function, accumulators=()):
    return _route(original, fused_function, lambda first, args: True,
                  call=computes_in_float32(*accumulators)(fused_function))


def _native_when_low_precision(original, native_function):
    return _route(original, native_function, lambda first, args: low_precision_dtype(args) is not None)


def _gemm_attention(original, gemm_function):
    return _route(original, gemm_function, lambda first, args: np.dtype(first.dtype).name in GEMM_DTYPES)


def install() -> bool:
    """Make ops.* and AdamW dispatch CuPy arrays to the fused kernels (idempotent). False if CuPy is unusable."""
    usable, _ = cupy_status()
    if not usable:
        return False
    from mpitrain.kernels import attention, fused
    from mpitrain.layers import ops
    from mpitrain.optim.adamw import AdamW
    for name, accumulators in FUSED_OPS.items():
        current = getattr(ops, name)
        if not hasattr(current, "fused_twin"):
            setattr(ops, name, _dispatching(name, current, getattr(fused, name), accumulators))
    for name in NATIVE_LOW_PRECISION_OPS:
        current = getattr(ops, name)
        if not hasattr(current, "fused_twin"):
            setattr(ops, name, _native_when_low_precision(current, getattr(fused, name)))
    for name in ATTENTION_OPS:
        current = getattr(ops, name)
        if not hasattr(current, "fused_twin"):
            setattr(ops, name, _gemm_attention(current, getattr(attention, f"gpu_{name}")))
    if hasattr(AdamW, "_update") and not hasattr(AdamW._update, "fused_twin"):
        AdamW._update = _fused_adamw(AdamW._update)
    return True


def _fused_adamw(original):
    """AdamW._update with one fused kernel for the moments and the step (decay first, as the reference does)."""
    from mpitrain.kernels import fused

    @functools.wraps(original)
    def update(self, segment, m, v, lr, grad_scale):
        p = segment.params
        if array_module(p) is np or p.dtype != m.dtype:
            return original(self, segment, m, v, lr, grad_scale)
        h = self.hyper
        if h.weight_decay and lr:
            for start, end in segment.decay_ranges:
                p[start:end] *= 1.0 - lr * h.weight_decay
        fused.adamw_update(p, segment.grads, m, v, lr=lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                           step=self.steps_taken, grad_scale=grad_scale)
        return None

    update.fused_twin = fused.adamw_update
    return update
