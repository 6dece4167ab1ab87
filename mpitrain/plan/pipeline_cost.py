"""What the pipeline's busiest rank costs beyond the mean rank: the planner's stage-imbalance term (plan/cost.py).

A pipeline runs at the pace of its slowest rank: in the steady state every rank waits each micro-batch for the
busiest one's chunks. plan/cost.py divides the model's work evenly over the ranks, so where the ranks hold unequal
work it predicts the mean rank's pace. Two things make them unequal: a split of n_layer blocks over pp x v virtual
stages that does not come out even (the remainder goes to the first stages, parallel/pipeline.py
stage_layer_counts), and the head (the logits' matmuls over the vocabulary and the loss) and the embedding, which
sit on the rank that holds the last and the first virtual stage. Llama 3 moved one block off its first and its last
stage for this reason (The Llama 3 Herd of Models, section 3.3.2); Megatron-LM splits blocks evenly and leaves the
head on the last stage.

    load(rank)    = blocks on the rank + head_blocks [holds the head] + embedding_blocks [holds the embedding]
    imbalance     = max over ranks of load / mean over ranks of load

head_blocks is the head's matmul FLOPs per token in blocks' worth (6 V d against a block's FLOPs per token, forward
and backward); the embedding is a lookup whose gradient is a scatter-add (no matmul), so its compute is not
counted. The planner stretches the per-micro-batch compute by `imbalance` (1 without pipelining).
"""
from __future__ import annotations

from mpitrain.parallel.instructions import placement_of
from mpitrain.parallel.pipeline import rank_stages


def rank_loads(n_layer: int, pp: int, virtual_stages: int, head_blocks: float, embedding_blocks: float = 0.0,
               override=(), placement: str = "loop") -> list[float]:
    """Each pipeline rank's compute in blocks' worth: its blocks, plus the head and the embedding on the ranks that
    hold them (module docstring). Units as parallel/pipeline.py rank_stages numbers them: 0 the embedding,
    1..n_layer the blocks, n_layer + 1 the head."""
    loads = []
    for rank in range(pp):
        load = 0.0
        for first, end in rank_stages(n_layer, pp, virtual_stages, rank, override, placement):
            load += len(range(max(first, 1), min(end, n_layer + 1)))
            load += head_blocks * (first <= n_layer + 1 < end) + embedding_blocks * (first == 0)
        loads.append(load)
    return loads


def stage_imbalance(loads: list[float]) -> float:
    """The busiest rank's load over the mean rank's: how much slower the pipeline runs than an even split."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def head_blocks(vocab_size: int, d_model: int, block_flops_per_token: float) -> float:
    """The head's logits matmuls (forward and backward, 6 V d FLOPs per token) in blocks' worth."""
    return 6.0 * vocab_size * d_model / block_flops_per_token if block_flops_per_token > 0 else 0.0


def pipeline_imbalance(n_layer: int, pp: int, virtual_stages: int, schedule: str, vocab_size: int, d_model: int,
                       model_flops_per_token: float, override=()) -> float:
    """stage_imbalance of a layout: the blocks' FLOPs per token are the model's (forward and backward, recomputation
    included) less the head's 6 V d, over n_layer; 1 without pipelining."""
    if pp <= 1:
        return 1.0
    head_flops = 6.0 * vocab_size * d_model
    block_flops = (model_flops_per_token - head_flops) / n_layer
    loads = rank_loads(n_layer, pp, virtual_stages, head_blocks(vocab_size, d_model, block_flops), 0.0, override,
                       placement_of(schedule))
    return stage_imbalance(loads)
