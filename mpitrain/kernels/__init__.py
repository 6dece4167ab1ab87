"""Fused CUDA kernels for the GPU path (CuPy ElementwiseKernel / RawModule / cuBLAS), each the twin of a numpy
reference: the ops of mpitrain/layers/ops.py (norms, GELU, SwiGLU, rotary, linears, attention), softmax and
cross-entropy (reference.py) and AdamW over flat buffers (optim/adamw.py's update). The ops choose their twins where
they are defined (dispatch.py), and numpy arrays stay on the reference code. Nothing here imports CuPy until a
kernel is used.

NOT YET RUN ON A GPU: written against CuPy 14's API and checked by tests/test_gpu_kernels.py, which skip here.
"""

from mpitrain.kernels.dispatch import cupy_status

__all__ = ["cupy_status"]
