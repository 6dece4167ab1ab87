"""cuDNN's fused attention (mpitrain/kernels/cudnn_attention.py): every SDPA graph the models would use is built and
validated here without a GPU (graph.validate(), build_operation_graph(); choosing an execution plan needs the CUDA
driver, so it waits for a device), the choice between cuDNN and cuBLAS is checked on numpy, and on a GPU the fused
forward and backward are compared with the numpy ops."""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

from mpitrain.config import load_config
from mpitrain.kernels import attention, cudnn_attention, cupy_status
from mpitrain.kernels.cudnn_attention import SdpaKey, unsupported_reason
from mpitrain.layers import ops

GPU_USABLE, GPU_REASON = cupy_status()
NO_CUDNN = ("the cuDNN frontend is not installed: pip install -e '.[gpu-check]', then "
            "pip install --no-deps nvidia-cudnn-frontend==1.32.0")


def _model_shapes():
    """(name, batch, heads, kv heads, seq_len, head_dim) per rank: GPT-2 small (12 heads of 64, 1024 tokens, micro-
    batches of 32) at tp 1 and 2, bench-small as its config says, and llama shapes with grouped-query attention
    (8 heads over 2; llama-3-8B's 32 over 8 with head dim 128 and 8192 tokens)."""
    small = load_config("configs/bench-small.toml").model
    return [("gpt2-124m", 32, 12, 12, 1024, 64),
            ("gpt2-124m tp2", 32, 6, 6, 1024, 64),
            ("bench-small", 8, small.n_head, small.kv_heads, small.seq_len, small.head_dim),
            ("llama gqa 8/2", 4, 8, 2, 1024, 64),
            ("llama-3-8b gqa 32/8", 1, 32, 8, 8192, 128)]


MODEL_KEYS = [SdpaKey(direction, b, h, hkv, t, t, d, dtype, True)
              for _, b, h, hkv, t, d in _model_shapes()
              for direction in ("forward", "backward") for dtype in ("bfloat16", "float16")]


@pytest.fixture(scope="module")
def cudnn():
    return pytest.importorskip("cudnn", reason=NO_CUDNN)


@pytest.mark.parametrize("key", MODEL_KEYS, ids=lambda k: f"{k.direction}-{k.heads}/{k.kv_heads}-T{k.t_q}-"
                                                        f"d{k.head_dim}-{k.dtype}")
def test_every_model_graph_builds_and_validates(cudnn, key):
    assert unsupported_reason(key) == ""
    graph = cudnn_attention.build_graph(cudnn, key)
    node = graph.nodes[0]
    assert node.params["use_causal_mask"] is True
    assert node.params["attn_scale"] == pytest.approx(key.head_dim ** -0.5)
    b, h, hkv, t, d = key.batch, key.heads, key.kv_heads, key.t_q, key.head_dim
    want = {"forward": {"o": [b, h, t, d], "stats": [b, h, t, 1]},
            "backward": {"dQ": [b, h, t, d], "dK": [b, hkv, t, d], "dV": [b, hkv, t, d]}}[key.direction]
    assert {t.uid: list(t.dim) for t in graph.get_outputs()} == {cudnn_attention.UID[n]: w for n, w in want.items()}
    # what forward()/backward() bind, by uid, is exactly what the graph reads and writes
    bound = {t.uid for t in graph.get_inputs() + graph.get_outputs()}
    assert bound == {cudnn_attention.UID[name] for name in cudnn_attention.OPERANDS[key.direction]}


def test_ring_attention_full_block_graph_validates(cudnn):
    """A ring's full block (keys of an earlier chunk) is the same graph without a mask."""
    for direction in ("forward", "backward"):
        graph = cudnn_attention.build_graph(cudnn, SdpaKey(direction, 2, 8, 2, 512, 512, 64, "bfloat16", False))
        assert not graph.nodes[0].params.get("use_causal_mask")


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 3, 64), (8, 2, 260)])
def test_an_invalid_graph_fails_validation(cudnn, direction, heads, kv_heads, head_dim):
    """Heads that do not group (8 over 3) and a head dim that is no multiple of 8: the frontend's own checks."""
    with pytest.raises(cudnn.cudnnGraphNotSupportedError):
        cudnn_attention.build_graph(cudnn, SdpaKey(direction, 2, heads, kv_heads, 256, 256, head_dim, "bfloat16",
                                                   True))


def test_planning_needs_the_device(cudnn):
    """Where the CPU stops: choosing an execution plan asks the driver (this is why the cache plans at first use)."""
    if GPU_USABLE:
        pytest.skip("a GPU is usable here: planning works")
    graph = cudnn_attention.build_graph(cudnn, MODEL_KEYS[0])
    with pytest.raises(Exception, match="(?i)driver|device|cuda"):
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])


@pytest.mark.parametrize("key, why", [
    (SdpaKey("forward", 1, 8, 2, 64, 64, 64, "float32", True), "bf16/fp16"),
    (SdpaKey("forward", 1, 8, 2, 64, 64, 1000, "bfloat16", True), "head_dim 1000"),
    (SdpaKey("forward", 1, 8, 2, 64, 64, 60, "float16", True), "head_dim 60"),
    (SdpaKey("forward", 1, 8, 3, 64, 64, 64, "bfloat16", True), "8 query heads over 3"),
    (SdpaKey("forward", 1, 8, 2, 4, 68, 64, "bfloat16", True), "causal mask of 4 queries over 68"),
])
def test_keys_cudnn_does_not_take_keep_cublas(key, why):
    """Checked before any graph: head dim 1000 passes the frontend's graph.validate() (the backend would refuse
    it at planning, on the GPU), so this check is what keeps such shapes on cuBLAS."""
    assert why in unsupported_reason(key)


def test_the_mask_cudnn_runs_is_read_from_the_bias():
    assert attention.cudnn_mask(ops.causal_bias(16, 16, np, np.float32), 16, 16) is True
    assert attention.cudnn_mask(ops.causal_bias(16, 16, np, ml_dtypes.bfloat16), 16, 16) is True
    assert attention.cudnn_mask(None, 16, 16) is False
    assert attention.cudnn_mask(0.0, 16, 16) is False
    assert attention.cudnn_mask(ops.causal_bias(4, 20, np, np.float32, offset=16), 4, 20) is None  # decoding
    shifted = ops.causal_bias(16, 16, np, np.float32, offset=1)  # sees one key more than the triangle
    assert attention.cudnn_mask(shifted, 16, 16) is None
    assert attention.cudnn_mask(np.full((16, 16), -1.0, np.float32), 16, 16) is None
    assert attention.cudnn_mask(-1.0, 16, 16) is None


def test_a_mask_array_is_read_once_and_its_verdict_kept_for_that_array():
    """The model hands one causal mask array to every layer and step: read on the device once, not per call."""
    reads = []

    class CountingMask(np.ndarray):
        def __eq__(self, other):
            reads.append(1)
            return np.asarray(self) == other

        __hash__ = None  # as ndarray's: arrays are not hashable

    causal = ops.causal_bias(16, 16, np, np.float32).view(CountingMask)
    assert [attention.cudnn_mask(causal, 16, 16) for _ in range(5)] == [True] * 5
    assert len(reads) == 2  # one where(...) over the triangle: its == -inf and its == 0
    other = np.full((16, 16), -1.0, np.float32).view(CountingMask)
    assert attention.cudnn_mask(other, 16, 16) is None and attention.cudnn_mask(other, 16, 16) is None
    assert len(reads) == 4


def test_the_banner_says_which_attention_runs():
    missing = cudnn_attention.SdpaGraphs(importer=lambda: (None, "cuDNN not installed"))
    assert attention.describe_attention_path(ml_dtypes.bfloat16, 12, 12, 64, graphs=missing) == \
        "attention: cuBLAS batched GEMMs (cuDNN not installed)"
    present = cudnn_attention.SdpaGraphs(importer=lambda: (object(), ""))
    assert attention.describe_attention_path(ml_dtypes.bfloat16, 12, 12, 64, graphs=present) == \
        "attention: cuDNN fused SDPA (bfloat16)"
    assert "cuBLAS" in attention.describe_attention_path(np.float32, 12, 12, 64, graphs=present)
    assert "ring" in attention.describe_attention_path(ml_dtypes.bfloat16, 12, 12, 64, ring=True, graphs=present)


def test_the_switch_keeps_cublas(monkeypatch):
    present = cudnn_attention.SdpaGraphs(importer=lambda: (object(), ""))
    monkeypatch.setenv(attention.ATTENTION_SWITCH, "cublas")
    assert attention.describe_attention_path(ml_dtypes.bfloat16, 12, 12, 64, graphs=present) == \
        "attention: cuBLAS batched GEMMs (MPITRAIN_ATTENTION=cublas)"
    q, k = np.zeros((1, 4, 8, 64), ml_dtypes.bfloat16), np.zeros((1, 4, 8, 64), ml_dtypes.bfloat16)
    assert attention.fused_mask(q, k, None) is None
    monkeypatch.setenv(attention.ATTENTION_SWITCH, "flash")
    with pytest.raises(ValueError, match="MPITRAIN_ATTENTION='flash': allowed cudnn, cublas"):
        attention.fused_mask(q, k, None)


def test_the_cache_plans_a_key_once_and_remembers_a_decline():
    class Declined(Exception):
        pass

    class FakeGraph:
        def __init__(self, fail):
            self.fail, self.plans = fail, 0

        def create_execution_plans(self, modes):
            self.plans += 1
            if self.fail:
                raise Declined("no engine")

        def check_support(self):
            pass

        def build_plans(self):
            pass

        def get_workspace_size(self):
            return 64

    class FakeCudnn:
        cudnnGraphNotSupportedError = Declined

        class heur_mode:
            A, FALLBACK = "A", "FALLBACK"

    built = []

    def builder(cudnn, key):
        built.append(FakeGraph(fail=not key.causal))
        return built[-1]

    graphs = cudnn_attention.SdpaGraphs(importer=lambda: (FakeCudnn, ""), builder=builder)
    good, bad = MODEL_KEYS[0], MODEL_KEYS[0]._replace(causal=False)
    assert graphs.planned(FakeCudnn, good).workspace_bytes == 64
    assert graphs.planned(FakeCudnn, good).graph is built[0]
    with pytest.warns(UserWarning, match="keeps the cuBLAS attention"), \
            pytest.raises(cudnn_attention.SdpaDeclined, match="no engine"):
        graphs.planned(FakeCudnn, bad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, at the decline
        with pytest.raises(cudnn_attention.SdpaDeclined, match="no engine"):
            graphs.planned(FakeCudnn, bad)
    assert [g.plans for g in built] == [1, 1]


# ---- on a GPU: the fused path against the numpy ops -----------------------------------------------------------
@pytest.mark.skipif(not GPU_USABLE, reason=f"cuDNN's fused attention needs a CUDA GPU: {GPU_REASON}")
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_fused_attention_matches_the_numpy_ops(cudnn, dtype, heads, kv_heads, causal):
    import cupy as cp
    rng = np.random.default_rng(11)
    b, t, d = 2, 128, 64
    q = rng.standard_normal((b, heads, t, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, kv_heads, t, d)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    bias = ops.causal_bias(t, t, np, np.float32) if causal else 0.0
    (out, lse), saved = attention.gpu_attention_forward(*(cp.asarray(x.astype(dtype)) for x in (q, k, v)),
                                                        cp.asarray(bias) if causal else bias)
    assert isinstance(saved, attention.FusedSaved) and saved.causal is causal and saved.stats.dtype == np.float32
    grads = attention.gpu_attention_backward(saved, cp.asarray(dout.astype(dtype)))
    (want, want_lse), ref_saved = ops.attention_forward(q, k, v, bias)
    for got, ref in zip((out, lse, *grads), (want, want_lse, *ops.attention_backward(ref_saved, dout))):
        got = cp.asnumpy(got).astype(np.float32)
        assert got.shape == ref.shape
        assert np.max(np.abs(got - ref)) <= 3e-2 * np.max(np.abs(ref))
