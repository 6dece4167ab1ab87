"""The layouts of attention heads between the linears' rows and the attention cores: (B, T, n_heads * D) rows, as
the QKV linear makes them and the output projection takes them, against (B, n_heads, T, D) heads, as the cores
take them."""
from __future__ import annotations

from mpitrain.backend import array_module


def split_heads(x, n_heads: int):
    """(B, T, n_heads * D) -> contiguous (B, n_heads, T, D)."""
    b, t, _ = x.shape
    return array_module(x).ascontiguousarray(x.reshape(b, t, n_heads, -1).transpose(0, 2, 1, 3))


def head_view(x, n_heads: int):
    """(B, T, n_heads * D) -> a (B, n_heads, T, D) view, no copy: the numpy attention core takes strided heads (its
    products read rows with a stride) and writes its results in this layout, so merge_heads copies nothing either."""
    if array_module(x).__name__ != "numpy":
        return split_heads(x, n_heads)  # CuPy's batched products want contiguous heads
    b, t, _ = x.shape
    return x.reshape(b, t, n_heads, -1).transpose(0, 2, 1, 3)


def merge_heads(x):
    """(B, H, T, D) -> (B, T, H * D); a view when x is a head_view-like layout (the attention core's outputs, also
    its dq/dk/dv, which sit side by side in one buffer for the QKV linear's one product), else a copy."""
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)
