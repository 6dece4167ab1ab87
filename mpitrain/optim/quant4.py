"""A signed array stored in 4 bits per element: blocks of BLOCK elements, one scale (absmax / 7) per block, codes
-7..7 (stored +8, two per byte). Adafactor keeps its first moment this way (optim.adafactor_momentum = "int4"):
0.5 + itemsize / BLOCK bytes per element, about 0.53 in fp32.

Rounding. An exponential moving average written back to a coarse grid every step sticks with nearest rounding:
0.9 m rounds back to m whenever a code's neighbours are more than 10% away, and the gradient's (1 - beta1) share is
mostly below half a code step, so the moment would neither decay nor follow the gradient. The step therefore rounds
stochastically (unbiased: E[stored] = value; Li et al. 2023, "Memory efficient optimizers with 4-bit states", keep
the first moment in 4 bits the same way), with random numbers drawn from `seed` (the step and the segment), so a
run and its resume draw the same ones. Requantizing a restored block rounds to nearest (it is done once).
"""
from __future__ import annotations

BLOCK = 128
LEVELS = 7  # codes -7..7


def blocks_of(n: int) -> int:
    return -(-n // BLOCK)


def packed_size(n: int) -> int:
    return -(-n // 2)


def nbytes(n: int, itemsize: int) -> int:
    """Bytes that hold n elements: the packed codes and one scale per block."""
    return packed_size(n) + itemsize * blocks_of(n)


def _blocked(values, xp):
    n = values.size
    padded = xp.zeros(blocks_of(n) * BLOCK, dtype=values.dtype)
    padded[:n] = values
    return padded.reshape(-1, BLOCK)


def quantize(values, xp, seed: int | None = None):
    """(codes 0..15 per element, uint8; scale per block) of a 1-D array; seed: stochastic rounding (None: nearest)."""
    n = values.size
    blocked = _blocked(values, xp)
    scale = xp.abs(blocked).max(axis=1) / LEVELS
    scaled = blocked / xp.where(scale > 0, scale, 1)[:, None]
    if seed is None:
        rounded = xp.rint(scaled)
    else:
        rounded = xp.floor(scaled + xp.random.default_rng(seed).random(scaled.shape, dtype=xp.float32))
    codes = (xp.clip(rounded, -LEVELS, LEVELS) + 8).astype(xp.uint8).ravel()[:n]
    return codes, scale


def dequantize(codes, scale, xp):
    n = codes.size
    values = _blocked(codes.astype(scale.dtype) - 8, xp) * scale[:, None]
    return values.ravel()[:n]


def pack(codes, xp):
    """Two 4-bit codes per byte (the first in the low half)."""
    if codes.size % 2:
        codes = xp.concatenate([codes, xp.full(1, 8, dtype=xp.uint8)])
    return codes[0::2] | (codes[1::2] << 4)


def unpack(packed, n: int, xp):
    out = xp.empty(2 * packed.size, dtype=xp.uint8)
    out[0::2], out[1::2] = packed & 15, packed >> 4
    return out[:n]


def expand_scales(scale, n: int, xp):
    """Each element's block scale (what a checkpoint saves element-wise)."""
    return xp.repeat(scale, BLOCK)[:n]


def scales_from_elements(expanded, codes, xp):
    """A segment's per-block scales from element-wise saved scales and codes: taken as they are where every element
    of a block carries the same scale (restored into the same blocks: bitwise), else requantized from the values."""
    n = expanded.size
    padded = _blocked(expanded, xp)
    if n % BLOCK:
        padded[-1, n % BLOCK:] = expanded[-1]
    if bool((padded == padded[:, :1]).all()):
        return codes, padded[:, 0].copy()
    values = (codes.astype(expanded.dtype) - 8) * expanded
    return quantize(values, xp)
