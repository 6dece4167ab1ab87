"""The kernels. Elementwise ops are CuPy ElementwiseKernels (one pass, no temporaries); row ops (norms, softmax,
cross-entropy) are one thread block per row reducing in registers and shared memory; the linears are 2-D GEMMs in
the compute dtype (attention's batched GEMMs are in kernels/attention.py).
Each function takes and returns CuPy arrays of float32 or float64 (low precision is cast around them by
layers/precision.py's rule, as for the numpy ops) and matches its reference in mpitrain/layers/ops.py or
kernels/reference.py. Kernels compile at first use and CuPy caches them on disk.
"""

from __future__ import annotations

import functools
import math

import numpy as np

GELU_K = math.sqrt(2.0 / math.pi)
ROW_THREADS = 256  # threads per row block: 8 warps; rows are d_model or vocab wide

_ROW_SOURCE = r"""
// -infinity without math headers (NVRTC compiles this with no includes)
template<typename T> __device__ T lowest();
template<> __device__ float lowest<float>() { return -__int_as_float(0x7f800000); }
template<> __device__ double lowest<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }
template<typename T> __device__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}
template<typename T> __device__ T warp_max(T v) {
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_down_sync(0xffffffffu, v, o));
    return v;
}
// Sum (or max) over the block; every thread gets the result. `shared` holds one value per warp.
template<typename T> __device__ T block_reduce(T v, T* shared, bool is_max) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = is_max ? warp_max(v) : warp_sum(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T u = threadIdx.x < warps ? shared[threadIdx.x] : (is_max ? lowest<T>() : T(0));
        u = is_max ? warp_max(u) : warp_sum(u);
        if (threadIdx.x == 0) shared[32] = u;
    }
    __syncthreads();
    T result = shared[32];
    __syncthreads();
    return result;
}

// rmsnorm (centre = 0) or layernorm (centre = 1) forward of one row per block.
template<typename T> __global__ void norm_forward(const T* x, const T* w, const T* b, T* y, T* xhat, T* rstd,
                                                  int n, T eps, int centre) {
    __shared__ T shared[33];
    const T* xr = x + (long long)blockIdx.x * n;
    T mean = 0;
    if (centre) {
        T s = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i];
        mean = block_reduce(s, shared, false) / n;
    }
    T sq = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { T d = xr[i] - mean; sq += d * d; }
    T r = T(1) / sqrt(block_reduce(sq, shared, false) / n + eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
    long long base = (long long)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        T h = (xr[i] - mean) * r;
        xhat[base + i] = h;
        y[base + i] = centre ? h * w[i] + b[i] : h * w[i];
    }
}

// dx of either norm from the saved xhat and rstd: (dxhat - mean(dxhat)[centre] - xhat mean(dxhat xhat)) rstd.
template<typename T> __global__ void norm_backward(const T* xhat, const T* rstd, const T* w, const T* dy, T* dx,
                                                   int n, int centre) {
    __shared__ T shared[33];
    long long base = (long long)blockIdx.x * n;
    T s0 = 0, s1 = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        T g = dy[base + i] * w[i];
        s0 += g;
        s1 += g * xhat[base + i];
    }
    T mean0 = centre ? block_reduce(s0, shared, false) / n : T(0);
    T mean1 = block_reduce(s1, shared, false) / n;
    T r = rstd[blockIdx.x];
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        T g = dy[base + i] * w[i];
        dx[base + i] = (g - mean0 - xhat[base + i] * mean1) * r;
    }
}

template<typename T> __global__ void softmax_forward(const T* x, T* y, int n) {
    __shared__ T shared[33];
    long long base = (long long)blockIdx.x * n;
    T top = lowest<T>();
    for (int i = threadIdx.x; i < n; i += blockDim.x) top = fmax(top, x[base + i]);
    top = block_reduce(top, shared, true);
    T s = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += exp(x[base + i] - top);
    s = block_reduce(s, shared, false);
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[base + i] = exp(x[base + i] - top) / s;
}

template<typename T> __global__ void softmax_backward(const T* y, const T* dy, T* dx, int n) {
    __shared__ T shared[33];
    long long base = (long long)blockIdx.x * n;
    T s = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += dy[base + i] * y[base + i];
    s = block_reduce(s, shared, false);
    for (int i = threadIdx.x; i < n; i += blockDim.x) dx[base + i] = y[base + i] * (dy[base + i] - s);
}

// Loss lse - logit[target] and dlogits = (softmax - onehot) * scale of one row, without storing the probabilities.
template<typename T> __global__ void cross_entropy(const T* logits, const long long* targets, T* loss, T* dlogits,
                                                   int n, T scale) {
    __shared__ T shared[33];
    long long base = (long long)blockIdx.x * n;
    T top = lowest<T>();
    for (int i = threadIdx.x; i < n; i += blockDim.x) top = fmax(top, logits[base + i]);
    top = block_reduce(top, shared, true);
    T s = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += exp(logits[base + i] - top);
    s = block_reduce(s, shared, false);
    long long target = targets[blockIdx.x];
    if (threadIdx.x == 0) loss[blockIdx.x] = log(s) + top - logits[base + target];
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        T p = exp(logits[base + i] - top) / s;
        dlogits[base + i] = (p - (i == target ? T(1) : T(0))) * scale;
    }
}
"""
_ROW_KERNELS = ("norm_forward", "norm_backward", "softmax_forward", "softmax_backward", "cross_entropy")


@functools.cache
def _cupy():
    import cupy
    return cupy


@functools.cache
def _row_module():
    cp = _cupy()
    names = [f"{kernel}<{ctype}>" for kernel in _ROW_KERNELS for ctype in ("float", "double")]
    return cp.RawModule(code=_ROW_SOURCE, options=("-std=c++14",), name_expressions=names)


def _row_kernel(name: str, dtype):
    ctype = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}.get(np.dtype(dtype))
    if ctype is None:
        raise TypeError(f"fused {name}: float32 or float64 arrays only, got {np.dtype(dtype).name}")
    return _row_module().get_function(f"{name}<{ctype}>")


def _launch_rows(name, rows: int, args, dtype) -> None:
    if rows:
        _row_kernel(name, dtype)((rows,), (ROW_THREADS,), args)


def _scalar(value, dtype):
    return np.dtype(dtype).type(value)


# ---- norms -------------------------------------------------------------------------------------------------------
def _norm_forward(x, w, b, eps, centre: bool):
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    n = x.shape[-1]
    rows = x.size // n
    y, xhat, rstd = cp.empty_like(x), cp.empty_like(x), cp.empty((*x.shape[:-1], 1), x.dtype)
    _launch_rows("norm_forward", rows, (x, w, b if centre else w, y, xhat, rstd, np.int32(n),
                                        _scalar(eps, x.dtype), np.int32(centre)), x.dtype)
    return y, (xhat, rstd)


def layernorm_forward(x, w, b, eps):
    return _norm_forward(x, w, b, eps, centre=True)


def rmsnorm_forward(x, w, eps):
    return _norm_forward(x, w, None, eps, centre=False)


def _norm_backward(saved, w, dy, dw, db, centre: bool, residual=None):
    cp = _cupy()
    xhat, rstd = saved
    dy = cp.ascontiguousarray(dy)
    n = dy.shape[-1]
    dx = cp.empty_like(dy)
    _launch_rows("norm_backward", dy.size // n, (xhat, rstd, w, dy, dx, np.int32(n), np.int32(centre)), dy.dtype)
    rows_dy = dy.reshape(-1, n)
    dw += (rows_dy * xhat.reshape(-1, n)).sum(axis=0)
    if db is not None:
        db += rows_dy.sum(axis=0)
    if residual is not None:
        dx += residual
    return dx


def layernorm_backward(saved, w, dy, dw, db, residual=None):
    return _norm_backward(saved, w, dy, dw, db, True, residual)


def rmsnorm_backward(saved, w, dy, dw, residual=None):
    return _norm_backward(saved, w, dy, dw, None, False, residual)


# ---- softmax and cross-entropy -----------------------------------------------------------------------------------
def softmax_forward(x):
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    y = cp.empty_like(x)
    _launch_rows("softmax_forward", x.size // x.shape[-1], (x, y, np.int32(x.shape[-1])), x.dtype)
    return y


def softmax_backward(y, dy):
    cp = _cupy()
    dy = cp.ascontiguousarray(dy)
    dx = cp.empty_like(dy)
    _launch_rows("softmax_backward", dy.size // dy.shape[-1], (y, dy, dx, np.int32(dy.shape[-1])), dy.dtype)
    return dx


def cross_entropy_with_grad(logits, targets, scale: float):
    cp = _cupy()
    logits = cp.ascontiguousarray(logits)
    targets = cp.ascontiguousarray(targets, dtype=cp.int64)
    loss, dlogits = cp.empty(targets.shape, logits.dtype), cp.empty_like(logits)
    _launch_rows("cross_entropy", targets.size, (logits, targets, loss, dlogits, np.int32(logits.shape[-1]),
                                                 _scalar(scale, logits.dtype)), logits.dtype)
    return loss, dlogits


# ---- elementwise -------------------------------------------------------------------------------------------------
@functools.cache
def _elementwise():
    cp = _cupy()
    k, a = repr(GELU_K), "0.044715"
    return {
        "gelu_forward": cp.ElementwiseKernel(
            "T x", "T y", f"T t = tanh(T({k}) * (x + T({a}) * x * x * x)); y = T(0.5) * x * (T(1) + t);",
            "mpitrain_gelu_forward"),
        "gelu_backward": cp.ElementwiseKernel(
            "T x, T dy", "T dx",
            f"T t = tanh(T({k}) * (x + T({a}) * x * x * x));"
            f"T slope = T(0.5) * x * (T(1) - t * t) * T({k}) * (T(1) + T(3 * {a}) * x * x);"
            "dx = (slope + T(0.5) * (T(1) + t)) * dy;",
            "mpitrain_gelu_backward"),
        "swiglu_forward": cp.ElementwiseKernel(
            "T g, T u", "T y", "T s = T(1) / (T(1) + exp(-g)); y = g * s * u;", "mpitrain_swiglu_forward"),
        "swiglu_backward": cp.ElementwiseKernel(
            "T g, T u, T dy", "T dg, T du",
            "T s = T(1) / (T(1) + exp(-g)); du = dy * (g * s); dg = s * (T(1) + g * (T(1) - s)) * dy * u;",
            "mpitrain_swiglu_backward"),
        # x (..., T, D) contiguous, cos/sin (T, D/2); sign -1 rotates back (the backward).
        "rope": cp.ElementwiseKernel(
            "raw T x, raw T cos_t, raw T sin_t, int64 t_len, int64 dim, T sign", "T y",
            "long long half = dim / 2, d = i % dim, t = (i / dim) % t_len;"
            "long long j = t * half + (d < half ? d : d - half);"
            "T c = cos_t[j], s = sign * sin_t[j];"
            "y = d < half ? x[i] * c - x[i + half] * s : x[i] * c + x[i - half] * s;",
            "mpitrain_rope"),
        # optim/adamw.py's update; `shrink` = 1 - lr wd on decayed elements (1 elsewhere).
        "adamw": cp.ElementwiseKernel(
            "T g, T shrink, T beta1, T beta2, T eps, T bias2_sqrt, T step_size, T grad_scale", "T p, T m, T v",
            "T gs = g * grad_scale; p = p * shrink;"
            "m = beta1 * m + (T(1) - beta1) * gs; v = beta2 * v + (T(1) - beta2) * (gs * gs);"
            "p -= (m / (sqrt(v) / bias2_sqrt + eps)) * step_size;",
            "mpitrain_adamw"),
    }


def gelu_forward(x, bias=None):
    """ops.gelu_forward's contract: GELU of x + bias, saving the pre-activation."""
    if bias is not None:
        x = x + bias
    return _elementwise()["gelu_forward"](x), x


def gelu_backward(x, dy):
    return _elementwise()["gelu_backward"](x, dy)


def swiglu_forward(gate, up):
    return _elementwise()["swiglu_forward"](gate, up), (gate, up)


def swiglu_backward(saved, dy):
    return _elementwise()["swiglu_backward"](saved[0], saved[1], dy)


def _rope(x, cos, sin, sign):
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    y = cp.empty_like(x)
    return _elementwise()["rope"](x, cp.ascontiguousarray(cos), cp.ascontiguousarray(sin), x.shape[-2],
                                  x.shape[-1], _scalar(sign, x.dtype), y)


def rope_forward(x, cos, sin):
    return _rope(x, cos, sin, 1.0)


def rope_backward(dy, cos, sin):
    return _rope(dy, cos, sin, -1.0)


def adamw_update(p, g, m, v, *, lr, beta1, beta2, eps, step, shrink=1.0, grad_scale=1.0) -> None:
    """In place over flat buffers p (master weights), m, v; g is cast to their dtype first."""
    dtype = p.dtype
    c = functools.partial(_scalar, dtype=dtype)
    g = g.astype(dtype, copy=False)
    _elementwise()["adamw"](g, c(shrink), c(beta1), c(beta2), c(eps), c(math.sqrt(1.0 - beta2 ** step)),
                            c(lr / (1.0 - beta1 ** step)), c(grad_scale), p, m, v)


# ---- linears in the compute dtype ---------------------------------------------------------------------------------
# The cast rule would run bf16/fp16 linears as fp32 GEMMs (no tensor cores); on the GPU they stay 2-D GEMMs in their
# own dtype, which cuBLAS accumulates in fp32. Same contracts as ops.linear_*.
def _rows(x):
    return x.reshape(-1, x.shape[-1])


def linear_forward(x, w, b=None):
    y = _rows(x) @ w
    if b is not None:
        y += b
    return y.reshape(*x.shape[:-1], w.shape[1]), x


def linear_input_grad(weights, output_grads):
    dx = None
    for w, dy in zip(weights, output_grads):
        part = _rows(dy) @ w.T
        dx = part if dx is None else dx + part
    return dx.reshape(*output_grads[0].shape[:-1], weights[0].shape[0])


def add_weight_grad(dw, x, dy) -> None:
    dw += _rows(x).T @ _rows(dy)


def add_bias_grad(db, dy) -> None:
    db += _rows(dy).sum(axis=0, dtype=np.float32)
