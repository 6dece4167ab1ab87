"""gpu_check's FP8 check (in the features stage): cuBLASLt's FP8 GEMMs (mpitrain/layers/fp8_lt.py) against the
emulation's matmul of the same dequantized operands, for each recipe's forward, input-gradient and weight-gradient
GEMM at 1024 x 1024 x 1024 (largest error relative to the largest value; above FP8_PARITY_LIMIT fails; mxfp8 and
block's weight gradient must stay on the emulation), then one FP8 GEMM (tensor scaling) against a bf16 GEMM at
8192 x 8192 x 8192: each one's time and the ratio bf16 / fp8 (the FP8 speed-up).
"""
from __future__ import annotations

import json

from gpu_check_process import failed_output, inner, json_lines

FP8_PARITY_LIMIT = 5e-3  # Hopper's FP8 tensor cores add in limited precision before cuBLASLt's fp32 sums
FP8_CHECK_SHAPE = 1024
FP8_TIMING_SIZE = 8192
FP8_LIMIT_S = 30
RECIPES = ("tensor", "delayed", "block", "mxfp8")


def fp8_inner() -> None:
    """Prints "FP8 {...}" per recipe, then "FP8_TIMING {...}"; a failure inside one recipe is its line's error."""
    import cupy
    import numpy as np

    from mpitrain.kernels import fp8_gemm
    from mpitrain.layers import fp8_lt, ops
    from mpitrain.layers.fp8 import Fp8Gemms

    rng = np.random.default_rng(0)
    n = FP8_CHECK_SHAPE
    x, w, dy = (cupy.asarray(rng.standard_normal(shape).astype(np.float32) * scale)
                for shape, scale in (((n, n), 2.0), ((n, n), 0.03), ((n, n), 1e-3)))
    for recipe in RECIPES:
        line = {"recipe": recipe}
        try:
            g = Fp8Gemms(recipe, name="check")
            xq, wq, dyq = g.inputs(["x"], [x])[0], g.weights(["w"], [w], -1)[0], g.output_grads(["dy"], [dy])[0]
            dw, dw_emulated = cupy.zeros_like(w), cupy.zeros_like(w)
            fp8_lt.add_weight_grad(g, ("x", "dy"), dw, xq, dyq)
            ops.add_weight_grad(dw_emulated, xq, dyq)
            pairs = {"forward": (fp8_lt.linear_forward(g, ("x", "w"), xq, wq)[0], ops.linear_forward(xq, wq)[0]),
                     "dgrad": (fp8_lt.linear_input_grad(g, ["w"], [wq], ["dy"], [dyq]),
                               ops.linear_input_grad([wq], [dyq])),
                     "wgrad": (dw, dw_emulated)}
            errors = {name: float(cupy.abs(got - want).max() / cupy.abs(want).max()) for name, (got, want) in
                      pairs.items()}
            through_lt = fp8_lt.runner(g, xq) is not None
            line.update(cublaslt=through_lt, errors=errors, passed=through_lt == (recipe != "mxfp8") and
                        max(errors.values()) <= FP8_PARITY_LIMIT)
        except Exception as exc:  # noqa: BLE001 (one recipe failing must not hide the others)
            line.update(passed=False, error=f"{type(exc).__name__}: {exc}")
        print("FP8 " + json.dumps(line), flush=True)
    lt, why = fp8_gemm.device_lt()
    print("FP8_TIMING " + json.dumps(timing(lt) if lt is not None else {"error": why}), flush=True)


def timing(lt) -> dict:
    """One tensor-scaled FP8 GEMM and one bf16 GEMM at FP8_TIMING_SIZE cubed: median milliseconds of 10 and the
    ratio bf16 / fp8."""
    import cupy
    import ml_dtypes
    import numpy as np

    from mpitrain.kernels.fp8_gemm import Fp8Operand

    n = FP8_TIMING_SIZE
    codes = cupy.random.randint(0, 0x70, (n, n), dtype=np.uint8)  # e4m3 patterns of moderate values
    scale = cupy.ones(1, np.float32)
    operand = Fp8Operand(codes, "e4m3", scale, "scalar")
    a = cupy.asarray(np.random.default_rng(1).standard_normal((n, n)).astype(ml_dtypes.bfloat16))
    times = {"fp8_ms": median_ms(lambda: lt.matmul(operand, operand)), "bf16_ms": median_ms(lambda: a @ a)}
    return {**times, "size": n, "fp8_speedup": times["bf16_ms"] / times["fp8_ms"],
            "fp8_tflops": 2 * n ** 3 / times["fp8_ms"] / 1e9}


def median_ms(work, repeats: int = 10) -> float:
    import cupy
    work()  # the first call plans (cuBLASLt's heuristic, cuBLAS's handle)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return sorted(times)[len(times) // 2]


def fp8_check(limit_s: float) -> dict:
    """The FP8 check in its own process: per recipe, its errors; the timing's ratio."""
    status, output = inner("fp8", limit_s)
    recipes, timings = json_lines(output, "FP8 "), json_lines(output, "FP8_TIMING ")
    passed = status == 0 and len(recipes) == len(RECIPES) and all(r["passed"] for r in recipes) and bool(timings)
    errors = [error for r in recipes for error in r.get("errors", {}).values()]
    return {"passed": passed, "recipes": recipes, "timing": timings[-1] if timings else None,
            "fp8_worst_error": max(errors, default=None), "fp8_parity_limit": FP8_PARITY_LIMIT,
            "fp8_speedup": (timings[-1] if timings else {}).get("fp8_speedup"), **failed_output(not passed, output)}
