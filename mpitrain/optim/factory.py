"""optim.name -> the optimizer over a state's segments (adamw | adafactor | adam8bit | sgd).

Every optimizer runs over `state.optimizer_segments()`: one segment under plain data parallelism, one per unit shard
under ZeRO, so each is sharded by ZeRO exactly as AdamW is. The lean optimizers' per-tensor math (Adafactor's
factored statistics and clipping, the quantization blocks of 8-bit Adam and of Adafactor's int4 moment) is computed
over each whole tensor whatever cuts it: a ZeRO shard, a tensor-parallel box, an expert-parallel rank's experts
(optim/exchange.py, optim/blocks.py), so every layout runs the one-process numbers.
"""
from __future__ import annotations

from mpitrain.config_rules import OPTIMIZERS
from mpitrain.optim import adam8bit, blocks
from mpitrain.optim.adafactor import Adafactor
from mpitrain.optim.adam8bit import Adam8bit
from mpitrain.optim.adamw import AdamW, AdamWHyper
from mpitrain.optim.sgd import SGD


def make_optimizer(optim_cfg, state, placement=None, tp=None, ep=None):
    """placement: where the optimizer's state lives (mpitrain/state/offload.py); tp, ep: the mesh's groups, which
    hold the other pieces of tensor- and expert-parallel tensors (None: one rank)."""
    o, segments = optim_cfg, state.optimizer_segments()
    name = o.name
    hyper = AdamWHyper(o.beta1, o.beta2, o.eps, o.weight_decay)
    if name == "adamw":
        return AdamW(segments, hyper, placement=placement)
    if name == "adam8bit":
        layout = state.checkpoint_layout()  # each tensor's own blocks, the same in every layout
        return Adam8bit(segments, hyper, runs=blocks.segment_runs(layout),
                        exchange=blocks.BlockExchange(layout, adam8bit.BLOCK, tp, ep), placement=placement)
    if name == "adafactor":
        return Adafactor(segments, state.checkpoint_layout(), weight_decay=o.weight_decay, beta1=o.adafactor_beta1,
                         momentum=o.adafactor_momentum, tp=tp, ep=ep, placement=placement)
    if name == "sgd":
        return SGD(segments, momentum=o.momentum, weight_decay=o.weight_decay, placement=placement)
    raise ValueError(f"optim.name = {name!r}: expected one of {', '.join(OPTIMIZERS)}")
