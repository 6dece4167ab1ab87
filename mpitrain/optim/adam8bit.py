"""8-bit AdamW: both moments stored as one byte per element, in blocks of 2048 with one scale (absmax) per block.

Quantization map. A linear map loses small values: a block's second moments span many decades, and a v rounded to
0 turns m / (sqrt(v) + eps) into a huge step. Dettmers et al. (8-bit optimizers) use a dynamic map whose codes keep
relative precision over several decades; we use a simpler relative of it, a logarithmic map: 0 and magnitudes
10^(-7 k/n) for k = 0..n-1 (signed, for m: +-127 magnitudes; unsigned, for v: 255), so every value within 7 decades
of its block's absmax is stored to within +-3% (signed) / +-1.6% (unsigned) relative error, and exactly at the absmax.
A value is rounded to the nearest code (by value). The second moment is stored as its square root (the rms the
update divides by): 7 decades of rms are 14 of v, so a block whose gradients span many decades keeps its small v's
instead of rounding them to 0 (tests/test_optimizers.py shows the difference). Bytes per parameter: 2 + 2 x scale
bytes / 2048.

Blocks start at each segment's start (a segment is a ZeRO shard of one unit, or the whole buffer), so a block never
straddles two segments; the step dequantizes, updates and requantizes a chunk of blocks at a time (bounded transient
memory). Checkpoints hold the codes and each element's block scale (element-wise, so the pieces mean the same under
any layout); a restore into the same blocks is bitwise, into other blocks (another dp / ZeRO layout) requantizes.
"""
from __future__ import annotations

import math

import numpy as np

from mpitrain.backend import array_module
from mpitrain.optim.common import decay, scaled_grad, segment_bounds

BLOCK = 2048
CHUNK_BLOCKS = 64  # blocks dequantized at once during a step
DECADES = 7


def quantization_map(signed: bool) -> np.ndarray:
    """Sorted code values in [-1, 1] (signed, 255 codes) or [0, 1] (unsigned, 256 codes)."""
    n = 127 if signed else 255
    magnitudes = 10.0 ** (-DECADES * np.arange(n) / (n - 1))  # 1 ... 1e-7
    values = np.concatenate([-magnitudes, [0.0], magnitudes]) if signed else np.concatenate([[0.0], magnitudes])
    return np.sort(values)


def quantize(values, table, xp):
    """(codes uint8, absmax per block) of a 1-D array cut into blocks of BLOCK (the last may be short)."""
    n = values.size
    blocks = -(-n // BLOCK)
    padded = xp.zeros(blocks * BLOCK, dtype=values.dtype)
    padded[:n] = values
    padded = padded.reshape(blocks, BLOCK)
    absmax = xp.abs(padded).max(axis=1)
    normalised = padded / xp.where(absmax > 0, absmax, 1)[:, None]
    midpoints = (table[1:] + table[:-1]) / 2
    codes = xp.searchsorted(midpoints, normalised.ravel()[:n]).astype(xp.uint8)
    return codes, absmax


def dequantize(codes, absmax, table):
    n = codes.size
    values = table[codes]
    blocks = absmax.size
    out = values.astype(absmax.dtype)
    full = n - (n % BLOCK) if n % BLOCK else n
    out[:full] = (out[:full].reshape(-1, BLOCK) * absmax[:full // BLOCK, None]).ravel()
    if full < n:
        out[full:] *= absmax[blocks - 1]
    return out


class Adam8bit:
    def __init__(self, segments, hyper, state_dtype=None):
        xp = array_module(segments[0].params)
        self.xp, self.segments, self.hyper = xp, segments, hyper
        self.dtype = state_dtype or segments[0].params.dtype
        self.bounds = segment_bounds(segments)
        self.block_bounds, blocks = [], 0  # [first block, end block) of each segment in the scale arrays
        for start, end in self.bounds:
            self.block_bounds.append((blocks, blocks + -(-(end - start) // BLOCK)))
            blocks += self.block_bounds[-1][1] - self.block_bounds[-1][0]
        total = self.bounds[-1][1]
        self.tables = {"m": xp.asarray(quantization_map(True), dtype=self.dtype),
                       "v": xp.asarray(quantization_map(False), dtype=self.dtype)}
        zero_m = int(np.searchsorted(quantization_map(True), 0.0))
        self.codes = {"m": xp.full(total, zero_m, dtype=xp.uint8), "v": xp.zeros(total, dtype=xp.uint8)}
        self.absmax = {"m": xp.zeros(blocks, dtype=self.dtype), "v": xp.zeros(blocks, dtype=self.dtype)}
        self.steps_taken = 0
        self._checkpoint: dict = {}

    def state_arrays(self) -> list:
        return [self.codes["m"], self.codes["v"], self.absmax["m"], self.absmax["v"]]

    def state_nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.state_arrays()))

    def moment(self, which: str, segment_index: int):
        """A segment's moment as stored, dequantized (for "v": its square root)."""
        (start, end), (b0, b1) = self.bounds[segment_index], self.block_bounds[segment_index]
        return dequantize(self.codes[which][start:end], self.absmax[which][b0:b1], self.tables[which])

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        self.steps_taken += 1
        h, t = self.hyper, self.steps_taken
        bias1, bias2 = 1.0 - h.beta1 ** t, math.sqrt(1.0 - h.beta2 ** t)
        for segment, (start, end), (b0, _) in zip(self.segments, self.bounds, self.block_bounds):
            g_all = scaled_grad(segment, self.dtype, grad_scale)
            decay(segment, lr, h.weight_decay)
            for lo in range(0, end - start, CHUNK_BLOCKS * BLOCK):
                hi = min(lo + CHUNK_BLOCKS * BLOCK, end - start)
                blocks = slice(b0 + lo // BLOCK, b0 + -(-hi // BLOCK))
                codes = {k: self.codes[k][start + lo:start + hi] for k in "mv"}
                m = dequantize(codes["m"], self.absmax["m"][blocks], self.tables["m"])
                v = dequantize(codes["v"], self.absmax["v"][blocks], self.tables["v"]) ** 2  # stored: sqrt(v)
                g = g_all[lo:hi]
                m = h.beta1 * m + (1.0 - h.beta1) * g
                v = h.beta2 * v + (1.0 - h.beta2) * (g * g)
                rms = self.xp.sqrt(v)
                segment.params[lo:hi] -= (lr / bias1) * m / (rms / bias2 + h.eps)
                for k, values in (("m", m), ("v", rms)):
                    codes[k][...], self.absmax[k][blocks] = quantize(values, self.tables[k], self.xp)

    # -- checkpoints: the codes and each element's block scale, element-wise
    def _expanded_absmax(self, which: str):
        out = self.xp.zeros(self.bounds[-1][1], dtype=self.dtype)
        for (start, end), (b0, b1) in zip(self.bounds, self.block_bounds):
            out[start:end] = self.xp.repeat(self.absmax[which][b0:b1], BLOCK)[:end - start]
        return out

    def checkpoint_arrays(self) -> dict:
        self._checkpoint = {"adam8bit_m_code": self.codes["m"], "adam8bit_v_code": self.codes["v"],
                            "adam8bit_m_absmax": self._expanded_absmax("m"),
                            "adam8bit_v_absmax": self._expanded_absmax("v")}
        return self._checkpoint

    def after_restore(self) -> None:
        """The codes were loaded in place; take each block's scale from its elements', requantizing the blocks whose
        elements came from different saved blocks."""
        xp = self.xp
        for k in "mv":
            expanded = self._checkpoint[f"adam8bit_{k}_absmax"]
            for (start, end), (b0, b1) in zip(self.bounds, self.block_bounds):
                n = end - start
                padded = xp.zeros((b1 - b0) * BLOCK, dtype=self.dtype)
                padded[:n] = expanded[start:end]
                padded[n:] = expanded[end - 1] if n else 0
                per_block = padded.reshape(-1, BLOCK)
                if bool((per_block == per_block[:, :1]).all()):
                    self.absmax[k][b0:b1] = per_block[:, 0]
                    continue
                values = self.tables[k][self.codes[k][start:end]] * expanded[start:end]
                self.codes[k][start:end], self.absmax[k][b0:b1] = quantize(values, self.tables[k], xp)
        self._checkpoint = {}
