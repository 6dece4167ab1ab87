"""The logged metrics of a training step's mixture-of-experts layers, from the auxiliary losses the model recorded
(mpitrain/layers/moe.py writes them, GPT.pop_aux_losses hands them over)."""
from __future__ import annotations

import numpy as np


def moe_step_metrics(aux: dict, moe_layers: int, mesh, tokens: int) -> tuple[dict, float]:
    """(metrics, this rank's auxiliary loss sum) of a training step. `aux`: this rank's recorded auxiliary losses;
    `moe_layers`: MoE blocks of the whole model (the same on every rank); `mesh`: its dp, pp, tp and world groups.

    The loss sum is what the trainer adds to its cross-entropy sum (summed over dp and pp like it). The metrics are
    the same on every rank: moe_aux_loss (the auxiliary losses' share of the mean loss), moe_balance and moe_z_loss
    (their means over MoE layers and micro-batches; balance 1 = uniform), moe_seq_balance (the sequence-level one),
    and on world rank 0 `expert_shares`, each MoE block's share of the picks per expert, and `expert_load`, each
    block's busiest expert over uniform and its dropped picks. Nothing (and no communication) without MoE layers on
    any rank."""
    if not moe_layers:
        return {}, 0.0
    totals = [aux.get(key, 0.0) for key in ("weighted", "balance", "seq_balance", "z")]
    totals = [mesh.pp.all_reduce_scalar(mesh.dp_cp.all_reduce_scalar(value)) for value in totals]  # cp: other tokens
    metrics = {"moe_aux_loss": totals[0] / tokens, "moe_balance": totals[1] / (tokens * moe_layers),
               "moe_seq_balance": totals[2] / (tokens * moe_layers), "moe_z_loss": totals[3] / (tokens * moe_layers)}
    mine = {key: aux.get(key, {}) if mesh.tp.rank == 0 else {} for key in ("routed", "dropped")}  # tp ranks alike
    gathered = mesh.world.gather_object(mine)
    if gathered is not None:
        metrics["expert_shares"] = expert_shares([part["routed"] for part in gathered])
        metrics["expert_load"] = expert_load(metrics["expert_shares"], [part["dropped"] for part in gathered])
    return metrics, aux.get("weighted", 0.0)


def expert_load(shares: dict, dropped_per_rank: list[dict]) -> dict:
    """Each MoE block's busiest expert's share over the uniform 1/E ("max_over_uniform": 1 is perfect balance) and
    the picks capacity dropped in the step ("dropped"), from `expert_shares` and every rank's {block: dropped}."""
    dropped: dict = {}
    for part in dropped_per_rank:
        for layer, count in part.items():
            dropped[str(layer)] = dropped.get(str(layer), 0) + int(count)
    return {layer: {"max_over_uniform": round(max(values) * len(values), 6), "dropped": dropped.get(layer, 0)}
            for layer, values in shares.items()}


def step_expert_loads(aux: dict, group) -> dict:
    """{block: the step's picks per expert over every rank of `group` (dp x cp: all of the step's tokens)} of this
    rank's MoE blocks, the same numbers on each of them (summed in rank order on the group's first rank, then
    broadcast): what bias balancing moves the routing biases by (model.moe.balance = 'bias')."""
    gathered = group.gather_object({layer: np.asarray(counts) for layer, counts in aux.get("routed", {}).items()})
    totals = None
    if gathered is not None:
        totals = {layer: sum(part[layer] for part in gathered) for layer in sorted(gathered[0])}
    return group.broadcast_object(totals)


def expert_shares(routed_per_rank: list[dict]) -> dict:
    """Each MoE block's share of the picks per expert, from every rank's {block: picks per expert}."""
    routed: dict = {}
    for part in routed_per_rank:
        for layer, counts in part.items():
            routed[layer] = routed.get(layer, 0) + np.asarray(counts)
    return {str(layer): (counts / counts.sum()).round(6).tolist() for layer, counts in sorted(routed.items())}


def expert_load_line(row: dict) -> str | None:
    """One line of a logged row's per-block expert load for `mpitrain report` (None without MoE layers)."""
    load = row.get("expert_load")
    if not load:
        return None
    blocks = ", ".join(f"block {block} {value['max_over_uniform']:.2f}" + (f" ({value['dropped']} dropped)"
                                                                            if value["dropped"] else "")
                       for block, value in load.items())
    return f"MoE busiest expert / uniform at step {row['step']}: {blocks}"
