"""What the GPU path calls in CuPy, held to the real CuPy (imported without a GPU): the NCCL stand-in has the real
communicator's methods and argument counts, every NCCL call in comm/nccl_group.py fits the real signature, the NCCL
and cuBLAS codes the code writes down are CuPy's, and the unique id travels as the type the real communicator takes.

CuPy's NCCL and cuBLAS bindings are Cython: their signatures are read from the first line of their docstrings.
`cupy.cuda.cublas` loads only with the nvidia-cublas wheel; its part skips without it, saying so.
"""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install -e '.[gpu-check]'): "
                                          "nothing to compare against")
from cupy.cuda import nccl, runtime  # noqa: E402

from mpitrain.backend import BFLOAT16  # noqa: E402
from mpitrain.comm import nccl_group, nccl_standin  # noqa: E402
from mpitrain.kernels import attention, fused  # noqa: E402

if not nccl.available:
    pytest.skip("CuPy found no NCCL library: pip install -e '.[gpu-check]'", allow_module_level=True)

NCCL_GROUP_SOURCE = Path(nccl_group.__file__)
ATTENTION_SOURCE = Path(attention.__file__)
NCCL_UNIQUE_ID_BYTES = 128  # nccl.h


def docstring_parameters(binding) -> list[tuple[str, str, bool]]:
    """(type, name, optional) of a Cython binding's parameters, from its docstring's first line (`self` dropped)."""
    first = (binding.__doc__ or "").strip().splitlines()[0]
    inside = re.fullmatch(r"[\w.]+\((.*)\)(\s*->.*)?", first)
    assert inside, f"no signature on the first docstring line of {binding!r}: {first!r}"
    params = []
    for part in filter(None, (p.strip() for p in inside.group(1).split(","))):
        declaration, _, default = part.partition("=")
        words = declaration.split()
        if words[-1] != "self":
            params.append((" ".join(words[:-1]), words[-1], bool(default)))
    return params


def accepts(binding, positional: int) -> bool:
    params = docstring_parameters(binding)
    return sum(not optional for _, _, optional in params) <= positional <= len(params)


def python_parameters(function) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(function).parameters.values()
            if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def public_methods(cls) -> list[str]:
    return [name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")]


# ---- the NCCL stand-in against cupy.cuda.nccl ------------------------------------------------------------------------
def test_standin_communicator_has_the_real_methods_and_argument_counts():
    real = nccl.NcclCommunicator
    for name in public_methods(nccl_standin.NcclCommunicator):
        assert hasattr(real, name), f"the stand-in's NcclCommunicator.{name} is not in cupy.cuda.nccl"
        ours = python_parameters(getattr(nccl_standin.NcclCommunicator, name))
        theirs = docstring_parameters(getattr(real, name))
        assert len(ours) == len(theirs), (f"NcclCommunicator.{name}: stand-in takes {[p.name for p in ours]}, "
                                          f"CuPy takes {[n for _, n, _ in theirs]}")


def test_standin_module_has_the_real_functions():
    host = nccl_standin.HostNccl(bootstrap=None)  # what NcclGroup calls as `api`
    for name in ("get_unique_id", "groupStart", "groupEnd", "NcclCommunicator", "available"):
        assert hasattr(nccl, name) and hasattr(host, name), name
    for name in ("get_unique_id", "groupStart", "groupEnd"):
        assert len(python_parameters(getattr(host, name))) == len(docstring_parameters(getattr(nccl, name))), name
    constructor = docstring_parameters(nccl.NcclCommunicator)  # NcclCommunicator(ndev, commId, rank, config=None)
    assert [n for _, n, optional in constructor if not optional] == \
        [p.name for p in python_parameters(host.NcclCommunicator)]


def nccl_calls() -> list[tuple[str, int, int]]:
    """(method, positional arguments, line) of each call on an NCCL communicator (`c`, the lambda parameter of
    every launch) or on the nccl module (`self._api`) in comm/nccl_group.py."""
    calls = []
    for node in ast.walk(ast.parse(NCCL_GROUP_SOURCE.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = ast.unparse(node.func.value)
        if receiver in ("c", "self._api"):
            assert not any(isinstance(a, ast.Starred) for a in node.args) and not node.keywords, ast.unparse(node)
            calls.append((node.func.attr, len(node.args), node.lineno))
    return calls


def test_every_nccl_call_of_the_group_fits_cupys_signature():
    calls = nccl_calls()
    called = {name for name, _, _ in calls}
    assert {"allReduce", "reduceScatter", "allGather", "broadcast", "send", "recv", "groupStart", "groupEnd",
            "get_unique_id", "NcclCommunicator"} <= called, f"nccl_group.py's calls not found (renamed?): {called}"
    for name, positional, line in calls:
        binding = getattr(nccl.NcclCommunicator, name, None) or getattr(nccl, name, None)
        assert binding is not None, f"nccl_group.py:{line}: {name} is not in cupy.cuda.nccl"
        assert accepts(binding, positional), (f"nccl_group.py:{line}: {name} with {positional} arguments; CuPy: "
                                              f"{(binding.__doc__ or '').strip().splitlines()[0]}")


def test_nccl_codes_are_cupys():
    ops = {"SUM": nccl_standin.SUM, "PROD": nccl_standin.PROD, "MAX": nccl_standin.MAX, "MIN": nccl_standin.MIN,
           "AVG": nccl_standin.AVG}
    assert ops == {name: getattr(nccl, f"NCCL_{name}") for name in ops}
    assert nccl_group.NCCL_OPS == {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}
    real = {np.dtype(np.int8): nccl.NCCL_INT8, np.dtype(np.uint8): nccl.NCCL_UINT8, np.dtype(np.int32): nccl.NCCL_INT32,
            np.dtype(np.uint32): nccl.NCCL_UINT32, np.dtype(np.int64): nccl.NCCL_INT64,
            np.dtype(np.uint64): nccl.NCCL_UINT64, np.dtype(np.float16): nccl.NCCL_FLOAT16,
            np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
            BFLOAT16: nccl.NCCL_BFLOAT16}
    assert real == nccl_group.NCCL_DTYPE_CODES
    assert nccl_group.UINT8 == nccl.NCCL_UINT8
    assert {code: np.dtype(dtype) for code, dtype in nccl_standin.NCCL_DTYPES.items()} == \
        {code: dtype for dtype, code in real.items()}


def test_the_unique_id_reaches_the_communicator_as_cupy_makes_and_takes_it():
    """NcclGroup._communicator hands the real get_unique_id()'s value, broadcast over MPI, to NcclCommunicator,
    which CuPy 14 declares `bytes commId` of 128 bytes; the stand-in makes and takes the same type."""
    assert docstring_parameters(nccl.NcclCommunicator)[1][:2] == ("bytes", "commId")
    made = nccl.get_unique_id()
    assert isinstance(made, bytes) and len(made) == NCCL_UNIQUE_ID_BYTES
    received = []
    api = SimpleNamespace(get_unique_id=nccl.get_unique_id,
                          NcclCommunicator=lambda ndev, comm_id, rank: received.append(comm_id))
    group = SimpleNamespace(_api=api, rank=0, size=2, comm=SimpleNamespace(bcast=lambda value, root: value))
    nccl_group.NcclGroup._communicator(group)
    assert isinstance(received[0], bytes) and len(received[0]) == NCCL_UNIQUE_ID_BYTES
    standin = nccl_standin.get_unique_id()
    assert type(standin) is type(made) and len(standin) == len(made), (
        f"the stand-in's get_unique_id() gives {type(standin).__name__}; CuPy's gives bytes")


# ---- cuBLAS: the codes kernels/attention.py passes -------------------------------------------------------------------
def test_cuda_data_type_codes_are_cupys():
    assert attention.CUDA_DTYPES == {"bfloat16": runtime.CUDA_R_16BF, "float16": runtime.CUDA_R_16F,
                                     "float32": runtime.CUDA_R_32F}


def gemm_call_arguments(name: str) -> int:
    """Positional arguments of the `cublas.<name>(...)` call in kernels/attention.py."""
    for node in ast.walk(ast.parse(ATTENTION_SOURCE.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == f"cublas.{name}":
            assert not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args)
            return len(node.args)
    raise AssertionError(f"kernels/attention.py calls no cublas.{name}")


def test_cublas_constants_and_calls_are_cupys():
    try:
        from cupy.cuda import cublas
    except ImportError as exc:
        pytest.skip(f"cupy.cuda.cublas needs the nvidia-cublas wheel (libcublasLt): {exc}")
    assert attention.CUBLAS_COMPUTE_32F == cublas.CUBLAS_COMPUTE_32F
    assert attention.CUBLAS_GEMM_DEFAULT == cublas.CUBLAS_GEMM_DEFAULT
    assert (attention.CUBLAS_OP_N, attention.CUBLAS_OP_T) == (cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T)
    for name in ("gemmStridedBatchedEx", "setStream"):
        assert gemm_call_arguments(name) == len(docstring_parameters(getattr(cublas, name))), name
    assert callable(cupy.cuda.device.get_cublas_handle)


# ---- fused.py's launches against its kernels (fake device arrays: nothing runs) --------------------------------------
ROW_PARAMETERS = {name: [p.strip().rsplit(" ", 1)[0] for p in params.split(",")]
                  for name, params in re.findall(r"__global__ void (\w+)\(([^)]*)\)", fused._ROW_SOURCE)}


class RecordedLaunches:
    """Stands for fused's compiled row module and its ElementwiseKernels: records each launch instead of running
    it; elementwise calls go through CuPy's own type resolution (`_decide_params_type`) first."""

    def __init__(self, cupy_module, kernels):
        self.cupy, self.kernels, self.rows, self.elementwise = cupy_module, kernels, [], []

    def get_function(self, expression: str):
        return lambda grid, block, args: self.rows.append((expression, grid, block, args))

    def elementwise_kernel(self, name: str):
        kernel = self.kernels[name]

        def call(*args):
            assert len(args) in (kernel.nin, kernel.nargs), f"{name}: {len(args)} arguments"
            arrays = [a.dtype if isinstance(a, self.cupy.ndarray) else None for a in args]
            kernel._decide_params_type(tuple(arrays[:kernel.nin]), tuple(arrays[kernel.nin:]))  # CuPy's TypeError
            for param, arg in zip(kernel.in_params + kernel.out_params, args):
                assert not param.raw or arg.flags.c_contiguous, f"{name}: raw {param.name} is indexed linearly"
            self.elementwise.append((name, args))
            outputs = [self.cupy.empty_like(args[0]) for _ in range(kernel.nout)]
            return outputs[0] if kernel.nout == 1 else tuple(outputs)
        return call


def check_row_launch(expression: str, grid, block, args) -> None:
    name, ctype = re.fullmatch(r"(\w+)<(\w+)>", expression).groups()
    dtype = np.dtype({"float": np.float32, "double": np.float64}[ctype])
    wanted = ROW_PARAMETERS[name]
    assert len(args) == len(wanted), f"{name}: {len(args)} arguments for {wanted}"
    assert block[0] % 32 == 0 and block[0] <= 32 * 32, "block_reduce: whole warps, at most 32 of them"
    for declared, arg in zip(wanted, args):
        if declared.endswith("*"):
            element = np.int64 if "long long" in declared else dtype
            assert arg.dtype == element and arg.flags.c_contiguous, f"{name}: {declared} got {arg.dtype}"
        elif declared == "int":
            assert isinstance(arg, np.int32), f"{name}: int got {type(arg).__name__}"
        else:
            assert declared == "T" and isinstance(arg, np.generic) and arg.dtype == dtype, \
                f"{name}: {declared} got {type(arg).__name__}"  # a Python float would be passed as a double


@pytest.fixture
def launches(monkeypatch):
    from fake_device import fake_cupy, host_allocator
    cp = fake_cupy()
    recorded = RecordedLaunches(cp, fused._elementwise.__wrapped__())
    monkeypatch.setattr(fused, "_row_module", lambda: recorded)
    monkeypatch.setattr(fused, "_elementwise", lambda: {name: recorded.elementwise_kernel(name)
                                                        for name in recorded.kernels})
    with host_allocator(cp):
        yield cp, recorded


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_launches_fit_their_kernels(launches, dtype):
    from fake_device import device_work_error, fake_device_array
    cp, recorded = launches
    rng = np.random.default_rng(0)

    def array(*shape, kind=dtype):
        return fake_device_array(cp, rng.standard_normal(shape).astype(kind))

    x, w, b, dy = array(2, 3, 8), array(8), array(8), array(2, 3, 8)
    _, saved = fused.layernorm_forward(x, w, b, 1e-5)
    fused.rmsnorm_forward(x, w, 1e-5)
    for backward in (lambda: fused.layernorm_backward(saved, w, dy, array(8), array(8)),
                     lambda: fused.rmsnorm_backward(saved, w, dy, array(8))):
        with pytest.raises(device_work_error(cp)):  # the weight-gradient sums after the launch are CuPy's
            backward()
    fused.softmax_backward(fused.softmax_forward(x), dy)
    fused.cross_entropy_with_grad(array(6, 11), fake_device_array(cp, np.arange(6, dtype=np.int64)), 0.5)
    fused.gelu_backward(x, dy)
    fused.swiglu_backward(fused.swiglu_forward(x, x)[1], dy)
    q = array(2, 4, 3, 8)
    fused.rope_backward(fused.rope_forward(q, array(3, 4), array(3, 4)), array(3, 4), array(3, 4))
    fused.adamw_update(array(40), array(40), array(40), array(40), lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, step=3)
    with pytest.raises(device_work_error(cp)):
        fused.gelu_forward(x, b)  # x + bias is CuPy's own kernel
    assert {e.partition("<")[0] for e, *_ in recorded.rows} == set(fused._ROW_KERNELS)
    for launch in recorded.rows:
        check_row_launch(*launch)
    assert {name for name, _ in recorded.elementwise} == set(recorded.kernels) - {"gelu_forward"}
