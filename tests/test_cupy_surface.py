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

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda13x==14.2.0 "
                                          "nvidia-nccl-cu13): nothing to compare against")
from cupy.cuda import nccl, runtime  # noqa: E402

from mpitrain.backend import BFLOAT16  # noqa: E402
from mpitrain.comm import nccl_group, nccl_standin  # noqa: E402
from mpitrain.kernels import attention  # noqa: E402

if not nccl.available:
    pytest.skip("CuPy found no NCCL library (pip install nvidia-nccl-cu13)", allow_module_level=True)

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
