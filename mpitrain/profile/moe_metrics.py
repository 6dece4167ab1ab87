"""The logged metrics of a training step's mixture-of-experts layers, from the auxiliary losses the model recorded
(mpitrain/layers/moe.py writes them, GPT.pop_aux_losses hands them over)."""
from __future__ import annotations

import numpy as np


def moe_step_metrics(aux: dict, moe_layers: int, mesh, tokens: int) -> tuple[dict, float]:
    """(metrics, this rank's auxiliary loss sum) of a training step. `aux`: this rank's recorded auxiliary losses;
    `moe_layers`: MoE blocks of the whole model (the same on every rank); `mesh`: its dp, pp, tp and world groups.

    The loss sum is what the trainer adds to its cross-entropy sum (summed over dp and pp like it). The metrics are
    the same on every rank: moe_aux_loss (the auxiliary losses' share of the mean loss), moe_balance and moe_z_loss
    (their means over MoE layers and micro-batches; balance 1 = uniform), and on world rank 0 `expert_shares`, each
    MoE block's share of the picks per expert. Nothing (and no communication) without MoE layers on any rank."""
    if not moe_layers:
        return {}, 0.0
    totals = [aux.get(key, 0.0) for key in ("weighted", "balance", "z")]
    totals = [mesh.pp.all_reduce_scalar(mesh.dp.all_reduce_scalar(value)) for value in totals]
    metrics = {"moe_aux_loss": totals[0] / tokens, "moe_balance": totals[1] / (tokens * moe_layers),
               "moe_z_loss": totals[2] / (tokens * moe_layers)}
    mine = aux.get("routed", {}) if mesh.tp.rank == 0 else {}  # tp ranks route alike: count them once
    gathered = mesh.world.gather_object(mine)
    if gathered is not None:
        metrics["expert_shares"] = expert_shares(gathered)
    return metrics, aux.get("weighted", 0.0)


def expert_shares(routed_per_rank: list[dict]) -> dict:
    """Each MoE block's share of the picks per expert, from every rank's {block: picks per expert}."""
    routed: dict = {}
    for part in routed_per_rank:
        for layer, counts in part.items():
            routed[layer] = routed.get(layer, 0) + np.asarray(counts)
    return {str(layer): (counts / counts.sum()).round(6).tolist() for layer, counts in sorted(routed.items())}
