"""FP8 training recipes, emulated exactly: the values an FP8 GEMM would multiply, on numpy or CuPy arrays.

    recipe    scale of a tensor                                          what it is (docs/fp8.md)
    tensor    one per tensor, from this call's amax (current scaling)    TE's Float8CurrentScaling
    delayed   one per tensor, from the max of an amax history of the     TE's DelayedScaling (margin 0, "max")
              last H steps (DelayedScaling below)
    block     activations and output gradients: one per 1x128 tile       DeepSeek-V3
              along the reduction dim; weights: one per 128x128 block
    mxfp8     one per 1x32 block along the reduction dim, a power of     OCP MX v1.0 (MXFP8, e8m0 scales)
              two (e8m0) with the spec's rounding: 2^(floor(log2 amax) - emax of the element format)

Inputs and weights go to e4m3 (max 448) for the forward, output gradients to e5m2 (max 57344) for the backward.
Every cast clips to the format's max first: ml_dtypes' float8_e4m3fn (like the hardware's non-saturating cast) turns
an out-of-range value into NaN, not the max. A tensor, tile or block whose amax is 0 (or not finite) gets scale 1.

Scale conventions: per-tensor and block scales are float32 dequantization multipliers `scale_inv` (TE keeps both the
quantizing `scale = max / amax` and its inverse; codes = cast(clip(x * scale)), values = codes * scale_inv);
MX scales are powers of two stored as float8_e8m0fnu.
Device-generic: the rounding onto the fp8 grid is arithmetic (comm/quantized.py's fp8_round, bit for bit ml_dtypes'
cast, which rounds float64 through float32 as fp8_round's caller does). On numpy the codes and MX scales are then
cast (exactly) to ml_dtypes' fp8 / e8m0; CuPy has no such dtypes, so there codes are the float32 grid values and MX
scales float32 powers of two: the same numbers. On a GPU, cuBLASLt multiplies the codes (mpitrain/layers/fp8_lt.py;
mxfp8 stays this emulation). `Quantized.dequantize` gives codes * scale_inv: exact in float64 (and for MX's powers of
two); in float32 a non-power-of-two scale rounds each product once (2^-24 relative, where a tensor core applies the
scales to the fp32 sum instead), far below fp8's own 2^-4.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from mpitrain.backend import array_module
from mpitrain.comm.quantized import fp8_round
from mpitrain.layers.fp8_delayed import (  # noqa: F401 (end_delayed_step, the checkpoint state: imported from here)
    DelayedScaling,
    delayed_state,
    end_delayed_step,
    load_delayed_state,
)

FORMATS = {"e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "e5m2": np.dtype(ml_dtypes.float8_e5m2)}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
EMAX = {"e4m3": 8, "e5m2": 15}  # exponent of the format's largest power of two: 448 = 1.75 * 2^8, 57344 = 1.75 * 2^15
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
RECIPES = ("none", "tensor", "delayed", "block", "mxfp8")
TILE = 128  # block recipe: 1x128 tiles of activations and gradients, 128x128 blocks of weights
MX_BLOCK = 32  # mxfp8: 1x32 blocks
RECENT_SCALES = 16  # per-tensor scales kept per operand for the cuBLASLt route (micro-batches in flight)


@dataclass
class Quantized:
    """fp8 `codes` (the shape of the source) and their dequantization multipliers: `scale_inv` is a float32 scalar
    (per tensor), or a grid with one entry per block of `block` elements (a 1 in `block` spans a whole axis of a
    tile: (1, 128) = rows of 128 along the last axis), float32 or e8m0."""
    codes: np.ndarray
    scale_inv: np.ndarray
    block: tuple | None = None

    def dequantize(self, dtype=np.float32):
        """codes * scale_inv in `dtype` (float64: exact; float32: rounded once, see the module's docstring)."""
        values = self.codes.astype(dtype)
        if self.block is None:
            return values * self.scale_inv.astype(dtype)
        return values * expand_blocks(self.scale_inv.astype(dtype), self.block, values.shape)


def widened(x):
    """bfloat16/float16 -> float32 (a scale multiplies in fp32); float32/float64 unchanged."""
    return x.astype(np.float32) if x.dtype.itemsize < 4 else x


def cast_saturating(x, fmt: str):
    """x -> fp8 codes of format `fmt` ("e4m3" / "e5m2"), clipped to +-max first (round to nearest even); on CuPy the
    codes' values, float32. float64 rounds through float32, as ml_dtypes' cast does."""
    xp = array_module(x)
    top = FP8_MAX[fmt]
    grid = fp8_round(xp, xp.clip(x, -top, top).astype(np.float32), fmt)
    return grid.astype(FORMATS[fmt]) if xp is np else grid  # exact: grid values are fp8 values


def absmax(x) -> float:
    """The largest |x| as a Python float (0 for an empty array)."""
    return float(array_module(x).abs(x).max()) if x.size else 0.0


def tensor_scale(amax, fmt: str):
    """(scale, scale_inv), float32, of a per-tensor cast: scale = max / amax, 1 where amax (as float32) is 0 or not
    finite, float32's max where the division overflows (an amax below 448 / 3.4e38: TE's rule). `amax` may be an
    array (block grids): elementwise."""
    xp = array_module(amax)
    amax = xp.asarray(amax, dtype=np.float32)
    usable = xp.isfinite(amax) & (amax > 0)
    with np.errstate(over="ignore"):
        scale = xp.where(usable, np.float32(FP8_MAX[fmt]) / xp.where(usable, amax, 1), 1).astype(np.float32)
    scale = xp.minimum(scale, np.finfo(np.float32).max)
    return scale, (np.float32(1) / scale).astype(np.float32)


def quantize_tensor(x, fmt: str, amax: float | None = None) -> Quantized:
    """Per-tensor scaling: codes = cast(clip(x * scale)), scale from `amax` (default: this tensor's own, current
    scaling; a delayed recipe passes its history's max, a split tensor the max over its group)."""
    x = widened(x)
    scale, scale_inv = tensor_scale(absmax(x) if amax is None else amax, fmt)
    return Quantized(cast_saturating(x * x.dtype.type(scale), fmt), scale_inv)


def _blocked(x, block: tuple):
    """x (..., R, C) padded with zeros to whole blocks and viewed as (..., R/br, br, C/bc, bc); a 1 in `block`
    spans a whole axis (so (1, 128) tiles rows, reading a block of one element along rows)."""
    rows, cols = x.shape[-2], x.shape[-1]
    br, bc = _block_extent(block, rows, cols)
    pad_r, pad_c = -rows % br, -cols % bc
    if pad_r or pad_c:
        x = array_module(x).pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad_r), (0, pad_c)])
    r, c = x.shape[-2] // br, x.shape[-1] // bc
    return x.reshape(*x.shape[:-2], r, br, c, bc)


def _block_extent(block: tuple, rows: int, cols: int) -> tuple[int, int]:
    return max(1, min(block[0], rows)), max(1, min(block[1], cols))  # an empty array (an idle expert): one-wide


def block_amax(x, block: tuple):
    """The amax of each block of x's last two axes ((..., ceil(R/br), ceil(C/bc)); partial edge blocks count)."""
    return array_module(x).abs(_blocked(x, block)).max(axis=(-3, -1))  # blocks are at least 1x1: never empty


def expand_blocks(grid, block: tuple, shape: tuple):
    """A per-block grid -> one value per element of an array of `shape` (edge blocks cut to size)."""
    br, bc = _block_extent(block, shape[-2], shape[-1])
    xp = array_module(grid)
    full = xp.repeat(xp.repeat(grid, br, axis=-2), bc, axis=-1)
    return full[..., :shape[-2], :shape[-1]]


def as_matrix(x):
    """x (..., K) as rows (M, K): 1x128 tiles run along the last (reduction) axis of every row."""
    return x.reshape(-1, x.shape[-1])


def quantize_blocks(x, fmt: str, block: tuple = (1, TILE), amax=None) -> Quantized:
    """Block scaling (DeepSeek-V3): each block of x's last two axes gets scale_inv = amax / max, codes = cast(clip(x
    / scale_inv)). (1, 128): activation and gradient tiles along the last axis; (128, 128): weight blocks. `amax`:
    the block grid's amax when it was reduced over a group (default: x's own)."""
    x = widened(x)
    grid = block_amax(x, block) if amax is None else amax
    scale, scale_inv = tensor_scale(grid, fmt)
    codes = cast_saturating(x * expand_blocks(scale.astype(x.dtype), block, x.shape), fmt)
    return Quantized(codes, scale_inv, block)


def mx_scale(amax, fmt: str):
    """OCP MX v1.0 shared scale of blocks with these amaxes: 2^(floor(log2 amax) - emax), as float8_e8m0fnu (exponent
    clamped to e8m0's [-127, 127]); amax 0 (or not finite) -> 1. Elements above the format's max after the division
    (up to 2^(emax+1) - ...) are clipped, as the spec says. On CuPy (no e8m0 dtype): the powers as float32."""
    xp = array_module(amax)
    amax = xp.asarray(amax, dtype=np.float64)
    usable = xp.isfinite(amax) & (amax > 0)
    _, exponent = xp.frexp(xp.where(usable, amax, 1.0))  # amax = m 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
    power = xp.where(usable, xp.clip(exponent - 1 - EMAX[fmt], -127, 127), 0)
    powers = xp.ldexp(xp.ones_like(amax), power)
    return powers.astype(E8M0) if xp is np else powers.astype(np.float32)


def quantize_mx(x, fmt: str, axis: int = -1) -> Quantized:
    """MXFP8: blocks of 32 consecutive elements along `axis` (the reduction axis: -1 for activations and output
    gradients, -2 (= 0 for a (K, N) weight) for weights), each with an e8m0 power-of-two scale."""
    x = widened(x)
    block = (1, MX_BLOCK) if axis in (-1, x.ndim - 1) else (MX_BLOCK, 1)
    scale_inv = mx_scale(block_amax(x, block), fmt)
    divisor = expand_blocks(scale_inv.astype(x.dtype), block, x.shape)
    return Quantized(cast_saturating(x / divisor, fmt), scale_inv, block)


def on_host(a):
    """A CuPy array copied to the host; numpy arrays and scalars as they are."""
    return a if array_module(a) is np else a.get()


def operand_dtype(x):
    """The dtype a dequantized operand is held in: float64 under precision.compute = "float64", else float32 (an fp8
    value times a float32 scale is exact in float32, not in bfloat16)."""
    return np.float64 if x.dtype == np.float64 else np.float32


def check_block_alignment(recipe: str, width: int, group_size: int, what: str) -> None:
    """block/mxfp8 under tensor parallelism: a block must not cross a shard boundary, or each rank would scale a
    different block than one process does. Refused (one line naming the keys) unless the shard width of the split
    dimension is a whole number of blocks."""
    block = TILE if recipe == "block" else MX_BLOCK
    if group_size > 1 and width % block:
        from mpitrain.errors import ConfigError
        raise ConfigError(f"precision.fp8 = {recipe!r}: {what} is split {width} wide per rank over parallel.tp = "
                          f"{group_size}, not a multiple of the {block}-element scaling block; use a tp that keeps "
                          f"shards whole blocks, or precision.fp8 = 'tensor'")


class Fp8Gemms:
    """The FP8 emulation of one linear's GEMMs (or one MoE layer's expert GEMMs): its operands quantized by the
    recipe and handed back dequantized, so the caller's matmul multiplies exactly what an FP8 GEMM would:

        forward   y  = deq(q_e4m3(x)) @ deq(q_e4m3(W))
        backward  dx = deq(q_e5m2(dy)) @ deq(q_e4m3(W))^T      dW = deq(q_e4m3(x))^T @ deq(q_e5m2(dy))

    Per-tensor amaxes (tensor, delayed) are reduced (max) over `group`, the group the tensor is split over (tp, or
    an expert's etp): the amax of a split tensor is that of the whole. Activations and output gradients are also
    reduced over `token_group` (cp: each rank holds a slice of the micro-batch's sequence). Tiles and blocks never
    cross a shard (check_block_alignment), so block and mxfp8 scales need no reduction. Operands are quantized
    again where the backward needs them: the same inputs give the same codes (delayed scales change only between
    steps).
    `scales[key]`: (min, max) of each operand's scale_inv over every call so far (every micro-batch: the same
    whatever rank ran which), for checks and reports.
    `recording` False (scales_only: validation, a replay's peer check): calls use the current scales and record
    neither amaxes nor scales, so a run's training does not depend on how often it evaluates.
    `cache_weights` (set by apply_fp8 on frozen block / mxfp8 weights, LoRA's base): a weight is quantized once and
    its fp8 values kept, as a GPU run would keep the frozen base's fp8 copy; its scales depend on it alone."""

    def __init__(self, recipe: str, group=None, history: int = 16, name: str = "", token_group=None):
        self.recipe, self.group, self.history, self.name = recipe, group, history, name
        self.token_group = token_group if token_group is not None and token_group.size > 1 else None
        self.delayed: dict[str, DelayedScaling] = {}
        self.scales: dict[str, tuple[float, float]] = {}
        self.weight_elements: dict[str, int] = {}  # per weight: its elements (the tests count a cached base by it)
        self.data_group = "dp_cp"  # the mesh group of the ranks holding the same weights (experts: "expert_dp")
        self.recording = True  # training forwards record amaxes (delayed) and scales; scales_only turns it off
        self.cache_weights = False
        self.cached: dict[str, np.ndarray] = {}  # weight key -> its dequantized fp8 values (cache_weights)
        self.lt = None  # a kernels/fp8_gemm.Fp8Lt for host arrays (tests' fake binding); CuPy finds nvmath's itself
        self.recent_scales: dict[str, list] = {}  # per-tensor key -> its latest (scale, scale_inv), newest first
        self.amaxes: dict[str, float] = {}  # per-tensor key -> the amax its latest call scaled by (keep_input)

    @property
    def group_size(self) -> int:
        return self.group.size if self.group is not None else 1

    def inputs(self, keys, arrays, fmt: str = "e4m3", amaxes=None) -> list:
        """Activations (fmt e4m3) or output gradients (e5m2), (..., K): scaled along their last axis. `amaxes`
        (per-tensor recipes): scale by these, as an earlier call did (keep_input), instead of reducing new ones."""
        return self._operands(keys, arrays, fmt, weight=False, amaxes=amaxes)

    def keep_input(self, key: str):
        """What quantizing an input again to its latest call's values takes (selective recomputation keeps it): the
        amax that call scaled by under the per-tensor recipes (its all-reduce and history look-up are not repeated),
        None under block and mxfp8, whose scales come again from the same values."""
        return float(self.amaxes[key]) if self.recipe in ("tensor", "delayed") else None  # a float: no array to count

    def output_grads(self, keys, arrays) -> list:
        return self._operands(keys, arrays, "e5m2", weight=False)

    def weights(self, keys, arrays, split_axis: int) -> list:
        """Weights (K, N), e4m3, in 128x128 blocks / 32x1 MX blocks along K; `split_axis`: the axis split over the
        group (-1: output columns, column-parallel; -2: input rows, row-parallel)."""
        for key, w in zip(keys, arrays):
            self.weight_elements[key] = w.size
            if self.recipe in ("block", "mxfp8"):
                check_block_alignment(self.recipe, w.shape[split_axis], self.group_size, key)
        if not self.cache_weights:
            return self._operands(keys, arrays, "e4m3", weight=True)
        missing = [(key, w) for key, w in zip(keys, arrays) if key not in self.cached]
        if missing:  # a frozen weight's block scales come from itself alone: no collective, no history
            fresh = self._operands([key for key, _ in missing], [w for _, w in missing], "e4m3", weight=True)
            self.cached.update(zip([key for key, _ in missing], fresh))
        return [self.cached[key] for key in keys]

    def _operands(self, keys, arrays, fmt: str, weight: bool, amaxes=None) -> list:
        wide = [a.astype(operand_dtype(a), copy=False) for a in arrays]
        if self.recipe in ("tensor", "delayed"):
            if amaxes is None:
                amaxes = self._tensor_amaxes(keys, wide, weight)
            quantized = [quantize_tensor(a, fmt, amax) for a, amax in zip(wide, amaxes)]
            for key, amax in zip(keys, amaxes):
                self._remember_scale(key, tensor_scale(amax, fmt))
                self.amaxes[key] = amax
        elif self.recipe == "block":
            quantized = [quantize_blocks(a if weight else as_matrix(a), fmt, (TILE, TILE) if weight else (1, TILE))
                         for a in wide]
        else:
            quantized = [quantize_mx(a if weight else as_matrix(a), fmt, axis=-2 if weight else -1) for a in wide]
        out = []
        for key, a, q in zip(keys, wide, quantized):
            if self.recording:
                self._record(key, q, a if weight else as_matrix(a))
            out.append(q.dequantize(a.dtype).reshape(a.shape))
        return out

    def _remember_scale(self, key: str, scales) -> None:
        """Keep the latest distinct per-tensor scales of `key` (as many as micro-batches may be in flight): a
        cuBLASLt GEMM encodes its dequantized operand back to codes with the one that reproduces it (fp8_lt.py)."""
        recent = self.recent_scales.setdefault(key, [])
        if not recent or recent[0][1] != scales[1]:
            recent.insert(0, scales)
            del recent[RECENT_SCALES:]

    def _record(self, key: str, q: Quantized, source) -> None:
        """Widen scales[key] by this call's scale_inv. Blocks of rounding noise (amax below 2^-30 of the operand's
        largest, or 0: say the gradient of the first token's query, exactly 0 in theory) are left out: their scale
        follows the noise, which differs between layouts."""
        scale_inv = np.asarray(on_host(q.scale_inv), dtype=np.float64)  # a report: read on the host
        if q.block is not None and scale_inv.size:
            amax = on_host(block_amax(source, q.block))
            scale_inv = scale_inv[amax > amax.max() * 2.0 ** -30]
        if scale_inv.size:
            low, high = self.scales.get(key, (np.inf, -np.inf))
            self.scales[key] = (min(low, float(scale_inv.min())), max(high, float(scale_inv.max())))

    def _tensor_amaxes(self, keys, arrays, weight: bool) -> list[float]:
        """Each array's amax over the group (one all-reduce for all) and, for activations and output gradients,
        over the token group; under delayed scaling, its history's max."""
        amaxes = np.array([absmax(a) for a in arrays], dtype=np.float64)
        if self.group_size > 1:
            self.group.all_reduce(amaxes, "max")
        if not weight and self.token_group is not None:
            self.token_group.all_reduce(amaxes, "max")
        if self.recipe == "tensor":
            return list(amaxes)
        return [self._history(key).amax_for(float(amax), self.recording) for key, amax in zip(keys, amaxes)]

    def _history(self, key: str) -> DelayedScaling:
        if key not in self.delayed:
            self.delayed[key] = DelayedScaling(self.history)
        return self.delayed[key]


@contextmanager
def scales_only(gemms: list[Fp8Gemms]):
    """Forwards that are not training steps (validation, generation, a replay's check of a peer): they quantize with
    the current scales and record nothing, as Transformer Engine updates its amax histories in training forwards
    only. Otherwise a delayed run's training would depend on how often it evaluates."""
    for g in gemms:
        g.recording = False
    try:
        yield
    finally:
        for g in gemms:
            g.recording = True


def apply_fp8(units, recipe: str, history: int = 16, cp_group=None) -> list[Fp8Gemms]:
    """Put an Fp8Gemms on every block's attention projections (qkv, out) and MLP linears (or MoE experts), in place;
    embeddings, norms, the router and the head stay in the compute dtype. Returns them, in unit order (the order
    end_delayed_step reduces their amaxes in: the same on every rank of a stage). `cp_group`: the context-parallel
    group, over which activation and output-gradient amaxes are reduced (every expert runs, an empty block too, so
    each rank makes the same calls)."""
    if recipe == "none":
        return []
    gemms = []
    for unit in units:
        for sublayer in ("attention", "mlp"):
            layer = getattr(unit, sublayer, None)
            if layer is None:
                continue
            prefix = f"{unit.layout.name}.{sublayer}"
            if hasattr(layer, "expert_weights"):  # MoE: the experts' width is split over etp
                targets = [(layer, prefix, layer.ep.etp)]
            else:
                pair = ("qkv", "out") if sublayer == "attention" else ("up", "down")
                targets = [(getattr(layer, part), f"{prefix}.{part}", layer_tp_group(getattr(layer, part)))
                           for part in pair]
            for target, name, group in targets:
                target.fp8 = Fp8Gemms(recipe, group, history, name, cp_group)
                frozen = getattr(target, "frozen_experts", not getattr(target, "trainable", True))  # LoRA's base
                target.fp8.cache_weights = frozen and recipe in ("block", "mxfp8")
                if target is layer:  # experts: the same expert's copies lie across expert data parallelism
                    target.fp8.data_group = "expert_dp"
                gemms.append(target.fp8)
    return gemms


def layer_tp_group(linear):
    """The group a linear's weights are split over (None: one rank)."""
    return linear.tp.group if linear.tp.size > 1 else None


def scale_summary(gemms: list[Fp8Gemms]) -> dict[str, tuple[float, float]]:
    """'unit.sublayer.part.operand' -> (min, max) of its scale_inv over this rank's calls so far (merge min/max over
    the ranks to compare with one process: tp pieces and dp micro-batches differ)."""
    return {f"{g.name}.{key}": value for g in gemms for key, value in g.scales.items()}


# -- memory: what a run of a recipe holds beyond the compute-dtype model (mpitrain memory, plan/memory.py)


def fp8_linears(cfg) -> list[list[tuple[int, int]]]:
    """The FP8 linears that pipeline rank 0 (the most loaded stage: ceil(layers / pp)) holds on one tp rank, each the
    (K, N) shapes of the weights that share its input: qkv, out, the MLP's up (gate and up) and down, or per
    expert of this ep rank the same two."""
    from mpitrain.config_moe import MoeSettings
    m, p = cfg.model, cfg.parallel
    c, t, heads = m.d_model, p.tp, m.n_head * m.head_dim
    kv = m.kv_heads * m.head_dim // t if m.kv_heads % t == 0 else m.head_dim  # replicated K/V: one head's columns
    moe, ups = MoeSettings.of(m), 2 if m.arch == "llama" else 1
    linears = []
    for index in range(-(-m.n_layer // (p.pp * p.virtual_stages)) * p.virtual_stages):
        linears += [[(c, heads // t), (c, kv), (c, kv)], [(heads // t, c)]]
        width = m.ff_dim // ((p.etp or t) if moe.is_moe_block(index) else t)
        count = moe.experts // p.ep if moe.is_moe_block(index) else 1
        linears += [[(c, width)] * ups, [(width, c)]] * count
    return linears


def fp8_extra_bytes(cfg) -> dict[str, int]:
    """Bytes per rank an FP8 recipe keeps between steps (fp8_linears' operands): the per-tensor recipes' latest
    scales (RECENT_SCALES (scale, scale_inv) float32 pairs per operand key: each linear's input, each weight and its
    output gradient), delayed scaling's amax history (float32 x precision.fp8_history per key) and, under block and
    mxfp8, a frozen base's (LoRA) cached dequantized weights (float32, float64 under a float64 compute dtype). No fp8
    weight copy is kept otherwise: weights are quantized again in each forward and backward, and block and MX scales
    live and die with their call. The wider inputs that column-parallel linears save are activations
    (plan/memory.py fp8_saved_widening). Zeros for precision.fp8 = "none"."""
    recipe = cfg.precision.fp8
    if recipe == "none":
        return {"fp8_scales": 0, "amax_history": 0, "cached_weights": 0}
    linears = fp8_linears(cfg)
    keys = sum(1 + 2 * len(linear) for linear in linears)
    per_tensor = recipe in ("tensor", "delayed")
    cached = cfg.lora.rank > 0 and not per_tensor  # Fp8Gemms.cache_weights, as apply_fp8 sets it
    width = 8 if cfg.precision.compute == "float64" else 4  # operand_dtype
    return {"fp8_scales": keys * RECENT_SCALES * 2 * 4 if per_tensor else 0,
            "amax_history": keys * 4 * cfg.precision.fp8_history if recipe == "delayed" else 0,
            "cached_weights": sum(k * n for linear in linears for k, n in linear) * width if cached else 0}
