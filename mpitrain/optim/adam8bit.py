"""8-bit AdamW: both moments stored as one byte per element, in blocks of 2048 with one scale (absmax) per block.

Quantization map. A linear map loses small values: a block's second moments span many decades, and a v rounded to
0 turns m / (sqrt(v) + eps) into a huge step. Dettmers et al. (8-bit optimizers) use a dynamic map whose codes keep
relative precision over several decades; we use a simpler relative of it, a logarithmic map: 0 and magnitudes
10^(-7 k/n) for k = 0..n-1 (signed, for m: +-127 magnitudes; unsigned, for v: 255), so every value within 7 decades
of its block's absmax is stored to within +-3% (signed) / +-1.6% (unsigned) relative error, and exactly at the absmax.
A value is rounded to the nearest code (by value). The second moment is stored as its square root (the rms the
update divides by): 7 decades of rms are 14 of v, so a block whose gradients span many decades keeps its small v's
instead of rounding them to 0 (tests/test_optimizers.py shows the difference). Bytes per parameter: 2 + 2 x scale
bytes / 2048, and 2 scales more for each tensor's last (shorter) block.

Blocks are each tensor's own (mpitrain/optim/blocks.py: block k of a tensor is its elements [k 2048, (k+1) 2048),
on whichever rank they live), so every layout stores the same codes and scales as one process; a block cut by a ZeRO
shard boundary gets its absmax from one small all-reduce (max) over the shard group after the step. The step
dequantizes, updates and requantizes a chunk of blocks of one tensor at a time (bounded transient memory).
Checkpoints hold the codes and each element's block scale (element-wise, so the pieces mean the same under any
layout, and a restore is bitwise); a checkpoint whose blocks were cut elsewhere (older runs) is requantized.
"""
from __future__ import annotations

import math

import numpy as np

from mpitrain.backend import array_module
from mpitrain.optim.blocks import Run, block_count, block_values, blocks_spanned, padded_blocks
from mpitrain.optim.common import decay, scaled_grad, segment_bounds
from mpitrain.state.offload import OnDevice

BLOCK = 2048
CHUNK_BLOCKS = 64  # blocks dequantized at once during a step
DECADES = 7


def quantization_map(signed: bool) -> np.ndarray:
    """Sorted code values in [-1, 1] (signed, 255 codes) or [0, 1] (unsigned, 256 codes)."""
    n = 127 if signed else 255
    magnitudes = 10.0 ** (-DECADES * np.arange(n) / (n - 1))  # 1 ... 1e-7
    values = np.concatenate([-magnitudes, [0.0], magnitudes]) if signed else np.concatenate([[0.0], magnitudes])
    return np.sort(values)


def quantize(values, table, xp, lead: int = 0):
    """(codes uint8, absmax per block) of a 1-D array cut into blocks of BLOCK, its first element `lead` elements
    into its first block (the first and last blocks may be partial)."""
    blocked = _blocked(values, xp, lead)
    absmax = xp.abs(blocked).max(axis=1)
    return encode(values, absmax, table, xp, lead), absmax


def encode(values, absmax, table, xp, lead: int = 0):
    """The codes of values laid out as quantize's, given their blocks' absmax."""
    normalised = _blocked(values, xp, lead) / xp.where(absmax > 0, absmax, 1)[:, None]
    midpoints = (table[1:] + table[:-1]) / 2
    return xp.searchsorted(midpoints, normalised.ravel()[lead:lead + values.size]).astype(xp.uint8)


def dequantize(codes, absmax, table, lead: int = 0):
    xp = array_module(absmax)
    values = _blocked(table[codes].astype(absmax.dtype, copy=False), xp, lead) * absmax[:, None]
    return values.ravel()[lead:lead + codes.size]


def _blocked(values, xp, lead: int):
    """values placed `lead` elements into zero padding, as (blocks, BLOCK) rows."""
    return padded_blocks(values, xp, lead, BLOCK)


class Adam8bit:
    def __init__(self, segments, hyper, state_dtype=None, runs=None, exchange=None, placement=None):
        """runs: per segment, the tensors' stretches in it (blocks.segment_runs; default: each segment one tensor);
        exchange: the blocks.BlockExchange that gives a block shared with other runs its absmax over all of them
        (None: every run covers its blocks whole); placement: where the codes live (memory.offload: read and
        written a chunk at a time; the blocks' scales stay on the device)."""
        xp = array_module(segments[0].params)
        self.xp, self.segments, self.hyper = xp, segments, hyper
        self.dtype = state_dtype or segments[0].params.dtype
        self.bounds = segment_bounds(segments)
        self.runs = runs or [[Run(0, end - start, 0, end - start)] for start, end in self.bounds]
        self.exchange = exchange
        self.first_block = np.cumsum([0] + [block_count(held, BLOCK) for held in self.runs]).tolist()
        total = self.bounds[-1][1]
        self.tables = {"m": xp.asarray(quantization_map(True), dtype=self.dtype),
                       "v": xp.asarray(quantization_map(False), dtype=self.dtype)}
        zero_m = int(np.searchsorted(quantization_map(True), 0.0))
        self.placement = placement or OnDevice(xp)
        self.codes = {k: self.placement.zeros(f"adam8bit_{k}_code", total, np.uint8) for k in "mv"}
        self.codes["m"][...] = zero_m
        self.absmax = {k: xp.zeros(self.first_block[-1], dtype=self.dtype) for k in "mv"}
        self.steps_taken = 0
        self._checkpoint: dict = {}

    def state_arrays(self) -> list:
        return [self.codes["m"], self.codes["v"], self.absmax["m"], self.absmax["v"]]

    def state_nbytes(self) -> int:
        return int(sum(self.placement.resident_nbytes(a) for a in self.state_arrays()))

    def _chunks(self):
        """(segment index, flat [lo, hi) in the state arrays, the chunk's blocks, lead) of every chunk of at most
        CHUNK_BLOCKS blocks of one run, each starting on a block boundary except a run's first."""
        for index, ((start, _), held) in enumerate(zip(self.bounds, self.runs)):
            block = self.first_block[index]
            for run in held:
                a = 0
                while a < run.size:
                    lead = (run.first + a) % BLOCK
                    b = min(run.size, a + CHUNK_BLOCKS * BLOCK - lead)
                    count = blocks_spanned(b - a, lead, BLOCK)
                    yield index, start + run.start + a, start + run.start + b, slice(block, block + count), lead
                    block, a = block + count, b

    def _partial_blocks(self):
        """(segment, run, position in its blocks, index in the absmax arrays, flat [lo, hi), lead) of every block
        that a run covers in part."""
        for index, ((start, _), held) in enumerate(zip(self.bounds, self.runs)):
            block = self.first_block[index]
            for run in held:
                for position in run.partial_blocks(BLOCK):
                    a, b = run.block_elements(position, BLOCK)
                    yield index, run, position, block + position, start + run.start + a, start + run.start + b, \
                        (run.first + a) % BLOCK
                block += len(run.block_range(BLOCK))

    def _moments(self, g, lo: int, hi: int, blocks: slice, lead: int):
        """This step's m and rms (sqrt v) of the elements [lo, hi) from their stored codes and the gradient g."""
        h = self.hyper
        m = dequantize(self.placement.fetch(self.codes["m"], lo, hi), self.absmax["m"][blocks], self.tables["m"], lead)
        v = dequantize(self.placement.fetch(self.codes["v"], lo, hi), self.absmax["v"][blocks], self.tables["v"],
                       lead) ** 2  # stored: sqrt(v)
        m = h.beta1 * m + (1.0 - h.beta1) * g
        v = h.beta2 * v + (1.0 - h.beta2) * (g * g)
        return m, self.xp.sqrt(v)

    def _shared_absmax(self, grads) -> dict:
        """{absmax index: {"m": absmax, "v": absmax}} of the blocks runs cover in part, this step's over every
        holder (computed ahead of the update from the same moments, so no chunk is held in memory)."""
        if self.exchange is None:
            return {}
        xp, entries, shared = self.xp, {"m": [], "v": []}, {}
        for index, run, position, block, lo, hi, lead in self._partial_blocks():
            offset = self.bounds[index][0]
            m, rms = self._moments(grads(index)[lo - offset:hi - offset], lo, hi, slice(block, block + 1), lead)
            shared[block] = {"m": xp.abs(m).max(keepdims=True), "v": rms.max(keepdims=True)}
            for k in "mv":
                entries[k].append((run, position, shared[block][k]))
        for k in "mv":
            self.exchange.share(xp, self.dtype, entries[k])
        return shared

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        self.steps_taken += 1
        h, t, xp = self.hyper, self.steps_taken, self.xp
        bias1, bias2 = 1.0 - h.beta1 ** t, math.sqrt(1.0 - h.beta2 ** t)
        cache = {}  # the current segment's gradient as the update sees it (one segment's transient at a time)

        def grads(index):
            if index not in cache:
                cache.clear()
                cache[index] = scaled_grad(self.segments[index], self.dtype, grad_scale)
            return cache[index]

        shared = self._shared_absmax(grads)  # before any code or decay changes
        for segment in self.segments:
            decay(segment, lr, h.weight_decay)
        for index, lo, hi, blocks, lead in self._chunks():
            offset = self.bounds[index][0]
            m, rms = self._moments(grads(index)[lo - offset:hi - offset], lo, hi, blocks, lead)
            self.segments[index].params[lo - offset:hi - offset] -= (lr / bias1) * m / (rms / bias2 + h.eps)
            for k, values in (("m", m), ("v", rms)):
                absmax = _blocked(values, xp, lead)
                absmax = xp.abs(absmax).max(axis=1)
                for block in range(blocks.start, blocks.stop):
                    if block in shared:  # its absmax over every holder
                        absmax[block - blocks.start] = shared[block][k][0]
                self.placement.store(self.codes[k], lo, hi, encode(values, absmax, self.tables[k], xp, lead))
                self.absmax[k][blocks] = absmax

    # -- checkpoints: the codes and each element's block scale, element-wise
    def _expanded_absmax(self, which: str):
        out = self.xp.zeros(self.bounds[-1][1], dtype=self.dtype)  # padding (in no run): 0
        for _, lo, hi, blocks, lead in self._chunks():
            out[lo:hi] = self.xp.repeat(self.absmax[which][blocks], BLOCK)[lead:lead + hi - lo]
        return out

    def checkpoint_arrays(self) -> dict:
        self._checkpoint = {"adam8bit_m_code": self.codes["m"], "adam8bit_v_code": self.codes["v"],
                            "adam8bit_m_absmax": self._expanded_absmax("m"),
                            "adam8bit_v_absmax": self._expanded_absmax("v")}
        return self._checkpoint

    def after_restore(self) -> None:
        """The codes were loaded in place; take each block's scale from its elements' (restored into the same
        blocks: bitwise), requantizing the blocks whose elements came from different saved blocks (a checkpoint of
        an older run, whose blocks followed its segments)."""
        xp = self.xp
        for _, lo, hi, blocks, lead in self._chunks():
            for k in "mv":
                saved = self._checkpoint[f"adam8bit_{k}_absmax"][lo:hi]
                per_block = block_values(saved, lead, BLOCK, xp)
                if per_block is not None:
                    self.absmax[k][blocks] = per_block
                else:
                    values = self.tables[k][self.placement.fetch(self.codes[k], lo, hi)] * saved
                    codes, self.absmax[k][blocks] = quantize(values, self.tables[k], xp, lead)
                    self.placement.store(self.codes[k], lo, hi, codes)
        self._share_restored_blocks()
        self._checkpoint = {}

    def _share_restored_blocks(self) -> None:
        """Blocks runs cover in part, requantized on restore from other blocks, take their absmax over every
        holder (restored into the same blocks, every holder already has it: nothing changes)."""
        if self.exchange is None:
            return
        xp, found = self.xp, list(self._partial_blocks())
        for k in "mv":
            values = {block: dequantize(self.placement.fetch(self.codes[k], lo, hi), self.absmax[k][block:block + 1],
                                        self.tables[k], lead) for _, _, _, block, lo, hi, lead in found}
            absmax = {block: self.absmax[k][block:block + 1].copy() for _, _, _, block, _, _, _ in found}
            self.exchange.share(xp, self.dtype, [(run, position, absmax[block]) for _, run, position, block, _, _, _
                                                 in found])
            for _, _, _, block, lo, hi, lead in found:
                if bool(absmax[block][0] != self.absmax[k][block]):
                    self.absmax[k][block:block + 1] = absmax[block]
                    self.placement.store(self.codes[k], lo, hi, encode(values[block], absmax[block], self.tables[k],
                                                                        xp, lead))
