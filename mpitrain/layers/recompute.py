"""Activation recomputation: a block keeps less of its forward and recomputes the rest at the start of its backward.

`memory.recompute`:
  none       the block keeps what each sublayer's forward saves (mpitrain/model/units.py).
  full       the block keeps only its input; backward runs the block's forward again first (all of it, collectives
             included: under tensor parallelism every rank of the group recomputes in the same order).
  selective  Megatron's selective recomputation: keep what costs matmuls to recompute, drop what is large and cheap.
             Kept: the norms' inputs (the block input and the residual after attention), q, k, v (after RoPE) and the
             MLP nonlinearity's input(s). Recomputed: the norms and their entry into the tp region (the sequence
             all-gather under SP, as Megatron does), the attention scores, softmax and probs @ v, and the
             nonlinearity's output. No linear is run again. Under precision.fp8 the qkv and MLP-up inputs are
             quantized again before that entry, to the forward's fp8 values: the per-tensor recipes keep the amax
             the forward scaled by (a float each, so no amax all-reduce runs again), block and mxfp8 take their
             tile scales again from the same values.
             An MoE layer keeps its routing (probabilities, log-sum-exp, picks, the exchange's counts), its experts'
             dispatched inputs, their nonlinearities' inputs and the combined expert output: no router, expert
             matmul or all-to-all runs again, only the nonlinearities (MoE.keep_selective).
             Ring attention (parallel.cp > 1) keeps its whole core (q, k, v, output and log-sum-exp: it saves no
             probabilities to drop); recomputed are the norms, their entry into the tp region and the output's
             merged heads. Ulysses keeps its heads' q, k, v over the whole sequence and the exchanged output,
             hybrid its ring's whole core and the exchanged output: no all-to-all runs again
             (Attention.keep_selective).
`memory.recompute_layers = K`: only the first K blocks of each model chunk (pipeline stage) recompute; 0: all.

Exact: the recomputed arrays are the same operations on the same inputs, so they are bitwise the forward's, and a
run gives the same losses and parameters as without recomputation.

The extra work is forward FLOPs: full adds one block forward (about a third of a block's training FLOPs), selective
only the attention core's two (T x T) matmuls; count them as hardware FLOPs, not model FLOPs, in the time breakdown.
"""
from __future__ import annotations

from mpitrain.layers import ops
from mpitrain.layers.moe import MoE

RECOMPUTE_MODES = ("none", "selective", "full")


class Shared:
    """Per-sequence-length constants (causal bias, rotary tables) a kept state refers to without owning them: an
    opaque holder, so that counting a saved state's arrays (backend.nbytes_of) does not count them per micro-batch."""

    def __init__(self, ctx: dict):
        self.ctx = ctx


def forward_runs(mode: str) -> int:
    """Times a block's forward runs per micro-batch under memory.recompute `mode`: twice under full recomputation
    (backward runs it again), once otherwise (selective restores its kept arrays without a second forward)."""
    return 2 if mode == "full" else 1


def apply_recompute(model, mode: str, layers: int = 0) -> None:
    """Set the mode of the blocks of each chunk of `model` (a GPT): the first `layers` of the chunk (0: all)."""
    for chunk in model.chunks:
        blocks = [model.units[i] for i in chunk if hasattr(model.units[i], "recompute")]
        count = len(blocks) if layers == 0 else min(layers, len(blocks))
        for k, block in enumerate(blocks):
            block.recompute = mode if k < count else "none"


def forward(block, params, x, ctx):
    """(y, kept) of a block under its `recompute` mode (selective or full)."""
    kept = {"x": x, "ctx": Shared(ctx)}
    if block.attention.rope:
        kept["rope"] = (ctx["cos"], ctx["sin"])  # shared tables, counted once by GPT.saved_bytes
    if block.recompute == "full":
        y, _ = block.forward_all(params, x, ctx)
        return y, kept
    h1, _ = block.norm1.forward(params, x)
    attention, attention_saved = block.attention.forward(params, h1, ctx)
    x1 = x + attention
    h2, _ = block.norm2.forward(params, x1)
    qkv_scale = block.attention.qkv.kept_scale()  # read before another forward quantizes again
    mlp, mlp_saved = block.mlp.forward(params, h2, ctx)
    kept.update(x1=x1, core=block.attention.keep_selective(attention_saved), qkv_scale=qkv_scale)
    if isinstance(block.mlp, MoE):
        kept["moe"] = block.mlp.keep_selective(mlp_saved)
    else:
        kept.update(activation=mlp_saved["activation"], up_scale=block.mlp.up.kept_scale())
    return x1 + mlp, kept


def restore(block, params, kept) -> dict:
    """The saved state a `none` block would hold, recomputed from what the block kept."""
    ctx = {**kept["ctx"].ctx, "aux_losses": {}}  # MoE: the forward already logged its auxiliary losses
    if block.recompute == "full":
        return block.forward_all(params, kept["x"], ctx)[1]
    h1, norm1 = block.norm1.forward(params, kept["x"])
    core, out = block.attention.restore_selective(kept["core"], ctx)
    attention = {"qkv": block.attention.qkv.enter_again(h1, kept["qkv_scale"]), "core": core, "out": out}
    if block.attention.rope:
        attention["rope"] = kept["rope"]
    h2, norm2 = block.norm2.forward(params, kept["x1"])
    if isinstance(block.mlp, MoE):
        mlp = block.mlp.restore_selective(kept["moe"], h2)
    else:
        activation = kept["activation"]
        act = ops.swiglu_forward(*activation)[0] if block.mlp.gated else ops.gelu_forward(activation)[0]
        mlp = {"up": block.mlp.up.enter_again(h2, kept["up_scale"]), "activation": activation, "down": act}
    return {"norm1": norm1, "attention": attention, "norm2": norm2, "mlp": mlp}


def saved_arrays(block, batch: int, seq_len: int, dtype) -> list:
    """(shape, dtype) of what `forward` keeps per micro-batch (the shared tables are the model's)."""
    local_seq = len(range(seq_len)[block.norm1.tp.sequence_chunk(seq_len)])  # 1/t of it under SP
    residual = ((batch, local_seq, block.norm1.width), dtype)
    if block.recompute == "full":
        return [residual]
    a = block.attention
    qkv = a.selective_saved_arrays(batch, seq_len, dtype)
    if isinstance(block.mlp, MoE):
        return [residual, residual] + qkv + block.mlp.selective_saved_arrays(batch, seq_len, dtype)
    hidden = ((batch, seq_len, block.mlp.local_width), dtype)
    return [residual, residual] + qkv + [hidden] * (2 if block.mlp.gated else 1)

