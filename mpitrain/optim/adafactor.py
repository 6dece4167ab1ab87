"""Adafactor (Shazeer & Stern 2018) with the paper's standard options and relative step sizes off: the learning
rate is our schedule's, weight decay is decoupled as in our AdamW.

    beta2_t = 1 - t^decay_rate (-0.8);  u = g^2 + eps1 (1e-30)
    matrix (rows x cols):  r <- beta2_t r + (1 - beta2_t) mean_cols(u);  c <- beta2_t c + (1 - beta2_t) mean_rows(u)
                           U = g / sqrt(outer(r, c) / mean(r))
    anything else:         v <- beta2_t v + (1 - beta2_t) u;  U = g / sqrt(v)
    per tensor:            U <- U / max(1, rms(U) / d)          (update clipping, d = clip_threshold = 1)
    beta1 > 0:             m <- beta1 m + (1 - beta1) U;  U = m / (1 - beta1^t)  (the paper's optional first moment)
    p <- p (1 - lr wd) - lr U

The first moment is what makes it train as well as AdamW here, and it is stored in 4 bits (momentum = "int4",
optim.adafactor_momentum's default; quant4.py: each tensor's blocks of 128, stochastic rounding drawn per (step,
tensor, element), so the same in every layout; the update is the stored m), so
the state stays about half a byte per parameter; "full" keeps m in the state dtype (4 bytes per parameter in fp32).
Without m the quickstart trained 22% worse than AdamW (500 steps), and so did AdamW itself with beta1 ~ 0: it is the
missing average, not the factoring. An exponential average lets the step grow (1 + beta1) / (1 - beta1) = 19 times
before the sharpest directions turn unstable; without it the schedule's peak LR is past that edge, and a lower LR
slows everything else (README, Lean optimizers). Unlike the Hugging Face and optax versions we debias m as Adam
does: they start from a relative-step warmup, our schedule warms up in a few steps, and an undebiased m moves the
first ~10 steps at 0.1 .. 0.65 of the step (30 steps of the tiny model: val loss 4.38 against AdamW's 3.94;
debiased 3.95).

Factoring and clipping need whole tensors. A tensor is whole where the segment holds the whole of it (every tensor
under plain data parallelism; under tensor parallelism "the tensor" is this rank's block, so its statistics are of
the block and the run differs from tp = 1). A tensor cut by a segment boundary falls back to the unfactored
(element-wise) second moment and its update is clipped by the rms of its piece; the run then depends on the layout,
so ZeRO over several ranks is refused for Adafactor (factory.refuse_cut_tensors). `matrices` names the factored
tensors: per segment, (start, end, rows, cols) in segment coordinates; `tensors` the whole ones, (start, end) (see
factory.segment_tensors); without `tensors` each segment clips as one piece.

Checkpoints hold element-wise kinds: each element's row statistic, its column statistic, its second moment (the
factored estimate for factored matrices) and, with beta1 > 0, its first moment (int4: each element's code and block
scale; restored into other blocks, requantized to nearest), so any layout can be restored; into the same layout,
bitwise.
"""
from __future__ import annotations

from mpitrain.backend import array_module
from mpitrain.optim import quant4
from mpitrain.optim.blocks import Run, block_count
from mpitrain.optim.common import decay, scaled_grad, segment_bounds

MOMENTUM_STORAGE = ("int4", "full")


class Adafactor:
    def __init__(self, segments, matrices: list[list[tuple[int, int, int, int]]], weight_decay: float = 0.0,
                 beta1: float = 0.9, decay_rate: float = -0.8, eps1: float = 1e-30, clip_threshold: float = 1.0,
                 tensors: list[list[tuple[int, int]]] | None = None, state_dtype=None, momentum: str = "full",
                 runs=None):
        """runs (int4 momentum): per segment, the tensors in it, whose own blocks quant4 uses (blocks.segment_runs;
        default: each segment one tensor)."""
        xp = array_module(segments[0].params)
        self.xp, self.segments, self.matrices = xp, segments, matrices
        self.weight_decay, self.beta1, self.decay_rate, self.eps1, self.clip_threshold = weight_decay, beta1, \
            decay_rate, eps1, clip_threshold
        if momentum not in MOMENTUM_STORAGE:
            raise ValueError(f"optim.adafactor_momentum = {momentum!r}: expected one of {', '.join(MOMENTUM_STORAGE)}")
        self.momentum = momentum
        self.dtype = state_dtype or segments[0].params.dtype
        self.bounds = segment_bounds(segments)
        # per segment: the ranges clipped as one (whole tensors, and the pieces of cut ones)
        whole = tensors or [[] for _ in segments]
        self.clip_ranges = [sorted(ranges + complement(ranges, end - start))
                            for ranges, (start, end) in zip(whole, self.bounds)]
        self.m = xp.zeros(self.bounds[-1][1], dtype=self.dtype) if beta1 and momentum == "full" else None
        # int4: per segment, the first moment's packed codes (0x88: both zero) and block scales (quant4.py)
        self.m_codes = [xp.full(quant4.packed_size(end - start), 0x88, dtype=xp.uint8)
                        for start, end in self.bounds] if beta1 and momentum == "int4" else None
        self.runs = runs or [[Run(0, end - start, 0, end - start, index)] for index, (start, end) in
                             enumerate(self.bounds)]
        self.m_scales = [xp.zeros(block_count(held, quant4.BLOCK), dtype=self.dtype)
                         for held in self.runs] if self.m_codes else None
        # per segment: the element-wise v over what no factored matrix covers; rows/cols per matrix
        self.unfactored = [complement([(a, b) for a, b, _, _ in mats], end - start)
                           for mats, (start, end) in zip(matrices, self.bounds)]
        self.v = xp.zeros(sum(b - a for ranges in self.unfactored for a, b in ranges), dtype=self.dtype)
        self.rows = [[xp.zeros(r, dtype=self.dtype) for _, _, r, _ in mats] for mats in matrices]
        self.cols = [[xp.zeros(c, dtype=self.dtype) for _, _, _, c in mats] for mats in matrices]
        self.steps_taken = 0
        self._checkpoint: dict = {}

    def state_arrays(self) -> list:
        return [self.v] + [a for group in self.rows + self.cols for a in group] + ([] if self.m is None else [self.m]) \
            + (self.m_codes + self.m_scales if self.m_codes else [])

    def state_nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.state_arrays()))

    def _v_pieces(self):
        """(segment index, start, end, view of v) for every unfactored range."""
        position = 0
        for index, ranges in enumerate(self.unfactored):
            for a, b in ranges:
                yield index, a, b, self.v[position:position + b - a]
                position += b - a

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        self.steps_taken += 1
        xp, beta2 = self.xp, 1.0 - self.steps_taken ** self.decay_rate
        updates = [None] * len(self.segments)
        for index, segment in enumerate(self.segments):
            g = scaled_grad(segment, self.dtype, grad_scale)
            update = xp.empty_like(g)
            for (a, b, rows, cols), r, c in zip(self.matrices[index], self.rows[index], self.cols[index]):
                gm = g[a:b].reshape(rows, cols)
                u = gm * gm + self.eps1
                r *= beta2
                r += (1.0 - beta2) * u.mean(axis=1)
                c *= beta2
                c += (1.0 - beta2) * u.mean(axis=0)
                update[a:b] = (gm / xp.sqrt(xp.outer(r / r.mean(), c))).ravel()
            updates[index] = (g, update)
        for index, a, b, v in self._v_pieces():
            g, update = updates[index]
            v *= beta2
            v += (1.0 - beta2) * (g[a:b] * g[a:b] + self.eps1)
            update[a:b] = g[a:b] / xp.sqrt(v)
        for index, (segment, (_, update)) in enumerate(zip(self.segments, updates)):
            if self.clip_threshold:
                for a, b in self.clip_ranges[index]:
                    piece = update[a:b]
                    piece /= max(1.0, float(xp.sqrt((piece * piece).mean())) / self.clip_threshold)
            if self.m is not None:
                start, end = self.bounds[index]
                m = self.m[start:end]
                m *= self.beta1
                m += (1.0 - self.beta1) * update
                update = m / (1.0 - self.beta1 ** self.steps_taken)  # debiased, as Adam (see above)
            elif self.m_codes:
                update = self._int4_momentum(index, update)
            decay(segment, lr, self.weight_decay)
            segment.params -= lr * update

    def _run_blocks(self, index: int):
        """(run, its blocks in the segment's int4 scales) of segment `index`."""
        block = 0
        for run in self.runs[index]:
            count = len(run.block_range(quant4.BLOCK))
            yield run, slice(block, block + count)
            block += count

    def _int4_momentum(self, index: int, update):
        """The moment's step in full precision, stored back with stochastic rounding (quant4.py); the update is the
        stored moment. The draws are a function of (step, tensor, element), so every layout and a resumed run draw
        the same ones."""
        xp, scales = self.xp, self.m_scales[index]
        codes = quant4.unpack(self.m_codes[index], self.bounds[index][1] - self.bounds[index][0], xp)
        out = xp.zeros_like(update)  # elements in no tensor (padding) stay 0
        for run, blocks in self._run_blocks(index):
            part = slice(run.start, run.end)
            m = quant4.dequantize(codes[part], scales[blocks], xp, run.first)
            m *= self.beta1
            m += (1.0 - self.beta1) * update[part]
            codes[part], scales[blocks] = quant4.quantize(m, xp, seed=(self.steps_taken << 32) | run.key,
                                                          first=run.first)
            out[part] = quant4.dequantize(codes[part], scales[blocks], xp, run.first)
        self.m_codes[index][...] = quant4.pack(codes, xp)
        return out / (1.0 - self.beta1 ** self.steps_taken)

    # -- checkpoints
    def checkpoint_arrays(self) -> dict:
        xp, total = self.xp, self.bounds[-1][1]
        row, col, v = (xp.zeros(total, dtype=self.dtype) for _ in range(3))
        for index, (start, _) in enumerate(self.bounds):
            for (a, b, rows, cols), r, c in zip(self.matrices[index], self.rows[index], self.cols[index]):
                row[start + a:start + b] = xp.repeat(r, cols)
                col[start + a:start + b] = xp.tile(c, rows)
                mean = r.mean()
                v[start + a:start + b] = (xp.outer(r / mean, c) if mean > 0 else xp.zeros((rows, cols))).ravel()
        for index, a, b, piece in self._v_pieces():
            start = self.bounds[index][0]
            v[start + a:start + b] = piece
        self._checkpoint = {"adafactor_row": row, "adafactor_col": col, "adafactor_v": v}
        if self.m is not None:
            self._checkpoint["adafactor_m"] = self.m.copy()
        if self.m_codes:  # int4: each element's code (unpacked) and block scale
            codes, scales = xp.zeros(total, dtype=xp.uint8), xp.zeros(total, dtype=self.dtype)
            for index, (start, end) in enumerate(self.bounds):
                codes[start:end] = quant4.unpack(self.m_codes[index], end - start, xp)
                for run, blocks in self._run_blocks(index):
                    scales[start + run.start:start + run.end] = quant4.expand_scales(
                        self.m_scales[index][blocks], run.size, xp, run.first)
            self._checkpoint.update(adafactor_m4_code=codes, adafactor_m4_scale=scales)
        return self._checkpoint

    def after_restore(self) -> None:
        """Factored matrices take their statistics from the saved row/column values, or, where those are zero (the
        checkpoint had this tensor unfactored), from the saved second moment's row and column means."""
        saved = self._checkpoint
        for index, (start, _) in enumerate(self.bounds):
            for (a, b, rows, cols), r, c in zip(self.matrices[index], self.rows[index], self.cols[index]):
                row = saved["adafactor_row"][start + a:start + b].reshape(rows, cols)
                col = saved["adafactor_col"][start + a:start + b].reshape(rows, cols)
                if bool((row != 0).any()):
                    r[...], c[...] = row[:, 0], col[0, :]
                else:
                    v = saved["adafactor_v"][start + a:start + b].reshape(rows, cols)
                    r[...], c[...] = v.mean(axis=1), v.mean(axis=0)
        for index, a, b, piece in self._v_pieces():
            start = self.bounds[index][0]
            piece[...] = saved["adafactor_v"][start + a:start + b]
        if self.m is not None:
            self.m[...] = saved["adafactor_m"]
        if self.m_codes:
            for index, (start, end) in enumerate(self.bounds):
                codes = saved["adafactor_m4_code"][start:end].copy()
                for run, blocks in self._run_blocks(index):
                    part = slice(start + run.start, start + run.end)
                    codes[run.start:run.end], self.m_scales[index][blocks] = quant4.scales_from_elements(
                        saved["adafactor_m4_scale"][part], saved["adafactor_m4_code"][part], self.xp, run.first)
                self.m_codes[index][...] = quant4.pack(codes, self.xp)
        self._checkpoint = {}


def complement(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The parts of [0, size) outside the sorted, disjoint ranges."""
    out, position = [], 0
    for a, b in sorted(ranges):
        if a > position:
            out.append((position, a))
        position = b
    if position < size:
        out.append((position, size))
    return out
