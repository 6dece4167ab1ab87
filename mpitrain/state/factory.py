"""parallel.zero -> the state strategy of a rank's model: replicated (zero = 0) or sharded (ZeRO-1/2/3)."""
from __future__ import annotations

from mpitrain.config import Config
from mpitrain.state.frozen import split_frozen
from mpitrain.state.hierarchical import hierarchical_group
from mpitrain.state.replicated import ReplicatedState
from mpitrain.state.strategy import StateStrategy, other_reduction_groups, reduction_group
from mpitrain.state.zero import ZeroState
from mpitrain.state.zero_quantized import QuantizedComm


def make_state(cfg: Config, model, backend, mesh, placement=None, initialise: bool = True) -> StateStrategy:
    """Where the parameters, gradients and optimizer shards of `model` (its `layouts`) live, over `mesh`'s groups.
    placement: where a separate master copy lives (state/offload.py; None: the device). initialise False: leave
    the parameters at zero (a checkpoint fills them; plan/dryrun.py only counts their bytes)."""
    p, reduce = cfg.parallel, cfg.precision.grad_reduce
    seed = cfg.train.seed if initialise else None
    trainable, _ = split_frozen(model.layouts)  # frozen tensors are never reduced: they name no group
    group = reduction_group(trainable, mesh)  # ParamSpec.reduce_over resolved against the mesh: dp today
    group = hierarchical_group(p, mesh, group)  # zero_shard = node / dp_reduce = two_level: in two levels
    others = other_reduction_groups(trainable, mesh)  # experts under ep > 1: reduced (and ZeRO-sharded) over expert_dp
    if p.zero == 0:
        return ReplicatedState(model.layouts, backend, seed, group, int(p.bucket_mb * 2**20), p.overlap,
                               reduce, placement, others)
    quantized = QuantizedComm(p.zero_gather_dtype, p.zero_grad_reduce, p.zero_quant_block)
    return ZeroState(model.layouts, backend, seed, group, p.zero, p.overlap, p.reshard_after_forward, reduce,
                     placement, others, quantized)
