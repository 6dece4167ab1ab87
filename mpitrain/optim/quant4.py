"""A signed array stored in 4 bits per element: blocks of BLOCK elements, one scale (absmax / 7) per block, codes
-7..7 (stored +8, two per byte). Adafactor keeps its first moment this way (optim.adafactor_momentum = "int4"):
0.5 + itemsize / BLOCK bytes per element, about 0.53 in fp32.

Blocks are each tensor's own (optim/blocks.py): `first` is the tensor index of an array's first element, so block k
of a tensor is its elements [k BLOCK, (k + 1) BLOCK) in every layout (one process or a pipeline stage).

Rounding. An exponential moving average written back to a coarse grid every step sticks with nearest rounding:
0.9 m rounds back to m whenever a code's neighbours are more than 10% away, and the gradient's (1 - beta1) share is
mostly below half a code step, so the moment would neither decay nor follow the gradient. The step therefore rounds
stochastically (unbiased: E[stored] = value; Li et al. 2023, "Memory efficient optimizers with 4-bit states", keep
the first moment in 4 bits the same way). Each element's draw is a hash (splitmix64) of `seed` (the step and the
tensor) and its index in the tensor, so it is the same in every layout, and a run and its resume draw the same ones.
Requantizing a restored block rounds to nearest (it is done once).
"""
from __future__ import annotations

from mpitrain.optim.blocks import block_values, padded_blocks

BLOCK = 128
LEVELS = 7  # codes -7..7


def packed_size(n: int) -> int:
    return -(-n // 2)


def _blocked(values, xp, first: int):
    """values in zero padding as (blocks, BLOCK) rows, the first `first % BLOCK` places before them."""
    return padded_blocks(values, xp, first % BLOCK, BLOCK)


MASK, GOLDEN = (1 << 64) - 1, 0x9E3779B97F4A7C15
MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64's finaliser constants


def _mix_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * MIX[0]) & MASK
    z = ((z ^ (z >> 27)) * MIX[1]) & MASK
    return z ^ (z >> 31)


def uniform(seed: int, first: int, n: int, xp):
    """n float32 draws in [0, 1) for the elements first .. first + n - 1 of a tensor: each a function of (seed, its
    index) only (splitmix64: the mixed seed + index x golden ratio, mixed; its top 24 bits). uint64 arrays wrap."""
    u64 = xp.uint64
    z = u64((_mix_int(seed & MASK) + first * GOLDEN) & MASK) + xp.arange(n, dtype=u64) * u64(GOLDEN)
    z = (z ^ (z >> u64(30))) * u64(MIX[0])
    z = (z ^ (z >> u64(27))) * u64(MIX[1])
    z ^= z >> u64(31)
    return (z >> u64(40)).astype(xp.float32) * xp.float32(2.0 ** -24)


def block_scales(values, xp, first: int = 0):
    """The scale (absmax / LEVELS) of each block a 1-D array overlaps, its first element the tensor's `first`."""
    return xp.abs(_blocked(values, xp, first)).max(axis=1) / LEVELS


def quantize(values, xp, seed: int | None = None, first: int = 0, scale=None):
    """(codes 0..15 per element, uint8; scale per block) of a 1-D array, its first element the tensor's `first`;
    seed: stochastic rounding (None: nearest); scale: the blocks' scales when other elements of them live elsewhere
    (default: block_scales of the values)."""
    n, lead = values.size, first % BLOCK
    blocked = _blocked(values, xp, first)
    scale = xp.abs(blocked).max(axis=1) / LEVELS if scale is None else scale
    scaled = (blocked / xp.where(scale > 0, scale, 1)[:, None]).ravel()[lead:lead + n]
    rounded = xp.rint(scaled) if seed is None else xp.floor(scaled + uniform(seed, first, n, xp))
    return (xp.clip(rounded, -LEVELS, LEVELS) + 8).astype(xp.uint8), scale


def dequantize(codes, scale, xp, first: int = 0):
    n, lead = codes.size, first % BLOCK
    values = _blocked(codes.astype(scale.dtype) - 8, xp, first) * scale[:, None]
    return values.ravel()[lead:lead + n]


def pack(codes, xp):
    """Two 4-bit codes per byte (the first in the low half)."""
    if codes.size % 2:
        codes = xp.concatenate([codes, xp.full(1, 8, dtype=xp.uint8)])
    return codes[0::2] | (codes[1::2] << 4)


def unpack(packed, n: int, xp):
    out = xp.empty(2 * packed.size, dtype=xp.uint8)
    out[0::2], out[1::2] = packed & 15, packed >> 4
    return out[:n]


def expand_scales(scale, n: int, xp, first: int = 0):
    """Each element's block scale (what a checkpoint saves element-wise)."""
    lead = first % BLOCK
    return xp.repeat(scale, BLOCK)[lead:lead + n]


def scales_from_elements(expanded, codes, xp, first: int = 0):
    """A run's per-block scales from element-wise saved scales and codes: taken as they are where every element
    of a block carries the same scale (restored into the same blocks: bitwise), else requantized from the values."""
    per_block = block_values(expanded, first % BLOCK, BLOCK, xp)
    if per_block is not None:
        return codes, per_block
    values = (codes.astype(expanded.dtype) - 8) * expanded
    return quantize(values, xp, first=first)
