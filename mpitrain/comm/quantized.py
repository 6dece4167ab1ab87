"""Block-quantized wire formats for communication (ZeRO++'s qwZ and qgZ): array math on numpy or CuPy (whichever
holds the input: backend.array_module), no MPI.

An array is cut into blocks of `block` elements (the last one may be short); each block travels as small codes and
one fp32 scale, symmetric around 0 and chosen from the block's largest magnitude (absmax), so one outlier costs
precision only in its own block:

    codec   codes per element            scale             worst error per element (|x| <= absmax of its block)
    int8    1 byte, round(x / s) in      s = absmax / 127   s / 2 = absmax / 254
            [-127, 127]
    int4    half a byte (two per byte,   s = absmax / 7     s / 2 = absmax / 14
            first in the low nibble),
            round(x / s) in [-7, 7]
    fp8     1 byte, float8 e4m3fn of     s = absmax / 448   2^-4 |x| (3 mantissa bits), and at most 2^-10 s for
            x / s                                           e4m3fn's subnormals: below absmax / 16 either way

Rounding is to nearest, ties to even (numpy's rint; ml_dtypes' cast does the same for fp8). An all-zero block has
scale 0 and decodes to zeros. fp8's quotient is clipped to +-448 before the cast: e4m3fn has no infinity, and a
value cast from beyond its range becomes NaN (x / s can round past 448 by an ulp of fp32).

On a GPU the codes are made where the values are: CuPy has no float8 dtype, so fp8 codes are made there by
arithmetic CuPy has (frexp, rint, ldexp: `e4m3fn_codes` / `e4m3fn_values`), bit for bit ml_dtypes' cast, rather
than by a round trip through host memory, which would copy every message to the host and back each micro-batch.

`encode(x, block)` returns (payload: uint8 array, scales: float32 array); `decode(payload, scales, n, block)`
returns the n values as float32. Payload bytes: n (int8, fp8) or ceil(n / 2) (int4); scales: ceil(n / block)
float32s. `wire_nbytes` says both, for the byte counters and the planner.
"""
from __future__ import annotations

import numpy as np
from ml_dtypes import float8_e4m3fn

from mpitrain.backend import array_module

CODECS = ("int8", "int4", "fp8")
FP8_MAX = 448.0  # float8 e4m3fn's largest finite value
LEVELS = {"int8": 127, "int4": 7, "fp8": FP8_MAX}  # what a block's absmax maps to
WORST_RELATIVE_ERROR = {"int8": 1 / 254, "int4": 1 / 14, "fp8": 1 / 16}  # per element, relative to its block's absmax


def check_codec(codec: str, block: int) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown quantization codec {codec!r}; expected one of {', '.join(CODECS)}")
    if block < 2 or block % 2:
        raise ValueError(f"quantization block must be an even number >= 2, got {block}")


def block_count(n: int, block: int) -> int:
    return -(-n // block)


def payload_nbytes(codec: str, n: int) -> int:
    """Bytes of the codes of n elements (int4: two per byte)."""
    return -(-n // 2) if codec == "int4" else n


def wire_nbytes(codec: str, n: int, block: int) -> int:
    """Bytes n elements take on the wire: codes + fp32 scales."""
    check_codec(codec, block)
    return payload_nbytes(codec, n) + 4 * block_count(n, block)


def _blocks(xp, x, block: int):
    """x flattened to float32, zero-padded to whole blocks, as (blocks, block)."""
    flat = xp.asarray(x).reshape(-1).astype(np.float32)
    padded = xp.zeros(block_count(flat.size, block) * block, np.float32)
    padded[:flat.size] = flat
    return padded.reshape(-1, block)


FP8_GRIDS = {"e4m3": (3, -6), "e5m2": (2, -14)}  # mantissa bits, exponent of the smallest normal (2^-6, 2^-14)


def fp8_round(xp, values, fmt: str = "e4m3"):
    """float32 `values` within the format's max rounded to nearest, ties to even, onto float8 `fmt`'s grid (e4m3fn or
    e5m2), still float32: ml_dtypes' cast by arithmetic on any array module (CuPy has no float8 dtype). A normal
    value f 2^e (f in [0.5, 1)) has `bits` mantissa bits, a spacing of 2^(e-1-bits); subnormals (below 2^low) the
    spacing 2^(low-bits). Scaling by the spacing (ldexp: a power of two) is exact, so rint rounds the mantissa to
    nearest even and scaling back gives the representable result; the sign, -0 and NaN pass through."""
    bits, low = FP8_GRIDS[fmt]
    _, exponent = xp.frexp(values)
    shift = xp.maximum(exponent - 1, low) - bits
    return xp.ldexp(xp.rint(xp.ldexp(values, -shift)), shift)


def e4m3fn_codes(xp, values):
    """float8 e4m3fn bytes (uint8) of float32 `values` within +-448, rounded to nearest, ties to even (fp8_round):
    ml_dtypes' cast by arithmetic on any array module."""
    one = xp.ones_like(values)
    magnitude = xp.where(xp.isnan(values), np.float32(0), xp.abs(values))  # NaN's code is set below
    rounded = fp8_round(xp, magnitude)
    _, exponent = xp.frexp(rounded)
    normal = rounded >= 2.0 ** -6
    biased = xp.where(normal, exponent + 6, 0)  # bias 7: rounded = 2^(exponent-1) (1 + mantissa / 8)
    mantissa = xp.where(normal, rounded / xp.ldexp(one, exponent - 1) * 8 - 8, rounded * 2.0 ** 9)
    codes = (biased.astype(np.uint8) << 3) | mantissa.astype(np.uint8)
    codes = xp.where(xp.isnan(values), np.uint8(0x7F), codes)  # e4m3fn's NaN (it has no infinity)
    return codes | (xp.signbit(values).astype(np.uint8) << 7)


def e4m3fn_values(xp, codes):
    """The float32 values of float8 e4m3fn bytes (uint8), on any array module: (8 + m) 2^(e-10) when the exponent
    field e > 0, m 2^-9 for subnormals; 0x7F / 0xFF are NaN."""
    exponent, mantissa = ((codes >> 3) & 0x0F).astype(np.int32), (codes & 0x07).astype(np.float32)
    magnitude = xp.where(exponent > 0, xp.ldexp(mantissa + 8, exponent - 10), mantissa * np.float32(2.0 ** -9))
    magnitude = xp.where((codes & 0x7F) == 0x7F, np.float32(np.nan), magnitude)
    return xp.where((codes & 0x80) != 0, -magnitude, magnitude).astype(np.float32)


def encode(x, block: int, codec: str):
    """(payload uint8, scales float32) of the values of `x`, block by block, on x's array module."""
    check_codec(codec, block)
    xp = array_module(x)
    x = xp.asarray(x)
    n, blocks = x.size, _blocks(xp, x, block)
    scales = (xp.abs(blocks).max(axis=1) / np.float32(LEVELS[codec])).astype(np.float32)
    divisor = xp.where(scales > 0, scales, np.float32(1))[:, None]  # an all-zero block: codes 0 under any divisor
    scaled = blocks / divisor
    if codec == "fp8":
        clipped = xp.clip(scaled, -FP8_MAX, FP8_MAX)
        codes = clipped.astype(float8_e4m3fn).view(np.uint8) if xp is np else e4m3fn_codes(xp, clipped)
        return codes.reshape(-1)[:n].copy(), scales
    levels = LEVELS[codec]
    codes = xp.clip(xp.rint(scaled), -levels, levels).astype(np.int8).reshape(-1)[:n]
    if codec == "int8":
        return codes.view(np.uint8).copy(), scales
    nibbles = xp.zeros(2 * payload_nbytes(codec, n), np.uint8)
    nibbles[:n] = codes.view(np.uint8) & 0x0F  # two's complement in 4 bits
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8), scales


def decode(payload, scales, n: int, block: int, codec: str):
    """The n float32 values that `encode` packed into (payload, scales), on the payload's array module."""
    check_codec(codec, block)
    xp = array_module(payload)
    payload, scales = xp.asarray(payload, np.uint8).reshape(-1), xp.asarray(scales, np.float32).reshape(-1)
    if payload.size != payload_nbytes(codec, n) or scales.size != block_count(n, block):
        raise ValueError(f"{codec} payload of {payload.size} bytes and {scales.size} scales do not hold {n} "
                         f"elements in blocks of {block}")
    if codec == "fp8":
        values = payload.view(float8_e4m3fn).astype(np.float32) if xp is np else e4m3fn_values(xp, payload)
    elif codec == "int8":
        values = payload.view(np.int8).astype(np.float32)
    else:
        nibbles = xp.empty(2 * payload.size, np.uint8)
        nibbles[0::2], nibbles[1::2] = payload & 0x0F, payload >> 4
        values = ((nibbles[:n].astype(np.int8) ^ 8) - 8).astype(np.float32)  # sign-extend 4 bits
    return values * xp.repeat(scales, block)[:n]
