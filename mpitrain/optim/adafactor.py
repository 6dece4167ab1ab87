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
slows everything else (docs/memory.md, Lean optimizers). Unlike the Hugging Face and optax versions we debias m as Adam
does: they start from a relative-step warmup, our schedule warms up in a few steps, and an undebiased m moves the
first ~10 steps at 0.1 .. 0.65 of the step (30 steps of the tiny model: val loss 4.38 against AdamW's 3.94;
debiased 3.95).

Every layout is the one-process run. A rank may hold only a piece of a tensor (a ZeRO shard's flat slice, which may
start and end mid-row; a tensor-parallel box; its experts of a stacked expert tensor): the row and column statistics
of a matrix are sums over its columns and rows, so each rank adds its piece's partial row and column sums into the
matrix's whole-size row and column vectors, and one all-reduce over the groups holding the other pieces completes them
(optim/exchange.py); the update clipping's mean square is the sum of squares over the tensor, combined the same way;
the int4 blocks are each tensor's own, a block shared with other pieces taking its scale over all of them
(optim/blocks.py). A rank keeps the whole row and column vectors of each matrix it holds a piece of (rows + cols per
matrix, replicated over its holders: small beside the matrix), the element-wise second moment of its pieces of
anything else.

Checkpoints hold element-wise kinds: each element's row statistic, its column statistic, its second moment (the
factored estimate for factored matrices) and, with beta1 > 0, its first moment (int4: each element's code and block
scale; restored into other blocks, requantized to nearest), so any layout can be restored: a matrix's whole row and
column vectors come back from every holder's pieces (a max over them: each element carries its row's and column's
value), so a restore is bitwise in any layout whose blocks are the tensor's (every layout now).
"""
from __future__ import annotations

from itertools import pairwise

import numpy as np

from mpitrain.backend import array_module
from mpitrain.optim import quant4
from mpitrain.optim.blocks import BlockExchange, block_count, blocks_spanned, padded_blocks, segment_runs
from mpitrain.optim.common import decay, scaled_grad, segment_bounds
from mpitrain.optim.exchange import TensorExchange, factored, segment_pieces
from mpitrain.state.offload import OnDevice
from mpitrain.state.params import FlatBuffer, ParamSpec, UnitLayout
from mpitrain.state.strategy import ShardLayout

MOMENTUM_STORAGE = ("int4", "full")


def flat_layout(bounds: list[tuple[int, int]]) -> ShardLayout:
    """Each segment one vector of its own (what an optimizer handed bare segments treats them as)."""
    layouts = [UnitLayout(f"segment{i}", [ParamSpec("flat", (end - start,), "zeros")])
               for i, (start, end) in enumerate(bounds)]
    geometry = FlatBuffer.geometry(layouts)
    return ShardLayout(geometry, [geometry.unit_range(i) for i in range(len(layouts))])


def grid(piece) -> tuple[int, int, int, int, int]:
    """A factored piece laid on its box's rows: (lead: elements before it in its first row, the tensor's first row
    and column it covers, how many rows and columns of the tensor it spans (a vocabulary shard's padding past the
    tensor's end left out))."""
    cols = piece.box[1]
    lead, row = piece.first % cols, piece.first // cols
    r0, c0 = piece.corner[0] + row, piece.corner[1]
    rows = max(0, min(blocks_spanned(piece.size, lead, cols), piece.shape[0] - r0))
    return lead, r0, c0, rows, min(cols, piece.shape[1] - c0)


class Adafactor:
    def __init__(self, segments, layout: ShardLayout | None = None, weight_decay: float = 0.0, beta1: float = 0.9,
                 decay_rate: float = -0.8, eps1: float = 1e-30, clip_threshold: float = 1.0, state_dtype=None,
                 momentum: str = "full", tp=None, ep=None, placement=None):
        """layout: where the segments sit among the tensors (state.checkpoint_layout(); None: each segment one
        vector); tp, ep: the groups holding the other tp and ep pieces of split tensors (None: one rank);
        placement: where the element-wise state lives (memory.offload: read and written a segment at a time; the
        row, column and block statistics stay on the device)."""
        xp = array_module(segments[0].params)
        self.xp, self.segments = xp, segments
        self.weight_decay, self.beta1, self.decay_rate, self.eps1, self.clip_threshold = weight_decay, beta1, \
            decay_rate, eps1, clip_threshold
        if momentum not in MOMENTUM_STORAGE:
            raise ValueError(f"optim.adafactor_momentum = {momentum!r}: expected one of {', '.join(MOMENTUM_STORAGE)}")
        self.momentum = momentum
        self.dtype = state_dtype or segments[0].params.dtype
        self.bounds = segment_bounds(segments)
        layout = layout or flat_layout(self.bounds)
        self.pieces = segment_pieces(layout)
        self.statistics = TensorExchange(layout, lambda shape: sum(shape) if factored(shape) else 0, tp, ep)
        self.clipping = TensorExchange(layout, lambda shape: 1, tp, ep)
        held = {piece.tensor: piece.shape for pieces in self.pieces for piece in pieces if factored(piece.shape)}
        self.rows = {tensor: xp.zeros(shape[0], dtype=self.dtype) for tensor, shape in held.items()}
        self.cols = {tensor: xp.zeros(shape[1], dtype=self.dtype) for tensor, shape in held.items()}
        # per segment: the element-wise v over the pieces of tensors that are no matrix
        self.unfactored = [[(p.start, p.end) for p in pieces if not factored(p.shape)] for pieces in self.pieces]
        self.placement = placement = placement or OnDevice(xp)
        self.v = placement.zeros("adafactor_v", sum(b - a for ranges in self.unfactored for a, b in ranges), self.dtype)
        self.m = placement.zeros("adafactor_m", self.bounds[-1][1], self.dtype) if beta1 and momentum == "full" \
            else None
        # int4: the first moment's packed codes (0x88: both zero), segment after segment, and block scales (quant4.py)
        packed = np.cumsum([0] + [quant4.packed_size(end - start) for start, end in self.bounds]).tolist()
        self.code_bounds = list(pairwise(packed))
        self.m_codes = placement.zeros("adafactor_m4_code", self.code_bounds[-1][1], np.uint8) \
            if beta1 and momentum == "int4" else None
        if self.m_codes is not None:
            self.m_codes[...] = 0x88
        self.runs = segment_runs(layout)
        int4 = self.m_codes is not None
        self.blocks = BlockExchange(layout, quant4.BLOCK, tp, ep) if int4 else None
        self.m_scales = [xp.zeros(block_count(held, quant4.BLOCK), dtype=self.dtype)
                         for held in self.runs] if int4 else None
        self.steps_taken = 0
        self._checkpoint: dict = {}

    def state_arrays(self) -> list:
        return [self.v, *self.rows.values(), *self.cols.values()] + ([] if self.m is None else [self.m]) \
            + ([] if self.m_codes is None else [self.m_codes, *self.m_scales])

    def state_nbytes(self) -> int:
        return int(sum(self.placement.resident_nbytes(a) for a in self.state_arrays()))

    def _v_pieces(self):
        """(segment index, start, end, [start, end) in v) for every unfactored range."""
        position = 0
        for index, ranges in enumerate(self.unfactored):
            for a, b in ranges:
                yield index, a, b, (position, position + b - a)
                position += b - a

    def _codes(self, index: int):
        """Segment `index`'s int4 codes, unpacked (one per element)."""
        lo, hi = self.code_bounds[index]
        return quant4.unpack(self.placement.fetch(self.m_codes, lo, hi), self.bounds[index][1] - self.bounds[index][0],
                             self.xp)

    def _factored(self):
        """(segment index, piece) of every piece of a matrix."""
        for index, pieces in enumerate(self.pieces):
            for piece in pieces:
                if factored(piece.shape):
                    yield index, piece

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        self.steps_taken += 1
        xp, beta2 = self.xp, 1.0 - self.steps_taken ** self.decay_rate
        grads = [scaled_grad(segment, self.dtype, grad_scale) for segment in self.segments]
        self._statistics(grads, beta2)
        updates = [xp.zeros_like(g) for g in grads]  # padding (in no piece) stays 0
        for index, piece in self._factored():
            updates[index][piece.start:piece.end] = self._factored_update(piece, grads[index][piece.start:piece.end])
        for index, a, b, (lo, hi) in self._v_pieces():
            g, v = grads[index][a:b], self.placement.fetch(self.v, lo, hi)
            v *= beta2
            v += (1.0 - beta2) * (g * g + self.eps1)
            updates[index][a:b] = g / xp.sqrt(v)
            self.placement.store(self.v, lo, hi, v)
        if self.clip_threshold:
            self._clip(updates)
        if self.m_codes is not None:
            updates = self._int4_momentum(updates)
        for index, (segment, update) in enumerate(zip(self.segments, updates)):
            if self.m is not None:
                start, end = self.bounds[index]
                m = self.placement.fetch(self.m, start, end)
                m *= self.beta1
                m += (1.0 - self.beta1) * update
                self.placement.store(self.m, start, end, m)
                update = m / (1.0 - self.beta1 ** self.steps_taken)  # debiased, as Adam (see above)
            decay(segment, lr, self.weight_decay)
            segment.params -= lr * update

    def _statistics(self, grads, beta2: float) -> None:
        """Every held matrix's rows <- beta2 rows + (1 - beta2) mean over its columns of g^2 + eps1, and its columns
        likewise: each piece's partial sums, added over the pieces' holders."""
        xp, sums = self.xp, self.statistics.buffers(self.xp, self.dtype)
        for index, piece in self._factored():
            lead, r0, c0, rows, cols = grid(piece)
            g = grads[index][piece.start:piece.end]
            u = padded_blocks(g * g + self.eps1, xp, lead, piece.box[1])[:rows, :cols]  # the padding adds 0
            slots = self.statistics.view(sums, piece.tensor)
            slots[r0:r0 + rows] += u.sum(axis=1)
            slots[piece.shape[0] + c0:piece.shape[0] + c0 + cols] += u.sum(axis=0)
        self.statistics.reduce(sums)
        for tensor, r in self.rows.items():
            c, slots = self.cols[tensor], self.statistics.view(sums, tensor)
            r *= beta2
            r += (1.0 - beta2) * (slots[:r.size] / c.size)
            c *= beta2
            c += (1.0 - beta2) * (slots[r.size:] / r.size)

    def _factored_update(self, piece, g):
        """g / sqrt(outer(r / mean(r), c)) over the piece's elements."""
        xp = self.xp
        lead, r0, c0, rows, cols = grid(piece)
        r, c = self.rows[piece.tensor], self.cols[piece.tensor]
        padded = padded_blocks(g, xp, lead, piece.box[1])
        out = xp.zeros_like(padded)
        out[:rows, :cols] = padded[:rows, :cols] / xp.sqrt(xp.outer(r[r0:r0 + rows] / r.mean(), c[c0:c0 + cols]))
        return out.ravel()[lead:lead + piece.size]

    def _clip(self, updates) -> None:
        """Each tensor's update divided by max(1, rms / clip_threshold), its mean square over the whole tensor."""
        xp, sums = self.xp, self.clipping.buffers(self.xp, self.dtype)
        for index, pieces in enumerate(self.pieces):
            for piece in pieces:
                u = updates[index][piece.start:piece.end]
                self.clipping.view(sums, piece.tensor)[0] += (u * u).sum()
        self.clipping.reduce(sums)
        for index, pieces in enumerate(self.pieces):
            for piece in pieces:
                rms = float(xp.sqrt(self.clipping.view(sums, piece.tensor)[0] / piece.count))
                updates[index][piece.start:piece.end] /= max(1.0, rms / self.clip_threshold)

    def _run_blocks(self, index: int):
        """(run, its blocks in the segment's int4 scales) of segment `index`."""
        block = 0
        for run in self.runs[index]:
            count = len(run.block_range(quant4.BLOCK))
            yield run, slice(block, block + count)
            block += count

    def _int4_momentum(self, updates) -> list:
        """The moment's step in full precision, stored back with stochastic rounding (quant4.py); the update is the
        stored moment. The draws are a function of (step, tensor, element), so every layout and a resumed run draw
        the same ones; a block shared with other runs takes its scale over all of them first."""
        xp, moments, shared = self.xp, [], []
        for index, update in enumerate(updates):
            scales = self.m_scales[index]
            codes = self._codes(index)
            for run, blocks in self._run_blocks(index):
                part = slice(run.start, run.end)
                m = quant4.dequantize(codes[part], scales[blocks], xp, run.first)
                m *= self.beta1
                m += (1.0 - self.beta1) * update[part]
                scale = quant4.block_scales(m, xp, run.first)
                moments.append((index, run, blocks, m, scale))
                shared += [(run, position, scale[position:position + 1])
                           for position in run.partial_blocks(quant4.BLOCK)]
        self.blocks.share(xp, self.dtype, shared)
        out = [xp.zeros_like(update) for update in updates]  # elements in no tensor (padding) stay 0
        codes = [xp.full(update.size, 8, dtype=xp.uint8) for update in updates]  # elements in no run: code 0 (8)
        for index, run, blocks, m, scale in moments:
            part = slice(run.start, run.end)
            codes[index][part], self.m_scales[index][blocks] = quant4.quantize(
                m, xp, seed=(self.steps_taken << 32) | run.key, first=run.first, scale=scale)
            out[index][part] = quant4.dequantize(codes[index][part], scale, xp, run.first)
        for index, (lo, hi) in enumerate(self.code_bounds):
            self.placement.store(self.m_codes, lo, hi, quant4.pack(codes[index], xp))
        return [o / (1.0 - self.beta1 ** self.steps_taken) for o in out]

    # -- checkpoints
    def _on_piece(self, piece, values):
        """A (rows x cols) grid of the piece's part of its matrix (grid()) as the piece's flat elements."""
        lead, _, _, rows, cols = grid(piece)
        out = padded_blocks(self.xp.zeros(piece.size, dtype=self.dtype), self.xp, lead, piece.box[1])
        out[:rows, :cols] = values
        return out.ravel()[lead:lead + piece.size]

    def checkpoint_arrays(self) -> dict:
        xp, total = self.xp, self.bounds[-1][1]
        row, col, v = (xp.zeros(total, dtype=self.dtype) for _ in range(3))
        for index, piece in self._factored():
            _, r0, c0, rows, cols = grid(piece)
            r, c = self.rows[piece.tensor], self.cols[piece.tensor]
            mine_r, mine_c, mean = r[r0:r0 + rows], c[c0:c0 + cols], r.mean()
            part = slice(self.bounds[index][0] + piece.start, self.bounds[index][0] + piece.end)
            row[part] = self._on_piece(piece, xp.broadcast_to(mine_r[:, None], (rows, cols)))
            col[part] = self._on_piece(piece, xp.broadcast_to(mine_c[None, :], (rows, cols)))
            v[part] = self._on_piece(piece, xp.outer(mine_r / mean, mine_c) if mean > 0 else 0.0)
        for index, a, b, (lo, hi) in self._v_pieces():
            start = self.bounds[index][0]
            v[start + a:start + b] = self.placement.fetch(self.v, lo, hi)
        self._checkpoint = {"adafactor_row": row, "adafactor_col": col, "adafactor_v": v}
        if self.m is not None:
            self._checkpoint["adafactor_m"] = self.placement.fetch(self.m, 0, self.m.size).copy()
        if self.m_codes is not None:  # int4: each element's code (unpacked) and block scale
            codes, scales = xp.zeros(total, dtype=xp.uint8), xp.zeros(total, dtype=self.dtype)
            for index, (start, end) in enumerate(self.bounds):
                codes[start:end] = self._codes(index)
                for run, blocks in self._run_blocks(index):
                    scales[start + run.start:start + run.end] = quant4.expand_scales(
                        self.m_scales[index][blocks], run.size, xp, run.first)
            self._checkpoint.update(adafactor_m4_code=codes, adafactor_m4_scale=scales)
        return self._checkpoint

    def _restored_statistics(self, saved, kind: str, op: str):
        """Per matrix slots (rows, then columns) from the saved element-wise `kind` of every holder's pieces: the
        values themselves (op max: every element of a row carries its row's) or their sums (op sum)."""
        xp, slots = self.xp, self.statistics.buffers(self.xp, self.dtype)
        for index, piece in self._factored():
            lead, r0, c0, rows, cols = grid(piece)
            start = self.bounds[index][0]
            values = padded_blocks(saved[kind][start + piece.start:start + piece.end], xp, lead,
                                   piece.box[1])[:rows, :cols]
            view, height = self.statistics.view(slots, piece.tensor), piece.shape[0]
            for target, part in ((view[r0:r0 + rows], values.sum(axis=1) if op == "sum" else values.max(axis=1)),
                                 (view[height + c0:height + c0 + cols],
                                  values.sum(axis=0) if op == "sum" else values.max(axis=0))):
                if op == "sum":
                    target += part
                else:
                    xp.maximum(target, part, out=target)
        self.statistics.reduce(slots, op)
        return slots

    def after_restore(self) -> None:
        """Factored matrices take their statistics from the saved row/column values, or, where those are zero (the
        checkpoint had this tensor unfactored), from the saved second moment's row and column means."""
        saved = self._checkpoint
        rows = self._restored_statistics(saved, "adafactor_row", "max")
        cols = self._restored_statistics(saved, "adafactor_col", "max")
        sums = self._restored_statistics(saved, "adafactor_v", "sum")
        for tensor, r in self.rows.items():
            c, height = self.cols[tensor], r.size
            row, col = self.statistics.view(rows, tensor), self.statistics.view(cols, tensor)
            if bool((row[:height] != 0).any()):
                r[...], c[...] = row[:height], col[height:]
            else:
                v = self.statistics.view(sums, tensor)
                r[...], c[...] = v[:height] / c.size, v[height:] / height
        for index, a, b, (lo, hi) in self._v_pieces():
            start = self.bounds[index][0]
            self.placement.store(self.v, lo, hi, saved["adafactor_v"][start + a:start + b])
        if self.m is not None:
            self.placement.store(self.m, 0, self.m.size, saved["adafactor_m"])
        if self.m_codes is not None:
            for index, (start, end) in enumerate(self.bounds):
                codes = saved["adafactor_m4_code"][start:end].copy()
                for run, blocks in self._run_blocks(index):
                    part = slice(start + run.start, start + run.end)
                    codes[run.start:run.end], self.m_scales[index][blocks] = quant4.scales_from_elements(
                        saved["adafactor_m4_scale"][part], saved["adafactor_m4_code"][part], self.xp, run.first)
                self.placement.store(self.m_codes, *self.code_bounds[index], quant4.pack(codes, self.xp))
        self._checkpoint = {}
