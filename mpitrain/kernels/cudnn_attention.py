"""Fused causal attention on the GPU through cuDNN's SDPA graphs (the `cudnn` package of nvidia-cudnn-frontend):
the T x T scores never exist in memory, forward and backward each run as one fused graph.

One graph per SdpaKey (direction, shape, dtype, causal mask), validated, planned and built at its first use and
kept in `GRAPHS`, the one per-shape cache, beside the cuDNN handles and the answer of importing cudnn.
Grouped-query attention (llama's n_kv_head < n_head) is native: K/V keep their Hkv heads, cuDNN sums dK/dV over
each group.

Contract with ops.attention_forward: `forward` returns the output and cuDNN's "Stats", float32 (B, H, Tq, 1),
each row's max + ln(sum exp) of the scaled scores: the natural-log log-sum-exp that the ops return as `lse`
(not the log2 form, which needs stats_use_log2). `backward` takes them back with the output.

What runs where: building and validating a graph (`build_graph`) needs no device; choosing an execution plan
(`create_execution_plans`) needs the CUDA driver, and the frontend's backend path imports `cuda.bindings`
(the cuda-bindings package), so both are needed on the GPU machine. Install the frontend with `pip install
--no-deps nvidia-cudnn-frontend`: its default dependencies pull a CUTLASS DSL stack the graph API does not use.
"""
from __future__ import annotations

import math
import threading
import warnings
from typing import NamedTuple

import numpy as np

from mpitrain.kernels.dispatch import import_optional

CUDNN_DTYPES = ("bfloat16", "float16")
# Head dims cuDNN's training SDPA (forward and backward) takes on sm80-sm90 across 9.x releases: multiples of 8 up
# to 128 (wider ones depend on the release and the GPU: kept on cuBLAS rather than failing at planning)
MAX_HEAD_DIM = 128
UID = {"q": 1, "k": 2, "v": 3, "o": 4, "stats": 5, "dO": 6, "dQ": 7, "dK": 8, "dV": 9}
# The buffers each direction's graph binds, in the order forward() and backward() hand them over
OPERANDS = {"forward": ("q", "k", "v", "o", "stats"),
            "backward": ("q", "k", "v", "o", "stats", "dO", "dQ", "dK", "dV")}


class SdpaKey(NamedTuple):
    """Everything a graph depends on: the cache's key."""
    direction: str  # "forward" (output and Stats) or "backward" (dQ, dK, dV)
    batch: int
    heads: int
    kv_heads: int
    t_q: int
    t_k: int
    head_dim: int
    dtype: str
    causal: bool    # True: the top-left causal triangle (key <= query); False: no mask


def sdpa_key(direction: str, q, k, causal: bool) -> SdpaKey:
    b, h, t, d = q.shape
    return SdpaKey(direction, b, h, k.shape[1], t, k.shape[2], d, np.dtype(q.dtype).name, bool(causal))


def unsupported_reason(key: SdpaKey) -> str:
    """Why cuDNN's SDPA cannot take this key ('' when it can): checked here, before any graph, so that such
    shapes keep the cuBLAS path instead of failing at planning."""
    if key.dtype not in CUDNN_DTYPES:
        return f"cuDNN's SDPA takes bf16/fp16, not {key.dtype}"
    if key.head_dim % 8 or key.head_dim > MAX_HEAD_DIM:
        return f"head_dim {key.head_dim}: cuDNN's SDPA takes multiples of 8 up to {MAX_HEAD_DIM}"
    if key.heads % key.kv_heads:
        return f"{key.heads} query heads over {key.kv_heads} K/V heads"
    if key.causal and key.t_q != key.t_k:
        return f"a causal mask of {key.t_q} queries over {key.t_k} keys (only the square, top-left one here)"
    return ""


def import_cudnn():
    """(the cudnn module, '') or (None, why not)."""
    return import_optional("cudnn", "cuDNN not installed: pip install nvidia-cudnn-cu13 && pip install --no-deps "
                           "nvidia-cudnn-frontend", "cuDNN frontend")


def row_major(dims) -> list[int]:
    strides = [1] * len(dims)
    for axis in range(len(dims) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * dims[axis + 1]
    return strides


def _dims(key: SdpaKey) -> dict:
    b, d = key.batch, key.head_dim
    q, kv = [b, key.heads, key.t_q, d], [b, key.kv_heads, key.t_k, d]
    return {"q": q, "k": kv, "v": kv, "o": q, "stats": [b, key.heads, key.t_q, 1], "dO": q, "dQ": q, "dK": kv,
            "dV": kv}


def build_graph(cudnn, key: SdpaKey):
    """The key's graph, validated (graph.validate(), build_operation_graph()): no device needed up to here."""
    io = cudnn.data_type.BFLOAT16 if key.dtype == "bfloat16" else cudnn.data_type.HALF
    fp32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=fp32, compute_data_type=fp32)
    dims = _dims(key)

    def tensor(name, data_type=io):
        return graph.tensor(name=name, dim=dims[name], stride=row_major(dims[name]), data_type=data_type,
                            uid=UID[name])

    def output(node, name, data_type=io):
        node.set_uid(UID[name]).set_output(True).set_dim(dims[name]).set_stride(row_major(dims[name]))
        node.set_data_type(data_type)

    q, k, v = tensor("q"), tensor("k"), tensor("v")
    scale = 1.0 / math.sqrt(key.head_dim)
    if key.direction == "forward":
        o, stats = graph.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, attn_scale=scale,
                              use_causal_mask=key.causal)
        output(o, "o")
        output(stats, "stats", fp32)
    else:
        grads = graph.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=tensor("o"), dO=tensor("dO"),
                                    stats=tensor("stats", fp32), attn_scale=scale, use_causal_mask=key.causal)
        for node, name in zip(grads, ("dQ", "dK", "dV")):
            output(node, name)
    graph.validate()
    graph.build_operation_graph()
    return graph


class PlannedGraph(NamedTuple):
    graph: object
    workspace_bytes: int


class SdpaDeclined(RuntimeError):
    """cuDNN proposed no plan for a key on this GPU (an older architecture, a shape outside its engines)."""


class SdpaGraphs:
    """The per-shape graph cache: SdpaKey -> its planned graph (or why cuDNN declined it); and one cuDNN handle
    per (device, thread), since cuDNN forbids sharing a handle between threads. Planning needs the device, so it
    happens at a key's first execution."""

    def __init__(self, importer=None, builder=None):
        self._planned: dict[SdpaKey, PlannedGraph | str] = {}
        self._handles: dict[tuple[int, int], object] = {}
        self._importer, self._builder = importer or import_cudnn, builder or build_graph
        self._import = None  # the importer's answer, asked once: a failed import searches sys.path every time

    def cudnn(self):
        """(the cudnn module, '') or (None, why not)."""
        if self._import is None:
            self._import = self._importer()
        return self._import

    def planned(self, cudnn, key: SdpaKey) -> PlannedGraph:
        if key not in self._planned:
            try:
                graph = self._builder(cudnn, key)
                graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                graph.check_support()
                graph.build_plans()
                self._planned[key] = PlannedGraph(graph, int(graph.get_workspace_size()))
            except cudnn.cudnnGraphNotSupportedError as exc:
                self._planned[key] = f"cuDNN declined {key}: {exc}"
                warnings.warn(f"{self._planned[key]}; this shape keeps the cuBLAS attention", stacklevel=2)
        if isinstance(self._planned[key], str):
            raise SdpaDeclined(self._planned[key])
        return self._planned[key]

    def handle(self, cudnn, device_id: int):
        where = (device_id, threading.get_ident())
        if where not in self._handles:
            self._handles[where] = cudnn.create_handle()
        return self._handles[where]


GRAPHS = SdpaGraphs()


def _execute(key: SdpaKey, arrays: tuple, graphs: SdpaGraphs) -> None:
    """Run the key's graph on CuPy's current stream over `arrays`, contiguous CuPy arrays in OPERANDS' order."""
    import cupy as cp
    cudnn, why = graphs.cudnn()
    if cudnn is None:
        raise RuntimeError(why)
    planned = graphs.planned(cudnn, key)
    handle = graphs.handle(cudnn, cp.cuda.Device().id)
    cudnn.set_stream(handle=handle, stream=cp.cuda.get_current_stream().ptr)
    workspace = cp.empty(max(planned.workspace_bytes, 1), np.uint8)
    # Bare addresses: the graph's declaration says what the bytes mean (CuPy's bf16 has no array-interface
    # spelling); the workspace goes as an array, so that its size travels with it.
    pointers = {UID[name]: array.data.ptr for name, array in zip(OPERANDS[key.direction], arrays, strict=True)}
    planned.graph.execute(pointers, workspace, handle=handle)


def forward(q, k, v, causal: bool, graphs: SdpaGraphs = GRAPHS):
    """(out (B, H, Tq, D), stats float32 (B, H, Tq, 1)) for contiguous bf16/fp16 CuPy q (B, H, Tq, D), k, v
    (B, Hkv, Tk, D): softmax(q k^T / sqrt(D) + causal mask) v and each row's natural-log log-sum-exp."""
    import cupy as cp
    q, k, v = (cp.ascontiguousarray(x) for x in (q, k, v))
    key = sdpa_key("forward", q, k, causal)
    out = cp.empty(q.shape, q.dtype)
    stats = cp.empty(q.shape[:3] + (1,), np.float32)
    _execute(key, (q, k, v, out, stats), graphs)
    return out, stats


def backward(q, k, v, out, stats, dout, causal: bool, graphs: SdpaGraphs = GRAPHS):
    """(dq, dk, dv) of `forward`, from its inputs, output and stats and the output's gradient dout."""
    import cupy as cp
    q, k, v, out = (cp.ascontiguousarray(x) for x in (q, k, v, out))
    dout = cp.ascontiguousarray(dout.astype(q.dtype, copy=False))
    key = sdpa_key("backward", q, k, causal)
    dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
    _execute(key, (q, k, v, out, stats, dout, dq, dk, dv), graphs)
    return dq, dk, dv
