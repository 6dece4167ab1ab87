"""Fused CUDA kernels for the GPU path (CuPy ElementwiseKernel / RawModule / cuBLAS), each the twin of a numpy
reference: the ops of mpitrain/layers/ops.py (norms, GELU, SwiGLU, rotary), softmax and cross-entropy (reference.py)
and AdamW over flat buffers (optim/adamw.py's update). `install()` makes the ops dispatch to them for CuPy arrays
and leaves numpy arrays on the reference code. Nothing here imports CuPy until a kernel is used.

NOT YET RUN ON A GPU: written against CuPy 14's API and checked by tests/test_gpu_kernels.py, which skip here.
"""

from mpitrain.kernels.dispatch import cupy_status, install

__all__ = ["cupy_status", "install"]
