"""Tensor parallelism: each block moves 4 all-reduces of its activations per micro-batch (2 forward, 2 backward),
whatever the link; on a slower link that traffic becomes the step. Why tp stays inside a node.

Checked: the bytes the tp group's counters saw for one block's forward + backward, 8 b s h (t-1)/t elements.
Shown: the share of the block's time spent in those all-reduces here (shared-memory MPI; on an oversubscribed CPU
it includes waiting for the peer), and, for a GPT-3-sized block on H100s (configs/clusters/h100.toml), the share
the same formula's bytes take over NVLink (in a node) vs InfiniBand (across nodes), by plan/cost.py's ring model.
"""
from __future__ import annotations

import time

from mpitrain.config import ModelConfig
from mpitrain.lab.runner import Row

NAME = "tensor"
TITLE = "Tensor parallelism: bytes per block, and the communication share as the link slows"
PANELS = 1
MODELLED_TP = (2, 4, 8)  # one H100 node holds 8
NOTICE = ("What to notice: the all-reduce bytes are fixed by b, s, h and t, not by the link; only their time "
          "changes, and they do not shrink as t grows while each rank's compute does. Over NVLink they stay a small "
          "share of a large block; over one InfiniBand NIC per GPU (9x less bandwidth) they take a large share, which "
          "is why tensor parallelism stays inside a node and data or pipeline parallelism go across nodes.")


def ranks(quick: bool) -> int:
    return 2


def shape(quick: bool) -> tuple[int, int, int]:
    return (4, 64, 64) if quick else (8, 256, 256)  # b, s, h


def job(world, quick: bool):
    import numpy as np

    from mpitrain.backend import make_backend
    from mpitrain.comm.group import Group
    from mpitrain.model.gpt import GPT
    from mpitrain.state.params import FlatBuffer, initial_unit_flat
    b, s, h = shape(quick)
    t = world.size
    group = Group(world.Split(color=0, key=world.rank), "tp")
    backend = make_backend("cpu", "float32")
    cfg = ModelConfig(arch="gpt2", n_layer=1, d_model=h, n_head=4, seq_len=s, vocab_size=256)
    rng = np.random.default_rng(0)
    x, dy = rng.normal(size=(b, s, h)).astype(np.float32), rng.normal(size=(b, s, h)).astype(np.float32)
    out = {"t": t, "b": b, "s": s, "h": h, "item": 4}
    for sp in (False, True):
        model = GPT(cfg, backend, tp_group=group, sequence_parallel=sp)
        block, chunk = model.units[1], model.tp.sequence_chunk(s)
        params = FlatBuffer.allocate([block.layout], np, np.float32)
        params.data[:] = initial_unit_flat(block.layout, 0, params.size)
        grads = FlatBuffer.allocate([block.layout], np, np.float32)
        best = None
        for _ in range(3 if quick else 5):
            group.reset_counters()
            model.tp.reset_timers()
            world.Barrier()
            start = time.perf_counter()
            _, saved = block.forward(params.views[0], x[:, chunk].copy(), model.context(s))
            block.backward(params.views[0], grads.views[0], saved, dy[:, chunk].copy())
            total = time.perf_counter() - start
            comm = sum(model.tp.seconds.values())
            if best is None or total < best[0]:
                best = (total, comm)
        # gradients each rank computes only partly (the norm weights under sequence parallelism) are all-reduced
        partial = sum(grads.views[0][name].size for name in block.partial_grads if name in grads.views[0])
        out["sp" if sp else "plain"] = {"moved": float(sum(group.counters(exact=True).values())),
                                        "partial": partial, "seconds": best[0], "comm_seconds": best[1]}
    return out if world.rank == 0 else None


def modelled_share(cluster, inter: bool, t: int, b: int = 1, s: int = 2048, h: int = 12288) -> float:
    """Share of one block's fwd+bwd spent in its 4 all-reduces of b s h bf16 activations on `cluster`'s in-node
    (NVLink) or inter-node link (plan/cost.py's ring model), compute = block FLOPs / (t x achievable peak)."""
    from mpitrain.plan.cost import ring
    link = cluster.inter if inter else cluster.intra
    comm = ring(link, "all_reduce", b * s * h * 2, t, times=4)
    flops = 3 * (24 * b * s * h * h + 4 * b * s * s * h)  # forward (linears + attention products) x 3 for fwd+bwd
    compute = flops / (t * cluster.peak_flops * cluster.matmul_efficiency)
    return comm / (compute + comm)


def rows(result: dict) -> list[Row]:
    from mpitrain.plan.clusters import load_cluster
    b, s, h, t, item = (result[k] for k in ("b", "s", "h", "t", "item"))
    expected = 8 * b * s * h * (t - 1) / t * item
    plain, sp = result["plain"], result["sp"]
    out = [Row(f"tp={t}: one block's fwd+bwd, b={b} s={s} h={h}", f"4 all-reduces, 8 b s h (t-1)/t x 4 B = "
               f"{expected / 1e6:.3f} MB", f"{plain['moved'] / 1e6:.3f} MB", plain["moved"], expected)]
    with_norms = expected + 2 * (t - 1) / t * sp["partial"] * item
    out.append(Row("same, sequence parallel: 4 all-gathers + 4 reduce-scatters", f"the same + norm weights' "
                   f"all-reduce = {with_norms / 1e6:.3f} MB", f"{sp['moved'] / 1e6:.3f} MB", sp["moved"], with_norms))
    share = plain["comm_seconds"] / plain["seconds"]
    out.append(Row("communication share of that block, this machine", "time in all-reduces / block time",
                   f"{100 * share:.0f}% (ranks share cores: waits count)"))
    h100 = load_cluster("h100")
    for t_model in MODELLED_TP:
        intra, inter = (modelled_share(h100, crosses, t_model) for crosses in (False, True))
        out.append(Row(f"H100, h=12288 s=2048, tp={t_model}: in node vs across", "ring model (plan/cost.py)",
                       f"{100 * intra:.0f}% NVLink vs {100 * inter:.0f}% InfiniBand"))
    return out


def plot(result: dict, axes) -> None:
    from mpitrain.plan.clusters import load_cluster
    h100 = load_cluster("h100")
    for crosses, colour, label in ((False, "tab:green", "NVLink (in node)"), (True, "tab:red", "InfiniBand")):
        shares = [100 * modelled_share(h100, crosses, t) for t in MODELLED_TP]
        axes[0].plot(MODELLED_TP, shares, "o-", color=colour, label=label)
    axes[0].set(xscale="log", xlabel="tensor-parallel degree t", ylabel="all-reduce share of a block (%)",
                title="H100, h=12288 s=2048 b=1 (modelled)", ylim=(0, 100))
    axes[0].set_xticks(MODELLED_TP)
    axes[0].xaxis.set_major_formatter("{x:.0f}")
    axes[0].minorticks_off()
    axes[0].legend(fontsize=8)
