"""Peak FLOP/s of this rank, measured, so that MFU compares the model's work with what this machine can do."""
from __future__ import annotations

import time


def measure_matmul_peak(backend, n: int = 1024, seconds: float = 0.3) -> float:
    """Best float32 FLOP/s of an n x n matmul over ~`seconds` (the best, not the mean: noise only slows)."""
    xp = backend.xp
    a = xp.ones((n, n), dtype=xp.float32)
    b = xp.ones((n, n), dtype=xp.float32)
    out = a @ b  # warm-up: thread pools, caches
    backend.synchronize()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        start = time.perf_counter()
        xp.matmul(a, b, out=out)
        backend.synchronize()
        best = max(best, 2.0 * n ** 3 / (time.perf_counter() - start))
    return best
