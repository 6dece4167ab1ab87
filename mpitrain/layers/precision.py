"""The one cast rule of low-precision compute: store in bfloat16/float16, compute each op in float32.

numpy has no bf16 matmul (ml_dtypes' bfloat16 runs scalar loops, about 100x slower, and sums in bf16), so every op of
mpitrain/layers/ops.py is wrapped by `computes_in_float32`: when any array argument is bfloat16 or float16, the
low-precision arguments are cast up to float32, the op runs (float32 accumulation in matmuls, softmax, norms and the
loss), and its floating outputs, saved state included, are rounded back to that dtype. Activations, parameters and
saved state are therefore stored as on a GPU running in that dtype, while the arithmetic inside an op is fp32.

float32 and float64 arrays pass straight through: no copy and no cast, only a dtype lookup per argument.
"""
from __future__ import annotations

import functools
import inspect

import ml_dtypes
import numpy as np

LOW_PRECISION = frozenset({np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)})


def low_precision_dtype(tree):
    """The first bfloat16/float16 dtype among the arrays of a nested tuple/list/dict, or None."""
    if isinstance(tree, (tuple, list)):
        for node in tree:
            found = low_precision_dtype(node)
            if found is not None:
                return found
        return None
    if isinstance(tree, dict):
        return low_precision_dtype(tuple(tree.values()))
    dtype = getattr(tree, "dtype", None)
    return dtype if dtype in LOW_PRECISION else None


def _up(tree, originals: dict):
    """Low-precision arrays -> float32 copies (remembering each copy's original, so that an output that is just an
    input handed through stays the very same array, not a second one)."""
    if isinstance(tree, tuple):
        return tuple(_up(node, originals) for node in tree)
    if isinstance(tree, list):
        return [_up(node, originals) for node in tree]
    if getattr(tree, "dtype", None) in LOW_PRECISION:
        wide = tree.astype(np.float32)
        originals[id(wide)] = tree
        return wide
    return tree


def _down(tree, dtype, originals: dict):
    """float32 arrays (not 0-d scalars such as a loss sum, which stay fp32) -> dtype; everything else unchanged."""
    if isinstance(tree, tuple):
        return tuple(_down(node, dtype, originals) for node in tree)
    if isinstance(tree, list):
        return [_down(node, dtype, originals) for node in tree]
    if id(tree) in originals:
        return originals[id(tree)]
    if getattr(tree, "dtype", None) == np.float32 and tree.ndim > 0:
        originals[id(tree)] = rounded = tree.astype(dtype)  # an output returned twice stays one array
        return rounded
    return tree


def computes_in_float32(*accumulators: str):
    """Decorator of an op: the cast rule above. `accumulators` name the arguments the op ADDS results into (gradient
    arrays): they keep their dtype, and numpy rounds the fp32 results as they are added."""

    def wrap(op):
        names = list(inspect.signature(op).parameters)
        keep = {names.index(name) for name in accumulators}

        @functools.wraps(op)
        def run(*args):
            dtype = low_precision_dtype([arg for i, arg in enumerate(args) if i not in keep])
            if dtype is None:
                return op(*args)
            originals: dict = {}
            wide = [arg if i in keep else _up(arg, originals) for i, arg in enumerate(args)]
            return _down(op(*wide), dtype, originals)

        return run

    return wrap
