"""FLOPs and peak FLOP/s: what MFU compares.

Model FLOPs per token (GPT.flops_per_token, the basis of MFU): 6 per matmul weight (forward 2, backward 4) plus
12 * L * d * s for attention's two batched products (QK^T and PV, forward 4 L d s, backward 8 L d s). Causal
attention is counted WHOLE, as PaLM's formula does, although half the score matrix is masked: MFU stays comparable
with published numbers, and a kernel that skips masked blocks shows up as a higher MFU.

Hardware FLOPs (`hardware_flops_per_token`) add what recomputation runs again: a fully recomputed block repeats
its forward (2 per matmul weight + 4 d s), a selective one repeats attention's products (4 d s). The ratio of the
two is the price of the memory saved. A fused causal attention (cuDNN's SDPA, FlashAttention's scheme) skips the
masked half of the scores' tiles and recomputes Q K^T in backward: 7 products at half size, 7 d s per block instead
of 12 (`fused_attention_discount`), and 2 d s instead of 4 when recomputed.

Peak FLOP/s per rank, in this order: logging.peak_flops; the dense datasheet number of a known accelerator for the
compute dtype (bf16/fp16 tensor cores, or tf32 for float32); else measured with a float32 matmul (CPU).
"""
from __future__ import annotations

import time

# Dense (no sparsity) tensor-core FLOP/s per GPU from NVIDIA's datasheets (SXM parts): (bf16/fp16, tf32).
KNOWN_PEAKS = {
    "B200": (2.25e15, 1.1e15),
    "H200": (989e12, 494.5e12),
    "H100": (989e12, 494.5e12),
    "A100": (312e12, 156e12),
}


def table_peak(device_name: str, compute: str) -> float | None:
    """The datasheet peak for a device whose name contains a KNOWN_PEAKS key (e.g. 'NVIDIA H100 80GB HBM3')."""
    for key, (half, tf32) in KNOWN_PEAKS.items():
        if key in device_name.upper():
            return half if compute in ("bfloat16", "float16") else tf32 if compute == "float32" else None
    return None


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


def peak_flops(configured: float, backend, compute: str) -> tuple[float, str]:
    """(FLOP/s of this rank, where the number comes from: 'logging.peak_flops', the device's name, 'measured')."""
    if configured:
        return configured, "logging.peak_flops"
    if backend.device == "cuda":
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        peak = table_peak(name, compute)
        if peak:
            return peak, f"{name} datasheet ({compute})"
    return measure_matmul_peak(backend), "measured float32 matmul"


def block_matmul_weights(model_cfg) -> int:
    """Matmul weights of one transformer block (biases and norms left out): Q, K, V, O and the MLP's."""
    d, kv = model_cfg.d_model, model_cfg.kv_heads * model_cfg.head_dim
    mlp = (3 if model_cfg.arch == "llama" else 2) * d * model_cfg.ff_dim
    return 2 * d * d + 2 * d * kv + mlp


def recomputed_flops_per_token(model_cfg, layer_counts: list[int], mode: str, layers: int = 0,
                               ring: bool = False) -> float:
    """FLOPs per token that recomputation adds: layer_counts are the blocks of each (virtual) pipeline stage, of
    which the first `layers` (0: all) recompute in `mode` (memory.recompute). ring (parallel.cp > 1): selective
    keeps ring attention's whole core, so it recomputes no attention."""
    if mode == "none":
        return 0.0
    blocks = sum(count if layers == 0 else min(layers, count) for count in layer_counts)
    attention = 0.0 if ring and mode == "selective" else 4.0 * model_cfg.d_model * model_cfg.seq_len
    per_block = attention + (2.0 * block_matmul_weights(model_cfg) if mode == "full" else 0.0)
    return blocks * per_block


def fused_attention_discount(model_cfg, blocks: int, recomputing: bool) -> float:
    """FLOPs per token a fused causal attention does not run, against the whole 12 d s per block counted above (and
    4 d s per recomputing block): 5 d s per block, 2 d s more per recomputed one (module docstring)."""
    per_block = 5.0 + (2.0 if recomputing else 0.0)
    return blocks * per_block * model_cfg.d_model * model_cfg.seq_len
