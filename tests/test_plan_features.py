"""The planner's terms for the newer parallel features are each feature's own formula functions: DualPipeV's bubble,
activations held and pipeline messages (parallel/schedule_costs.py); Ulysses' all-to-all bytes
(parallel/context.py), and its all-to-alls per block as many as the model's own forward and backward run.
tests/test_plan_dryrun.py checks the rows the training code builds for the same layouts."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from mpitrain.backend import make_backend
from mpitrain.config import ModelConfig
from mpitrain.layers.recompute import apply_recompute
from mpitrain.model.gpt import GPT
from mpitrain.parallel import schedule_costs
from mpitrain.parallel.context import ContextParallel, apply_context_parallel, cp_bytes_per_step, split_sequence
from mpitrain.plan.clusters import Link, load_cluster
from mpitrain.plan.cost import Layout, estimate, ulysses_bytes_per_micro_batch
from mpitrain.plan.layout import layout_for, parse_layout
from mpitrain.plan.memory import _stage_holdings
from mpitrain.plan.presets import model_config
from mpitrain.plan.search import search
from mpitrain.state.replicated import ReplicatedState


def test_dualpipev_bubble_messages_and_activations_are_the_schedule_formulas():
    cfg, _ = model_config("llama3-8b")
    cluster = load_cluster("h100")
    pp, dp = 4, 2
    runs = {kind: estimate(cfg, Layout(dp=dp, tp=1, pp=pp, zero=1, micro_batch=1, schedule=kind, virtual_stages=v),
                           cluster) for kind, v in (("dualpipev", 2), ("1f1b", 1))}
    m = runs["dualpipev"]["micro_batches"]
    assert m >= 2 * pp and runs["dualpipev"]["bubble"] == float(schedule_costs.bubble("dualpipev", pp, m, 2))
    # each of the p - 1 links carries both chunks each way: twice 1f1b's messages of the same (micro_batch, T, d)
    per_link = {kind: schedule_costs.messages_per_micro_batch(kind, pp, v) / (pp - 1) for kind, v in
                (("dualpipev", 2), ("1f1b", 1))}
    assert per_link == {"dualpipev": 4, "1f1b": 2}
    assert runs["dualpipev"]["parts"]["pp_send"] == pytest.approx(2 * runs["1f1b"]["parts"]["pp_send"], rel=1e-12)
    assert sum(runs["dualpipev"]["parts"].values()) == pytest.approx(runs["dualpipev"]["step_s"], rel=1e-12)
    for p in (2, 3, 4):  # the activations the planner charges: the chunks each rank holds at its peak
        for micro_batches in (2 * p, 3 * p):
            held = [max(saved for saved, _ in rank) for rank in _stage_holdings("dualpipev", p, micro_batches, 2)]
            assert held == schedule_costs.peak_activation_chunks("dualpipev", p, micro_batches, 2)


def test_dualpipev_in_the_search_and_the_layout_text():
    layout_, world = layout_for(parse_layout("dp2 tp4 pp4 dualpipev"), 32)
    assert (layout_.schedule, layout_.virtual_stages, world) == ("dualpipev", 2, 32)
    cfg, _ = model_config("gpt3-350m")
    cfg.train.global_batch = 16
    found = search(cfg, load_cluster("h100"), 8, prune=False)
    evaluated = found["fits"] + found["too_big"]
    dualpipev = [r for r in evaluated if r["layout"]["schedule"] == "dualpipev"]
    assert dualpipev and all(r["micro_batches"] >= 2 * r["layout"]["pp"] for r in dualpipev)
    assert not any("dualpipev" in reason for reason in found["refused"])  # too few micro-batches: never tried



@pytest.mark.parametrize("recompute", ["none", "full"])
def test_ulysses_bytes_are_context_cp_bytes_per_step(recompute):
    cfg, _ = model_config("llama3-8b")  # 32 heads, 8 K/V heads: tp 8 x cp 4 leaves each rank under one K/V head
    cfg.memory.recompute, cfg.train.micro_batch = recompute, 2
    for tp, cp in ((1, 2), (2, 4), (8, 4)):
        cfg.parallel.tp, cfg.parallel.cp = tp, cp
        kv = cfg.model.kv_heads // tp
        expected = cp_bytes_per_step("ulysses", 2, cfg.model.seq_len, cfg.model.n_head // tp, kv, cfg.model.head_dim,
                                     2, cp, blocks=5, recompute=recompute)
        assert expected["cp_ring"] == 0 and ulysses_bytes_per_micro_batch(cfg, 2, 5) == expected["all_to_all"] > 0


class CountingCp(ContextParallel):
    """A cp group of `size` ranks in one process that counts the messages the layers send and moves nothing real:
    an all-to-all hands back the rank's own buffer, the ring passes its own K/V on (the numbers are wrong, the
    messages are the code's). Hybrid: `inside` and `across` are its two levels, each counting its own."""

    def __init__(self, size: int, kind: str, inside=None, across=None):
        self.group, self.kind, self.size, self.rank = None, kind, size, 0
        self.next, self.prev = 1 % size, (size - 1) % size
        self.inside, self.across, self.sent = inside, across, Counter()

    def exchange(self, send):
        self.sent["all_to_all"] += 1
        return send.copy()

    def pass_kv(self, send):
        self.sent["cp_ring"] += 1
        return send.copy(), []

    def send_grads(self, send) -> list:
        self.sent["cp_ring"] += 1
        return []

    def receive_grads(self, like):
        return np.zeros_like(like), []


def cp_messages_per_block(kind: str, recompute: str, cp_size: int, inside: int = 1) -> dict:
    """Messages one cp rank sends per attention block and micro-batch, by counter, counted while a tiny llama runs
    its own forward and backward (layers/recompute.py's path under `recompute`) on a CountingCp."""
    cfg = ModelConfig(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=16, arch="llama", n_kv_head=2)
    backend = make_backend("cpu", "float64")
    model = GPT(cfg, backend)
    levels = (CountingCp(inside, "ulysses"), CountingCp(cp_size // inside, "ring")) if kind == "hybrid" else ()
    cp = CountingCp(cp_size, kind, *levels)
    apply_context_parallel(model, cp)
    apply_recompute(model, recompute)
    state = ReplicatedState(model.layouts, backend, 0)
    tokens = np.random.default_rng(0).integers(0, 64, (2, 16))
    local, targets = (split_sequence(x, cp_size, 0) for x in (tokens, np.roll(tokens, -1, axis=1)))
    _, saved = model.forward(state, local, targets)
    model.backward(state, saved, 1.0)
    sent = sum((counter.sent for counter in (cp, *levels)), Counter())
    return {counter: count / cfg.n_layer for counter, count in sent.items()}


LATENCY_ONLY = Link(bandwidth=1e30, efficiency=1.0, latency=1.0)  # seconds = latency steps


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("kind", ["ulysses", "ring"])
def test_cp_messages_per_block_are_the_models(kind, recompute):
    """The planner's cp latency steps per micro-batch are the messages a block's forward and backward send: Ulysses'
    all-to-alls (Q/K/V and the output, dO and dQ/dK/dV) of c - 1 steps each, the ring's K/V and dK/dV hops; full
    recomputation sends the forward's again, selective keeps what the exchanges delivered."""
    counted = cp_messages_per_block(kind, recompute, 4)
    assert counted == {"ulysses": {"all_to_all": 6 if recompute == "full" else 4},
                       "ring": {"cp_ring": (4 if recompute == "full" else 3) * (4 - 1)}}[kind]
    cfg, _ = model_config("llama3-8b")
    cluster = replace(load_cluster("h100"), intra=LATENCY_ONLY, inter=LATENCY_ONLY, comm_overlap=0.0)
    result = estimate(cfg, Layout(dp=1, tp=1, pp=1, cp=4, cp_kind=kind, zero=1, recompute=recompute), cluster)
    steps = counted["all_to_all"] * (4 - 1) if kind == "ulysses" else counted["cp_ring"]
    assert result["parts"]["cp_ring"] == pytest.approx(result["micro_batches"] * cfg.model.n_layer * steps, rel=1e-12)
