"""gpu_check's fused-attention stage: the fused causal attention (cuDNN's SDPA graphs) against the cuBLAS batched
GEMMs, in bf16, on the shapes the models use: gpt2's 12 heads of 64 and llama's 8 query heads over 2 key/value heads
of 64 and of 128, at 1024 and 4096 tokens. Both paths run through the attention ops the model calls
(layers/ops.py), each one forced by its switch (ATTENTION_SWITCH), on the same inputs with the model's causal mask.

Per shape: the output's and dq/dk/dv's largest difference relative to the largest value of the cuBLAS result (above
PARITY_LIMIT fails the stage), each path's forward and backward time (CUDA events) and the fused one's speed-up.
Which path really ran is read off what it saved (the cuBLAS path keeps its T x T probabilities): a forced path
that did not run (a fused path that fell back, a switch not honoured) fails the stage.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from typing import NamedTuple

import numpy as np
from gpu_check_process import failed_output, inner, json_lines

from mpitrain.kernels.attention import ATTENTION_PATHS, ATTENTION_SWITCH

PARITY_LIMIT = 2e-2  # bf16 rounding alone: 3e-3 to 6e-3 against float64 (numpy, these head widths); two paths, ~2x
TOKENS_PER_SHAPE = 8192  # batch = this / sequence length: the same work per token at 1024 and 4096
REPEATS = 10  # timed calls per path and direction, after one untimed call (graph building, kernel compiling)
PATHS = ("cudnn", "cublas")  # the switch's values (ATTENTION_SWITCH), fused first: the cuBLAS one is the reference
assert set(PATHS) == set(ATTENTION_PATHS), f"{ATTENTION_SWITCH} takes {ATTENTION_PATHS}"


class AttentionShape(NamedTuple):
    model: str
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int

    @property
    def name(self) -> str:
        return f"{self.model} {self.heads}/{self.kv_heads}x{self.head_dim} T{self.tokens}"

    @property
    def batch(self) -> int:
        return max(1, TOKENS_PER_SHAPE // self.tokens)

    def causal_flops(self) -> float:
        """The forward's useful work: q k^T and p v over the causal half of the scores, 2 FLOPs per multiply-add."""
        return 2 * 2 * self.batch * self.heads * self.tokens * self.tokens * self.head_dim / 2


ATTENTION_SHAPES = tuple(AttentionShape(model, heads, kv_heads, head_dim, tokens)
                         for model, heads, kv_heads, head_dim in (("gpt2", 12, 12, 64), ("llama", 8, 2, 64),
                                                                  ("llama", 8, 2, 128))
                         for tokens in (1024, 4096))
GRADIENTS = ("dq", "dk", "dv")


# ---- the arithmetic of the verdict (numpy: tested without a GPU) ---------------------------------------------------
def relative_to_largest(got, want) -> float:
    """max |got - want| / max |want|, in float64: one number per tensor, read the same at any size and scale (an
    elementwise relative error blows up where want is near zero). inf where either holds a non-finite value, or
    want is all zeros and got is not."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {got.shape} and {want.shape}")
    if not (np.isfinite(got).all() and np.isfinite(want).all()):
        return math.inf
    largest, difference = np.abs(want).max(initial=0.0), np.abs(got - want).max(initial=0.0)
    if largest == 0.0:
        return 0.0 if difference == 0.0 else math.inf
    return float(difference / largest)


def parity_errors(fused: dict, reference: dict) -> dict[str, float]:
    """relative_to_largest of each result ("out", "dq", "dk", "dv") of the fused path against the reference's."""
    return {name: relative_to_largest(fused[name], reference[name]) for name in ("out", *GRADIENTS)}


def within_limit(errors: dict[str, float]) -> bool:
    return all(error <= PARITY_LIMIT for error in errors.values())  # inf and nan fail


def speedups(times_ms: dict[str, dict[str, float]]) -> dict[str, float]:
    """The fused path's speed-up over cuBLAS's, forward, backward and both (times in ms per path and direction)."""
    fused, reference = times_ms["cudnn"], times_ms["cublas"]
    both = (reference["forward"] + reference["backward"]) / (fused["forward"] + fused["backward"])
    return {"forward": round(reference["forward"] / fused["forward"], 2),
            "backward": round(reference["backward"] / fused["backward"], 2), "both": round(both, 2)}


# ---- on the GPU ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def attention_path(path: str):
    """Force one attention path for what runs inside (kernels/attention.py reads the switch at each call)."""
    before = os.environ.get(ATTENTION_SWITCH)
    os.environ[ATTENTION_SWITCH] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ATTENTION_SWITCH, None)
        else:
            os.environ[ATTENTION_SWITCH] = before


def elapsed_ms(cupy, call, repeats: int = REPEATS) -> float:
    """Mean device time of `call` (CUDA events around `repeats` calls on the current stream)."""
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / repeats


def saved_arrays(saved) -> list:
    if isinstance(saved, dict):
        saved = list(saved.values())
    if isinstance(saved, (tuple, list)):
        return [array for item in saved for array in saved_arrays(item)]
    return [saved] if hasattr(saved, "shape") else []


def ran_path(saved, tokens: int) -> str:
    """Which path ran, read off what attention saved for T = `tokens` (not a head width): the cuBLAS path keeps its
    probabilities, one key per column (last axis T); the fused one keeps nothing that wide (q, k, v, out, stats)."""
    return "cublas" if any(array.shape[-1] == tokens for array in saved_arrays(saved)) else "cudnn"


def path_in_use(cupy, ops, tokens: int = 256, head_dim: int = 64) -> str:
    """The path that one small causal bf16 attention call takes now (ran_path of what it saved)."""
    from mpitrain.backend import BFLOAT16
    q = cupy.asarray(np.zeros((1, 2, tokens, head_dim), np.uint16)).view(BFLOAT16)
    _, saved = ops.attention_forward(q, q, q, ops.causal_bias(tokens, tokens, cupy, BFLOAT16))
    return ran_path(saved, tokens)


def run_path(cupy, ops, nbytes_of, inputs: dict, path: str) -> dict:
    """One path on `inputs`: its results on the host (float32), its times, which path really ran and the bytes its
    saved state holds."""
    q, k, v, bias, dout = (inputs[name] for name in ("q", "k", "v", "bias", "dout"))
    with attention_path(path):
        (out, _), saved = ops.attention_forward(q, k, v, bias)
        grads = ops.attention_backward(saved, dout)
        times = {"forward": elapsed_ms(cupy, lambda: ops.attention_forward(q, k, v, bias)),
                 "backward": elapsed_ms(cupy, lambda: ops.attention_backward(saved, dout))}
    host = {name: cupy.asnumpy(array.astype(cupy.float32)) for name, array in zip(("out", *GRADIENTS), (out, *grads))}
    return {"results": host, "ms": times, "ran": ran_path(saved, q.shape[2]), "saved_bytes": nbytes_of(saved)}


def device_inputs(cupy, ops, shape: AttentionShape, seed: int = 0) -> dict:
    """q, k, v and the output's gradient (standard normal, rounded to bf16 on the host), and the model's mask."""
    from mpitrain.backend import BFLOAT16
    rng = np.random.default_rng(seed)
    b, t, d = shape.batch, shape.tokens, shape.head_dim
    sizes = {"q": (b, shape.heads, t, d), "k": (b, shape.kv_heads, t, d), "v": (b, shape.kv_heads, t, d),
             "dout": (b, shape.heads, t, d)}
    inputs = {name: cupy.asarray(rng.standard_normal(size, np.float32).astype(BFLOAT16).view(np.uint16)).view(BFLOAT16)
              for name, size in sizes.items()}
    inputs["bias"] = ops.causal_bias(t, t, cupy, BFLOAT16)  # what model/gpt.py hands every block
    return inputs


def shape_record(cupy, ops, nbytes_of, shape: AttentionShape) -> dict:
    record = {"shape": shape.name, "batch": shape.batch}
    inputs = device_inputs(cupy, ops, shape)
    runs = {path: run_path(cupy, ops, nbytes_of, inputs, path) for path in PATHS}
    wrong_path = {f"{ATTENTION_SWITCH}={path}": run["ran"] for path, run in runs.items() if run["ran"] != path}
    errors = parity_errors(runs["cudnn"]["results"], runs["cublas"]["results"])
    times = {path: run["ms"] for path, run in runs.items()}
    record.update(errors=errors, passed=within_limit(errors) and not wrong_path, ms=times, speedup=speedups(times),
                  fused_tflops={direction: round(flops / (times["cudnn"][direction] * 1e9), 1) for direction, flops
                                in (("forward", shape.causal_flops()), ("backward", 2.5 * shape.causal_flops()))},
                  saved_bytes={path: run["saved_bytes"] for path, run in runs.items()})
    if wrong_path:  # a fused path that fell back, or a switch not honoured: its numbers would compare nothing
        record["error"] = "the switch did not take: " + ", ".join(f"{switch} ran {ran}" for switch, ran in
                                                                  wrong_path.items())
    return record


def attention_inner(shapes=ATTENTION_SHAPES) -> None:
    """Prints one "SHAPE {...}" line per shape (an exception is that shape's error; the others still run)."""
    import cupy

    from mpitrain.backend import nbytes_of
    from mpitrain.layers import ops
    for shape in shapes:
        try:
            cupy.get_default_memory_pool().free_all_blocks()  # the shape before's (T = 4096: several GB)
            record = shape_record(cupy, ops, nbytes_of, shape)
        except Exception as exc:  # noqa: BLE001 (one shape failing must not hide the others)
            record = {"shape": shape.name, "passed": False, "error": f"{type(exc).__name__}: {exc}"}
        print("SHAPE " + json.dumps(record), flush=True)


# ---- the stage -----------------------------------------------------------------------------------------------------
def shape_line(record: dict) -> str:
    """One shape in a few words, for the summary: its worst error and the fused path's speed-ups."""
    if "errors" not in record:
        return record.get("error", "not run")
    speedup = record["speedup"]
    return (f"max error {max(record['errors'].values()):.1e}, fused {speedup['both']:.2f}x faster "
            f"(forward {speedup['forward']:.2f}x, backward {speedup['backward']:.2f}x)")


def attention_verdict(status: int, records: list[dict], shapes=ATTENTION_SHAPES) -> dict:
    """passed: every shape ran and is within the limit; the worst error and each shape's line, for the summary."""
    found = {record["shape"]: record for record in records}
    failed = {shape.name: found[shape.name].get("error") or found[shape.name].get("errors") if shape.name in found
              else "not run" for shape in shapes if not found.get(shape.name, {}).get("passed")}
    errors = [error for record in records for error in record.get("errors", {}).values()]
    return {"passed": status == 0 and not failed, "worst_error": max(errors, default=None),
            "parity_limit": PARITY_LIMIT, "per_shape": {name: shape_line(record) for name, record in found.items()},
            **({"failed_shapes": failed} if failed else {}), "shapes": found}


def attention(limit_s: float) -> dict:
    status, output = inner("attention", limit_s)
    result = attention_verdict(status, json_lines(output, "SHAPE "))
    return {**result, **failed_output(not result["passed"], output)}
