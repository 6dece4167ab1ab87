"""Every CUDA kernel of mpitrain/kernels compiled by NVRTC on a machine without a GPU, the way CuPy compiles it on
one: the same generated source, headers, options and name expressions, for sm_80, sm_90 and sm_100 (where this
NVRTC has it) and every dtype the callers hand the kernels. A kernel that would not compile on the first GPU run
fails here instead.

CuPy's compile path asks the current device for its architecture and ends by loading the binary into the device;
without a driver both raise. The fixture gives the path a fixed architecture and stops it at the load, holding the
binary (whose ELF header must name that architecture). Everything between runs as on a GPU.

PINNED to CuPy 14.2.0: this leans on CuPy's private code generator and compile path (`cupy._core._kernel`,
`cupy._core.raw`, `cupy.cuda.compiler`); after a CuPy upgrade, check those and move PINNED_CUPY.

The catalogue below (ROW_MODULE_BUILDER, ELEMENTWISE) is the one list of the kernels: a kernel constructed anywhere
in mpitrain/kernels that it does not list fails test_catalogue_lists_every_kernel.
"""
from __future__ import annotations

import ast
import functools
import io
import re
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install -e '.[gpu-check]'): "
                                          "the kernels cannot be compiled")
from cupy._core import _carray, _kernel, _scalar, raw  # noqa: E402  (after the skip: CuPy's private API)
from cupy.cuda import compiler  # noqa: E402

from mpitrain.kernels import fused  # noqa: E402

PINNED_CUPY = "14.2.0"
KERNELS_DIR = Path(fused.__file__).parent


def _nvrtc_archs() -> tuple[int, ...]:
    try:
        from cupy_backends.cuda.libs import nvrtc
        return tuple(nvrtc.getSupportedArchs())
    except Exception as exc:  # noqa: BLE001 (a missing libnvrtc raises CuPy's own errors)
        pytest.skip(f"NVRTC cannot be loaded (pip install -e '.[gpu-check]'): {type(exc).__name__}: {exc}",
                    allow_module_level=True)


SUPPORTED_ARCHS = _nvrtc_archs()
ARCHS = tuple(str(arch) for arch in (80, 90, 100) if arch in SUPPORTED_ARCHS)

# What reaches the kernels: gpu_twin casts bf16/fp16 to float32 around them (layers/precision.py's rule); AdamW runs
# on the master weights, float32 (or float64 when computing in float64). bf16/fp16 GEMMs are cuBLAS, not ours.
DTYPES = (np.float32, np.float64)
ROW_CTYPES = {np.float32: "float", np.float64: "double"}
INDEX_32_BITS = (True, False)  # CuPy indexes arrays past 2**31 elements with 64 bits: both variants compile

# ---- the catalogue --------------------------------------------------------------------------------------------------
ROW_MODULE_BUILDER = ("fused.py", "_row_module", "RawModule")
ELEMENTWISE_BUILDER = ("fused.py", "_elementwise", "ElementwiseKernel")
# ElementwiseKernel name in fused._elementwise() -> how fused.py calls it: the inputs passed as scalars, and the
# shapes of the raw arrays (CuPy leaves those as they are; other arrays are reduced to 1-D contiguous views).
ELEMENTWISE = {
    "gelu_forward": {"scalars": (), "raw_ndim": {}},
    "gelu_backward": {"scalars": (), "raw_ndim": {}},
    "swiglu_forward": {"scalars": (), "raw_ndim": {}},
    "swiglu_backward": {"scalars": (), "raw_ndim": {}},
    "rope": {"scalars": ("t_len", "dim", "sign"), "raw_ndim": {"x": 4, "cos_t": 2, "sin_t": 2}},
    "adamw": {"scalars": ("shrink", "beta1", "beta2", "eps", "bias2_sqrt", "step_size", "grad_scale"),
              "raw_ndim": {}},
}
KERNEL_CONSTRUCTORS = {"ElementwiseKernel", "ReductionKernel", "RawKernel", "RawModule", "fuse"}
# _ArgInfo kinds (cupy/_core/_kernel.pxd, enum _ArgKind, CuPy 14.2.0)
ARG_NDARRAY, ARG_INDEXER, ARG_SCALAR = 1, 2, 3


# ---- CuPy's compile path with a fixed architecture, stopped at the load -------------------------------------------
class Compiled(Exception):
    """Raised where CuPy would load the binary into the device: the compile itself succeeded."""

    def __init__(self, binary: bytes, mapping):
        super().__init__(f"{len(binary)} bytes compiled")
        self.binary, self.mapping = binary, mapping


class LoadStop:
    """Stands for cupy.cuda.function.Module in the compile path: records the name mapping, stops at load()."""

    mapping = None

    def _set_mapping(self, mapping) -> None:
        self.mapping = mapping

    def load(self, binary) -> None:
        raise Compiled(binary, self.mapping)


def binary_arch(binary: bytes) -> int:
    """The SM version a cubin is for (ELF e_machine 190 = EM_CUDA; e_flags bits 8-15)."""
    assert binary[:4] == b"\x7fELF" and struct.unpack_from("<H", binary, 18)[0] == 190, "not a CUDA cubin"
    return (struct.unpack_from("<I", binary, 48)[0] >> 8) & 0xFF


@pytest.fixture
def nvrtc_for(monkeypatch):
    """nvrtc_for(arch, build): run `build()` (a CuPy compile entry point) for `arch`; returns the Compiled."""
    target = {}
    options_for = compiler._get_arch_for_options_for_nvrtc.__wrapped__  # undecorated: no per-device memo
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")  # never a binary from the disk cache: compile every time
    monkeypatch.setattr(compiler, "_get_arch", lambda: target["arch"])
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc",
                        lambda arch=None: options_for(arch or target["arch"]))
    monkeypatch.setattr(compiler, "function", SimpleNamespace(Module=LoadStop))

    def run(arch: str, build) -> Compiled:
        target["arch"] = arch
        try:
            build()
        except Compiled as done:
            assert binary_arch(done.binary) == int(arch), f"compiled for sm_{binary_arch(done.binary)}"
            return done
        raise AssertionError("CuPy's compile path returned without loading a binary")
    return run


def compile_raw_module(module, log=None) -> None:
    """What RawModule does at its first use (cupy/_core/raw.pyx, _get_raw_module) without the per-device memo;
    fused.py passes neither translate_cucomplex nor jitify (test_catalogue_lists_every_kernel holds it to that)."""
    raw._get_raw_module.__wrapped__(module.code, module.file_path, module.options, module.backend, False,
                                    module.enable_cooperative_groups, False, module.name_expressions, log)


def elementwise_arginfos(kernel, dtype, scalars, raw_ndim, index_32_bits: bool) -> tuple:
    """The argument descriptions ElementwiseKernel.__call__ builds for fused.py's calls (contiguous arrays)."""
    names = [p.name for p in kernel.in_params + kernel.out_params]
    unknown = (set(scalars) | set(raw_ndim)) - set(names)
    assert not unknown, f"{kernel.name}: the catalogue names parameters the kernel lacks: {sorted(unknown)}"
    in_dtypes = tuple(None if p.name in scalars else np.dtype(dtype) for p in kernel.in_params)
    in_types, out_types, type_map = kernel._decide_params_type(in_dtypes, ())
    infos = []
    for param, ptype in zip(kernel.in_params + kernel.out_params, in_types + out_types):
        if param.name in scalars:
            infos.append(_kernel._ArgInfo(ARG_SCALAR, _scalar.CScalar, np.dtype(ptype), 0, True, True))
        else:
            ndim = raw_ndim.get(param.name, 1) if param.raw else 1
            infos.append(_kernel._ArgInfo(ARG_NDARRAY, cupy.ndarray, np.dtype(ptype), ndim, True, index_32_bits))
    infos.append(_kernel._ArgInfo(ARG_INDEXER, _carray.Indexer, None, 1, True, index_32_bits))
    return tuple(infos), type_map


def elementwise_code(kernel, dtype, scalars=(), raw_ndim=None, index_32_bits=True) -> str:
    infos, type_map = elementwise_arginfos(kernel, dtype, scalars, raw_ndim or {}, index_32_bits)
    return _kernel._get_elementwise_kernel_code(infos, type_map, kernel.params, kernel.operation, kernel.name,
                                                kernel.preamble, **kernel.kwargs)


def compile_elementwise(kernel, dtype, scalars=(), raw_ndim=None, index_32_bits=True) -> None:
    """What ElementwiseKernel.__call__ compiles (cupy/_core/_kernel.pyx, _get_elementwise_kernel)."""
    infos, type_map = elementwise_arginfos(kernel, dtype, scalars, raw_ndim or {}, index_32_bits)
    _kernel._get_elementwise_kernel.__wrapped__(infos, type_map, kernel.params, kernel.operation, kernel.name,
                                                kernel.preamble, **kernel.kwargs)


# ---- the checks ------------------------------------------------------------------------------------------------------
def test_cupy_is_the_pinned_version():
    assert cupy.__version__ == PINNED_CUPY, (
        f"CuPy {cupy.__version__}: this file uses CuPy {PINNED_CUPY}'s private code generator; check "
        "cupy/_core/_kernel.pyx, raw.pyx and cuda/compiler.py of the new version, then move PINNED_CUPY")


def constructor_calls() -> list[tuple[str, str, str, ast.Call]]:
    """(file, innermost enclosing function, constructor, call) of every kernel constructor in mpitrain/kernels."""
    found = []

    def visit(node, path: Path, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = None
            if isinstance(child, ast.Call):
                name = getattr(child.func, "attr", getattr(child.func, "id", None))
            if name in KERNEL_CONSTRUCTORS:
                found.append((path.name, where, name, child))
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            visit(child, path, inner)

    for path in sorted(KERNELS_DIR.glob("*.py")):
        visit(ast.parse(path.read_text()), path, "<module>")
    return found


def test_catalogue_lists_every_kernel():
    calls = constructor_calls()
    places = {(path, where, name) for path, where, name, _ in calls}
    assert places <= {ROW_MODULE_BUILDER, ELEMENTWISE_BUILDER}, (
        f"kernels built outside the catalogue of tests/test_gpu_compile.py: "
        f"{sorted(places - {ROW_MODULE_BUILDER, ELEMENTWISE_BUILDER})}")
    elementwise = fused._elementwise.__wrapped__()
    assert set(elementwise) == set(ELEMENTWISE), "fused._elementwise() and the ELEMENTWISE catalogue differ"
    assert sum(place[:3] == ELEMENTWISE_BUILDER for place in calls) == len(ELEMENTWISE)
    for _, _, name, call in calls:
        if name == "RawModule":  # the defaults compile_raw_module assumes
            assert {k.arg for k in call.keywords} <= {"code", "options", "name_expressions"}
    defined = set(re.findall(r"__global__\s+void\s+(\w+)", fused._ROW_SOURCE))
    assert defined == set(fused._ROW_KERNELS), f"row kernels defined {sorted(defined)}, listed {fused._ROW_KERNELS}"
    expressions = set(fused._row_module.__wrapped__().name_expressions)
    assert expressions == {f"{k}<{ROW_CTYPES[d]}>" for k in fused._ROW_KERNELS for d in DTYPES}


def test_argument_descriptions_render_as_cupy_renders_them():
    """The hand-built _ArgInfo kinds mean what CuPy means by them (an array, a scalar, the indexer)."""
    code = elementwise_code(fused._elementwise.__wrapped__()["adamw"], np.float32,
                            scalars=ELEMENTWISE["adamw"]["scalars"], index_32_bits=False)
    assert "CArray<float, 1, 1, 0> _raw_g" in code and "const float shrink" in code and "CIndexer<1, 0> _ind" in code


@pytest.mark.parametrize("arch", ARCHS)
def test_row_kernels_compile(nvrtc_for, arch):
    module, log = fused._row_module.__wrapped__(), io.StringIO()
    done = nvrtc_for(arch, lambda: compile_raw_module(module, log))
    assert set(done.mapping) == set(module.name_expressions) and all(done.mapping.values())
    assert log.getvalue().strip() == "", f"NVRTC warnings for the row kernels at sm_{arch}:\n{log.getvalue()}"
    print(f"sm_{arch}: {len(fused._ROW_KERNELS)} row kernels x {len(DTYPES)} dtypes = "
          f"{len(done.mapping)} instantiations, one module of {len(done.binary)} bytes")


@pytest.mark.parametrize("arch", ARCHS)
def test_elementwise_kernels_compile(nvrtc_for, arch):
    kernels, failures, compiled = fused._elementwise.__wrapped__(), [], 0
    for name, spec in ELEMENTWISE.items():
        for dtype in DTYPES:
            for index_32_bits in INDEX_32_BITS:
                try:
                    nvrtc_for(arch, functools.partial(compile_elementwise, kernels[name], dtype, spec["scalars"],
                                                      spec["raw_ndim"], index_32_bits))
                    compiled += 1
                except compiler.CompileException as exc:
                    failures.append(f"{name} {np.dtype(dtype).name} index32={index_32_bits}: {exc}")
    assert not failures, f"sm_{arch}:\n" + "\n".join(failures)
    print(f"sm_{arch}: {len(ELEMENTWISE)} elementwise kernels x {len(DTYPES)} dtypes x {len(INDEX_32_BITS)} index "
          f"widths = {compiled} compiled")


# ---- the check can fail ---------------------------------------------------------------------------------------------
@pytest.fixture(params=["row source", "row name expression", "elementwise operation"])
def broken_kernel(request):
    """A deliberately broken kernel of each kind, and what NVRTC's error must name."""
    if request.param == "row source":
        source = fused._ROW_SOURCE.replace("T r = rstd[blockIdx.x];", "T r = rstd_missing[blockIdx.x];")
        assert source != fused._ROW_SOURCE
        module = cupy.RawModule(code=source, options=("-std=c++14",), name_expressions=["norm_backward<float>"])
        return (lambda: compile_raw_module(module)), "rstd_missing"
    if request.param == "row name expression":
        module = cupy.RawModule(code=fused._ROW_SOURCE, options=("-std=c++14",), name_expressions=["layer_nrm<float>"])
        return (lambda: compile_raw_module(module)), "layer_nrm"
    kernel = cupy.ElementwiseKernel("T x", "T y", "y = gelu_missing(x);", "mpitrain_broken")
    return (lambda: compile_elementwise(kernel, np.float32)), "gelu_missing"


def test_a_broken_kernel_fails_to_compile(nvrtc_for, broken_kernel):
    build, culprit = broken_kernel
    with pytest.raises(compiler.CompileException, match=culprit):
        nvrtc_for(ARCHS[-1], build)
