"""cuBLASLt's FP8 GEMM route (mpitrain/kernels/fp8_gemm.py, mpitrain/layers/fp8_lt.py), checked without a GPU.

FakeCublasLt stands in for nvmath's `cublasLt` binding: it records every descriptor attribute and layout it is told,
refuses what cuBLASLt's FP8 GEMM refuses (not TN, dims or leading dims not multiples of 16, e5m2 x e5m2), and
computes what cuBLASLt computes from those records alone: the operands read through their pointers as column-major
matrices with their leading dimensions, decoded from their fp8 bit patterns by ml_dtypes, times their scales read
through the scale pointers in cuBLAS's layout for each scale mode. A wrong transpose, leading dimension, scale
pointer, scale layout or swapped operand gives another product than the emulation's GEMM, which the tests compare.
"""
from __future__ import annotations

import ctypes
import enum

import ml_dtypes
import numpy as np
import pytest
from fake_device import fake_cupy, fake_device_array, host_allocator

from mpitrain.kernels import cupy_status, fp8_gemm
from mpitrain.layers import fp8_lt, ops
from mpitrain.layers.fp8 import FORMATS, Fp8Gemms

# The enum values the fake answers to: nvmath's own (test_nvmath_binding_has_these_enums checks them)
DESC = {"TRANSA": 3, "TRANSB": 4, "A_SCALE_POINTER": 17, "B_SCALE_POINTER": 18, "A_SCALE_MODE": 31,
        "B_SCALE_MODE": 32}
SCALE_MODES = {"SCALAR_32F": 0, "VEC32_UE8M0": 2, "VEC128_32F": 4, "BLK128x128_32F": 5}
DESC_DTYPE = {3: np.int32, 4: np.int32, 17: np.int64, 18: np.int64, 31: np.int32, 32: np.int32}
GPU_USABLE, GPU_REASON = cupy_status()
needs_gpu = pytest.mark.skipif(not GPU_USABLE, reason=f"cuBLASLt's FP8 GEMM needs a CUDA GPU: {GPU_REASON}")
TYPES = {28: np.dtype(ml_dtypes.float8_e4m3fn), 29: np.dtype(ml_dtypes.float8_e5m2), 0: np.dtype(np.float32)}


def read(pointer: int, count: int, dtype) -> np.ndarray:
    """`count` elements of `dtype` at a host address (fake device memory is host memory)."""
    dtype = np.dtype(dtype)
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(pointer)
    return np.frombuffer(raw, dtype=np.uint8).view(dtype)


class FakeCublasLt:
    """nvmath.bindings.cublasLt's names used by Fp8Lt, over host memory (module docstring)."""
    MatmulDescAttribute = enum.IntEnum("MatmulDescAttribute", DESC)
    MatmulMatrixScale = enum.IntEnum("MatmulMatrixScale", SCALE_MODES)
    MatmulPreferenceAttribute = enum.IntEnum("MatmulPreferenceAttribute", {"MAX_WORKSPACE_BYTES": 1})

    class MatmulHeuristicResult:
        def __init__(self, size=1):
            self.buffer = np.zeros(96 * size, np.uint8)
            self.ptr = self.buffer.ctypes.data

    def __init__(self):
        self.objects, self.calls, self.next_id = {}, [], 1

    def _new(self, record) -> int:
        self.next_id += 1
        self.objects[self.next_id] = record
        return self.next_id

    def create(self):
        return self._new({"handle": True})

    def matmul_desc_create(self, compute, scale_type):
        assert (compute, scale_type) == (68, 0), "FP8: CUBLAS_COMPUTE_32F, float32 scale type"
        return self._new({})

    def matmul_desc_set_attribute(self, desc, attr, buf, size):
        assert size == np.dtype(DESC_DTYPE[attr]).itemsize, f"attribute {attr}: {size} bytes"
        self.objects[desc][attr] = read(buf, 1, DESC_DTYPE[attr])[0].item()

    def matrix_layout_create(self, dtype, rows, cols, ld):
        return self._new({"type": dtype, "rows": rows, "cols": cols, "ld": ld})

    def matmul_preference_create(self):
        return self._new({})

    def matmul_preference_set_attribute(self, pref, attr, buf, size):
        self.objects[pref][attr] = read(buf, 1, np.uint64)[0]

    def matmul_algo_get_heuristic(self, handle, desc, a, b, c, d, pref, count, results, found):
        read(found, 1, np.int32)[0] = 1

    def matrix_layout_destroy(self, layout):
        del self.objects[layout]

    matmul_desc_destroy = matmul_preference_destroy = matrix_layout_destroy

    def matmul(self, handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo, ws, ws_size, stream):
        attrs, la, lb, ld = self.objects[desc], self.objects[adesc], self.objects[bdesc], self.objects[ddesc]
        assert (attrs[3], attrs[4]) == (1, 0), "cuBLASLt FP8 takes TN only"
        assert {la["type"], lb["type"]} != {29}, "no e5m2 x e5m2 FP8 GEMM"
        op_a, op_b = self._matrix(a, la).T, self._matrix(b, lb)  # op(A) = N x K, op(B) = K x M
        n, k, m = op_a.shape[0], op_a.shape[1], op_b.shape[1]
        assert op_b.shape[0] == k and (ld["rows"], ld["cols"]) == (n, m) and ld["ld"] >= n
        assert all(size % 16 == 0 for size in (m, n, k, la["ld"], lb["ld"])), "FP8: multiples of 16"
        scale_a = self._scales(attrs, "A", n, k)  # (N, K), indexed (row of op(A), k)
        scale_b = self._scales(attrs, "B", m, k).T  # (K, M)
        product = read(alpha, 1, np.float32)[0] * ((op_a * scale_a) @ (op_b * scale_b))
        assert read(beta, 1, np.float32)[0] == 0
        out = read(d, ld["ld"] * m, np.float32).reshape(m, ld["ld"])  # column-major N x M, ld rows apart
        out[:, :n] = product.T
        self.calls.append({"m": m, "n": n, "k": k, "A": dict(la), "B": dict(lb), "attrs": dict(attrs)})

    @staticmethod
    def _matrix(pointer, layout) -> np.ndarray:
        """A stored column-major matrix (rows x cols, ld) decoded to float64."""
        rows, cols, ld = layout["rows"], layout["cols"], layout["ld"]
        assert ld >= rows and pointer % 16 == 0
        codes = read(pointer, ld * cols, np.uint8).reshape(cols, ld)[:, :rows]
        return codes.view(TYPES[layout["type"]]).astype(np.float64).T

    @staticmethod
    def _scales(attrs, side: str, outer: int, k: int) -> np.ndarray:
        """(outer, K) multipliers of an operand from its scale pointer and mode: SCALAR_32F one float; VEC128_32F
        one per (row, 128 of K) at kb * round4(outer) + row; BLK128x128_32F one per block at rb * round4(K/128) + kb."""
        pointer, mode = attrs[DESC[f"{side}_SCALE_POINTER"]], attrs.get(DESC[f"{side}_SCALE_MODE"], 0)
        rows, kb = np.arange(outer)[:, None], np.arange(k)[None, :] // 128
        if mode == SCALE_MODES["SCALAR_32F"]:
            return np.full((outer, k), read(pointer, 1, np.float32)[0], np.float64)
        if mode == SCALE_MODES["VEC128_32F"]:
            index = kb * (-(-outer // 4) * 4) + rows
        else:
            assert mode == SCALE_MODES["BLK128x128_32F"], f"scale mode {mode}"
            k_blocks = -(-k // 128)
            index = (rows // 128) * (-(-k_blocks // 4) * 4) + kb
        return read(pointer, int(index.max()) + 1, np.float32)[index].astype(np.float64)


def test_fp8_bits_are_the_formats_bit_patterns():
    for fmt, dtype in FORMATS.items():
        patterns = np.arange(256, dtype=np.uint8)
        values = patterns.view(dtype).astype(np.float32)
        finite = np.isfinite(values)
        np.testing.assert_array_equal(fp8_gemm.fp8_bits(values[finite], fmt), patterns[finite])


def gemms(recipe: str, fake) -> Fp8Gemms:
    g = Fp8Gemms(recipe, name="layer")
    g.lt = fp8_gemm.Fp8Lt(fake)
    return g


def operands(recipe: str, m=256, k=256, n=128):
    """Quantized input, weight and output gradient of one linear, as the emulation hands them to its matmuls."""
    rng = np.random.default_rng(7)
    x, w, dy = (rng.standard_normal(s).astype(np.float32) * f for s, f in (((2, m // 2, k), 3.0), ((k, n), 0.05),
                                                                             ((2, m // 2, n), 1e-3)))
    x[0, 0, :130] *= 40.0  # tiles of very different scales
    return x, w, dy


@pytest.mark.parametrize("recipe", ["tensor", "delayed", "block"])
def test_cublaslt_route_equals_the_emulations_gemms(recipe):
    fake = FakeCublasLt()
    g = gemms(recipe, fake)
    x, w, dy = operands(recipe)
    xq, wq, dyq = g.inputs(["w.x"], [x])[0], g.weights(["w"], [w], -1)[0], g.output_grads(["w.dy"], [dy])[0]
    y = fp8_lt.linear_forward(g, ("w.x", "w"), xq, wq)[0]
    np.testing.assert_allclose(y, ops.linear_forward(xq, wq)[0], rtol=1e-5, atol=1e-5 * np.abs(y).max())
    dx = fp8_lt.linear_input_grad(g, ["w"], [wq], ["w.dy"], [dyq])
    expected = ops.linear_input_grad([wq], [dyq])
    np.testing.assert_allclose(dx, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    dw, dw_emulated = np.ones_like(w), np.ones_like(w)
    fp8_lt.add_weight_grad(g, ("w.x", "w.dy"), dw, xq, dyq)
    ops.add_weight_grad(dw_emulated, xq, dyq)
    np.testing.assert_allclose(dw, dw_emulated, rtol=1e-5, atol=1e-5 * np.abs(dw_emulated - 1).max())
    shapes = [(c["m"], c["n"], c["k"]) for c in fake.calls]
    wgrad = [(256, 128, 256)] if recipe != "block" else []  # block's weight gradient stays emulated
    assert shapes == [(256, 128, 256), (256, 256, 128)] + wgrad  # the GEMMs ran through the fake, not around it
    modes = {c["attrs"].get(DESC["B_SCALE_MODE"], 0) for c in fake.calls}
    assert modes == ({SCALE_MODES["VEC128_32F"]} if recipe == "block" else {SCALE_MODES["SCALAR_32F"]})


@pytest.mark.parametrize("recipe", ["tensor", "delayed", "block"])
def test_token_rows_are_padded_to_16_and_the_padding_dropped(recipe):
    """24 token rows: each GEMM goes to the fake with 32 (zero rows appended: the forward's and dgrad's M, wgrad's
    reduction), and the results are the emulation's, of the real rows' shape: padded rows that reached the output,
    or were not zero in wgrad's sum, would fail the comparison."""
    fake = FakeCublasLt()
    g = gemms(recipe, fake)
    x, w, dy = operands(recipe, m=24)
    xq, wq, dyq = g.inputs(["w.x"], [x])[0], g.weights(["w"], [w], -1)[0], g.output_grads(["w.dy"], [dy])[0]
    y = fp8_lt.linear_forward(g, ("w.x", "w"), xq, wq)[0]
    expected = ops.linear_forward(xq, wq)[0]
    assert y.shape == expected.shape == (2, 12, 128)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    dx, expected = fp8_lt.linear_input_grad(g, ["w"], [wq], ["w.dy"], [dyq]), ops.linear_input_grad([wq], [dyq])
    assert dx.shape == expected.shape == (2, 12, 256)
    np.testing.assert_allclose(dx, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    dw, dw_emulated = np.zeros_like(w), np.zeros_like(w)
    fp8_lt.add_weight_grad(g, ("w.x", "w.dy"), dw, xq, dyq)
    ops.add_weight_grad(dw_emulated, xq, dyq)
    np.testing.assert_allclose(dw, dw_emulated, rtol=1e-5, atol=1e-5 * np.abs(dw_emulated).max())
    wgrad = [(256, 128, 32)] if recipe != "block" else []
    assert [(c["m"], c["n"], c["k"]) for c in fake.calls] == [(32, 128, 256), (32, 256, 128)] + wgrad
    padded = fp8_lt.pad_tokens(np.ones((24, 3)), 0)
    assert padded.shape == (32, 3) and not padded[24:].any() and fp8_lt.pad_tokens(padded, 0) is padded


def test_an_older_micro_batchs_operand_is_encoded_with_its_own_scale():
    fake = FakeCublasLt()
    g = gemms("tensor", fake)
    x, w, dy = operands("tensor")
    older = g.inputs(["w.x"], [x])[0]
    g.inputs(["w.x"], [x * 5.0])  # a second micro-batch's forward: a newer scale of the same key
    dy_q = g.output_grads(["w.dy"], [dy])[0]
    dw, dw_emulated = np.zeros_like(w), np.zeros_like(w)
    fp8_lt.add_weight_grad(g, ("w.x", "w.dy"), dw, older, dy_q)
    ops.add_weight_grad(dw_emulated, older, dy_q)
    assert len(fake.calls) == 1
    np.testing.assert_allclose(dw, dw_emulated, rtol=1e-5, atol=1e-5 * np.abs(dw_emulated).max())


def test_wrong_descriptors_are_refused_and_odd_shapes_stay_emulated():
    fake = FakeCublasLt()
    g = gemms("tensor", fake)
    x, w, _ = operands("tensor", m=32, k=136, n=128)  # K = 136: not a multiple of 16 (only token rows are padded)
    xq, wq = g.inputs(["w.x"], [x])[0], g.weights(["w"], [w], -1)[0]
    np.testing.assert_array_equal(fp8_lt.linear_forward(g, ("w.x", "w"), xq, wq)[0], ops.linear_forward(xq, wq)[0])
    assert fake.calls == []

    class NotTransposed(fp8_gemm.Fp8Lt):
        def _describe(self, desc, x, y):
            super()._describe(desc, x, y)
            self._set(desc, "TRANSA", fp8_gemm.OP_N, np.int32)

    x, w, _ = operands("tensor")
    g.lt = NotTransposed(fake)
    xq, wq = g.inputs(["w.x"], [x])[0], g.weights(["w"], [w], -1)[0]
    with pytest.raises(AssertionError, match="TN only"):
        fp8_lt.linear_forward(g, ("w.x", "w"), xq, wq)


def test_fp8_gemm_on_fake_device_arrays():
    """The kernel module's own steps on CuPy arrays (fake: host memory): pointers, output and workspace."""
    cupy = fake_cupy()
    fake = FakeCublasLt()
    rng = np.random.default_rng(3)
    x_codes = rng.integers(0, 0x7E, (32, 128), dtype=np.uint8)  # e4m3 patterns below NaN
    y_codes = rng.integers(0, 0x7B, (16, 128), dtype=np.uint8)  # e5m2 patterns below inf
    x_scale, y_scale = np.array([0.5], np.float32), np.array([0.125], np.float32)
    device = [fake_device_array(cupy, a) for a in (x_codes, x_scale, y_codes, y_scale)]
    with host_allocator(cupy):
        out = fp8_gemm.Fp8Lt(fake).matmul(fp8_gemm.Fp8Operand(device[0], "e4m3", device[1], "scalar"),
                                          fp8_gemm.Fp8Operand(device[2], "e5m2", device[3], "scalar"))
        result = read(out.data.ptr, out.size, np.float32).reshape(out.shape)
    expected = (x_codes.view(FORMATS["e4m3"]).astype(np.float64) * 0.5) @ (
        y_codes.view(FORMATS["e5m2"]).astype(np.float64) * 0.125).T
    np.testing.assert_allclose(result, expected, rtol=1e-6)


def test_nvmath_binding_has_these_enums():
    lt, why = fp8_gemm.import_cublaslt()
    if lt is None:
        pytest.skip(f"{why}: the gpu-check extra installs it")
    assert {name: int(getattr(lt.MatmulDescAttribute, name)) for name in DESC} == DESC
    assert {name: int(getattr(lt.MatmulMatrixScale, name)) for name in SCALE_MODES} == SCALE_MODES
    assert int(lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES) == 1
    from nvmath import CudaDataType
    from nvmath.bindings.cublas import ComputeType, Operation
    assert int(ComputeType.COMPUTE_32F) == fp8_gemm.COMPUTE_32F
    assert (int(Operation.N), int(Operation.T)) == (fp8_gemm.OP_N, fp8_gemm.OP_T)
    assert {fmt: int(getattr(CudaDataType, name)) for fmt, name in (
        ("e4m3", "CUDA_R_8F_E4M3"), ("e5m2", "CUDA_R_8F_E5M2"), ("float32", "CUDA_R_32F"))} == fp8_gemm.CUDA_TYPE
    fp8_gemm.Fp8Lt(lt)  # every name Fp8Lt reads exists


TRAIN = ["data.synthetic=true", "precision.compute=float64", "train.steps=2", "train.global_batch=4",
         "train.micro_batch=2", "model.d_model=256", "model.n_head=4", "model.seq_len=16", "model.n_layer=1",
         "train.thread_replicas=1", "logging.peak_flops=1e9", "optim.warmup_steps=1", "optim.lr=1e-2"]


@pytest.mark.parametrize("recipe", ["tensor", "block"])
def test_training_through_the_fake_cublaslt_trains_as_the_emulation(recipe):
    """Every FP8 linear's forward, input-gradient and (per-tensor recipes) weight-gradient GEMM of two training
    steps goes through Fp8Lt and the fake binding. float64 (the dequantized operands exact) so that the only
    difference is cuBLASLt's float32 output, not the float32 sums that flip downstream fp8 codes at random."""
    from mpi4py import MPI

    from mpitrain.config import load_config
    from mpitrain.train import Trainer

    def run(fake, steps):
        trainer = Trainer(load_config("configs/tiny.toml", [*TRAIN, f"precision.fp8={recipe}"]), MPI.COMM_SELF)
        for g in trainer.fp8_gemms:
            g.lt = None if fake is None else fp8_gemm.Fp8Lt(fake)
        return [trainer.train_step(step) for step in range(steps)]

    fake = FakeCublasLt()
    (emulated,), through_lt = run(None, 1), run(fake, 2)
    # cuBLASLt's float32 outputs move a few downstream fp8 codes across a rounding boundary (e5m2: 2^-3 each)
    assert through_lt[0].loss == pytest.approx(emulated.loss, rel=1e-6)
    assert through_lt[0].grad_norm == pytest.approx(emulated.grad_norm, rel=1e-4)
    assert np.isfinite(through_lt[1].loss) and through_lt[1].loss < through_lt[0].loss + 0.5
    per_micro_batch = 6 * (3 if recipe == "tensor" else 2)  # weights (q, k, v, out, fc, proj) x GEMMs
    assert len(fake.calls) == 2 * 2 * per_micro_batch  # steps x micro-batches


@pytest.mark.parametrize("recipe", ["tensor", "block"])
def test_moe_experts_through_the_fake_cublaslt_train_as_the_emulation(recipe):
    """The routed experts' GEMMs go through Fp8Lt too: 4 experts, top 2, so each takes a share of a micro-batch's
    64 picks that is seldom a multiple of 16, padded with zero rows (layers/fp8_lt.py); one step beside the
    emulation's, as above."""
    from mpi4py import MPI

    from mpitrain.config import load_config
    from mpitrain.train import Trainer

    def step(fake):
        settings = [*TRAIN, f"precision.fp8={recipe}", "model.moe={experts = 4, top_k = 2}"]
        trainer = Trainer(load_config("configs/tiny.toml", settings), MPI.COMM_SELF)
        for g in trainer.fp8_gemms:
            g.lt = None if fake is None else fp8_gemm.Fp8Lt(fake)
        return trainer.train_step(0)

    fake = FakeCublasLt()
    emulated, through_lt = step(None), step(fake)
    assert through_lt.loss == pytest.approx(emulated.loss, rel=1e-6)
    assert through_lt.grad_norm == pytest.approx(emulated.grad_norm, rel=1e-4)
    ff = 4 * 256  # the experts' width: only their GEMMs have it
    expert_calls = [c for c in fake.calls if ff in (c["m"], c["n"], c["k"])]
    assert len(expert_calls) == 2 * 4 * 2 * (3 if recipe == "tensor" else 2)  # micro-batches x experts x (fc, proj)
    # each expert's rows, padded, in its fc forward and its proj dgrad: more than the 2 x 64 real ones (padding ran)
    padded_rows = sum(c["m"] for c in expert_calls if (c["n"], c["k"]) == (ff, 256)) // 2
    assert padded_rows > 2 * 64


def close_to(got, expected, limit: float = 2e-3) -> None:
    """Within `limit` of the largest expected value: Hopper's FP8 tensor cores accumulate in steps of limited
    precision before cuBLASLt adds them in fp32, so not float32's rounding."""
    got, expected = (np.asarray(a.get() if hasattr(a, "get") else a, np.float64) for a in (got, expected))
    assert np.abs(got - expected).max() <= limit * np.abs(expected).max()


@needs_gpu
@pytest.mark.parametrize("recipe", ["tensor", "delayed", "block", "mxfp8"])
def test_cublaslt_fp8_gemm_on_the_gpu(recipe):
    """On a GPU: each recipe's three GEMMs through cuBLASLt against the emulation's matmul of the same dequantized
    operands (mxfp8 and block's weight gradient stay on the emulation, exactly)."""
    import cupy
    lt, why = fp8_gemm.device_lt()
    assert lt is not None, why
    g = Fp8Gemms(recipe, name="layer")
    x, w, dy = (cupy.asarray(a) for a in operands(recipe))
    xq, wq, dyq = g.inputs(["w.x"], [x])[0], g.weights(["w"], [w], -1)[0], g.output_grads(["w.dy"], [dy])[0]
    assert (fp8_lt.runner(g, xq) is None) == (recipe == "mxfp8")
    close_to(fp8_lt.linear_forward(g, ("w.x", "w"), xq, wq)[0], ops.linear_forward(xq, wq)[0])
    close_to(fp8_lt.linear_input_grad(g, ["w"], [wq], ["w.dy"], [dyq]), ops.linear_input_grad([wq], [dyq]))
    dw, dw_emulated = cupy.zeros_like(w), cupy.zeros_like(w)
    fp8_lt.add_weight_grad(g, ("w.x", "w.dy"), dw, xq, dyq)
    ops.add_weight_grad(dw_emulated, xq, dyq)
    close_to(dw, dw_emulated)


@needs_gpu
@pytest.mark.parametrize("recipe", ["tensor", "block"])
def test_fp8_training_on_the_gpu_follows_the_cpu_emulation(recipe):
    """Two float32 steps on cuda (GEMMs through cuBLASLt) against the same steps on the CPU (the emulation)."""
    from mpi4py import MPI

    from mpitrain.config import load_config
    from mpitrain.train import Trainer

    settings = [*TRAIN, "precision.compute=float32", f"precision.fp8={recipe}"]
    losses = {}
    for device in ("cpu", "cuda"):
        trainer = Trainer(load_config("configs/tiny.toml", [*settings, f"train.device={device}"]), MPI.COMM_SELF)
        losses[device] = [trainer.train_step(step).loss for step in range(2)]
    assert np.all(np.isfinite(losses["cuda"]))
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=1e-2)


def test_the_banner_says_where_fp8_gemms_run():
    assert fp8_gemm.describe_fp8_path("none", np.float32) == []
    assert "emulated on the device" in fp8_gemm.describe_fp8_path("mxfp8", np.float32)[0]
    assert "float64" in fp8_gemm.describe_fp8_path("tensor", np.float64)[0]
    lt, why = fp8_gemm.import_cublaslt()
    line = fp8_gemm.describe_fp8_path("block", ml_dtypes.bfloat16)[0]
    if lt is None:
        assert line == f"fp8 block: emulated on the device ({why})"
    else:
        assert line.startswith("fp8 block: FP8 GEMMs through cuBLASLt: untested on a device")


def test_an_optional_library_that_is_missing_or_broken_is_named_not_raised(tmp_path, monkeypatch):
    from mpitrain.kernels.dispatch import import_optional
    assert import_optional("mpitrain_no_such_module", "pip install it", "it") == (None, "pip install it")
    (tmp_path / "mpitrain_broken_module.py").write_text("raise OSError('libfoo.so: cannot open')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module, why = import_optional("mpitrain_broken_module", "pip install it", "the broken library")
    assert module is None and why == "the broken library failed to import (OSError: libfoo.so: cannot open)"
    assert import_optional("json", "", "json")[0] is __import__("json")
