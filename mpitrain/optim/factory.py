"""optim.name -> the optimizer over a state's segments (adamw | adafactor | adam8bit | sgd).

Every optimizer runs over `state.optimizer_segments()`: one segment under plain data parallelism, one per unit shard
under ZeRO, so each is sharded by ZeRO exactly as AdamW is (the layouts where a lean optimizer's run would depend
on the layout are refused before: layout_checks.validate_optimizer_layout). 8-bit Adam's
quantization blocks are each tensor's own (optim/blocks.py), so its run is the same in every ZeRO layout.
"""
from __future__ import annotations

from mpitrain.config_rules import OPTIMIZERS
from mpitrain.errors import ConfigError
from mpitrain.optim import adam8bit, blocks, quant4
from mpitrain.optim.adafactor import Adafactor
from mpitrain.optim.adam8bit import Adam8bit
from mpitrain.optim.adamw import AdamW, AdamWHyper
from mpitrain.optim.sgd import SGD
from mpitrain.state.strategy import ShardLayout


def segment_tensors(layout: ShardLayout) -> list[list[tuple[int, int, tuple[int, ...]]]]:
    """Per optimizer segment, the tensors (this rank's block of them) that lie wholly inside it, as (start, end,
    shape) in segment coordinates; `layout` is state.checkpoint_layout()."""
    return [[(offset - g0, offset - g0 + spec.size, tuple(spec.shape)) for _, spec, offset in found
             if g0 <= offset and offset + spec.size <= g1] for g0, g1, found in blocks.segment_specs(layout)]


def segment_matrices(layout: ShardLayout) -> list[list[tuple[int, int, int, int]]]:
    """segment_tensors' 2-D ones, as (start, end, rows, cols): those Adafactor factors."""
    return [[(a, b, *shape) for a, b, shape in found if len(shape) == 2] for found in segment_tensors(layout)]


def make_optimizer(optim_cfg, state, placement=None):
    """placement: where AdamW's moments live (mpitrain/state/offload.py); the lean optimizers keep theirs on the
    device (their state is small: offloading it is not supported)."""
    o, segments = optim_cfg, state.optimizer_segments()
    name = o.name
    if name == "adamw":
        hyper = AdamWHyper(o.beta1, o.beta2, o.eps, o.weight_decay)
        return AdamW(segments, hyper) if placement is None else AdamW(segments, hyper, placement=placement)
    if placement is not None and placement.kind != "none":
        raise ConfigError(f"memory.offload = {placement.kind!r} moves AdamW's moments only; optim.name = {name!r} "
                          "keeps its small state on the device: set memory.offload = 'none'")
    if name == "adam8bit":
        layout = state.checkpoint_layout()
        runs = blocks.segment_runs(layout, adam8bit.BLOCK)  # each tensor's own blocks, the same in every layout
        return Adam8bit(segments, AdamWHyper(o.beta1, o.beta2, o.eps, o.weight_decay), runs=runs,
                        exchanges=blocks.segment_cuts(layout, runs, adam8bit.BLOCK))
    if name == "adafactor":
        layout = state.checkpoint_layout()
        momentum = o.adafactor_momentum
        int4 = momentum == "int4" and o.adafactor_beta1
        return Adafactor(segments, segment_matrices(layout), weight_decay=o.weight_decay, beta1=o.adafactor_beta1,
                         tensors=[[(a, b) for a, b, _ in found] for found in segment_tensors(layout)],
                         momentum=momentum, runs=blocks.segment_runs(layout, quant4.BLOCK, name) if int4 else None)
    if name == "sgd":
        return SGD(segments, momentum=o.momentum, weight_decay=o.weight_decay)
    raise ValueError(f"optim.name = {name!r}: expected one of {', '.join(OPTIMIZERS)}")
