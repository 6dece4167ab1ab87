"""The planner's terms for the newer parallel features are each feature's own formula functions: DualPipeV's bubble,
activations held and pipeline messages (parallel/schedule_costs.py); Ulysses' all-to-all bytes
(parallel/context.py), and its all-to-alls per block as many as the model's own forward and backward run; the tp
collectives per block (count and bytes on the wire) as many as a block's forward and backward run under each
recomputation mode.
tests/test_plan_dryrun.py checks the rows the training code builds for the same layouts."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from mpitrain.backend import make_backend
from mpitrain.comm.operations import Handle
from mpitrain.config import ModelConfig, load_config
from mpitrain.layers.fp8 import apply_fp8
from mpitrain.layers.recompute import apply_recompute
from mpitrain.layers.tensor_parallel import TensorParallel
from mpitrain.model.gpt import GPT
from mpitrain.parallel import schedule_costs
from mpitrain.parallel.context import ContextParallel, apply_context_parallel, cp_bytes_per_step, split_sequence
from mpitrain.plan.clusters import Link, load_cluster
from mpitrain.plan.cost import Layout, RankWork, estimate, ring, ulysses_bytes_per_micro_batch
from mpitrain.plan.cost_precision import tp_collectives
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


class CountingTp(TensorParallel):
    """A tp group of 2 in one process that counts the activation collectives (b, T, d) the layers run, by kind and
    bytes per element on the wire, and moves nothing real: a gather repeats the rank's chunk, a reduce-scatter keeps
    its half (the numbers are wrong, the calls are the code's). Parameter-gradient reductions (norm weights under SP,
    the router's) are not activations: the planner leaves them out, so does the count."""

    def __init__(self, sequence_parallel: bool):
        super().__init__(None, sequence_parallel)
        self.size, self.sent = 2, Counter()

    def _count(self, kind: str, x):
        if x.ndim == 3:
            self.sent[kind, x.dtype.itemsize] += 1

    def all_reduce(self, buf, op: str = "sum"):
        self._count("all_reduce", buf)
        return buf

    def start_all_reduce(self, buf):
        return Handle.completed(self.all_reduce(buf))

    def gather_sequence(self, x):
        self._count("all_gather", x)
        return np.concatenate([x, x], axis=1)

    def start_reduce_scatter_sequence(self, x):
        self._count("reduce_scatter", x)
        return Handle.completed(x[:, : x.shape[1] // 2])


def tp_sent_per_block(cfg) -> Counter:
    """The tp collectives of one block and micro-batch, (kind, bytes per element) -> count: a model of cfg's blocks
    run forward and backward on a CountingTp, less the same with one block fewer (the embedding's and head's)."""
    counts = []
    for n_layer in (2, 1):
        backend = make_backend("cpu", cfg.precision.compute)
        tp = CountingTp(cfg.parallel.sequence_parallel)
        model = GPT(replace(cfg.model, n_layer=n_layer), backend, tp=tp)
        apply_fp8(model.units, cfg.precision.fp8)
        apply_recompute(model, cfg.memory.recompute)
        state = ReplicatedState(model.layouts, backend, 0)
        tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
        _, saved = model.forward(state, tokens, np.roll(tokens, -1, axis=1))
        model.backward(state, saved, 1.0)
        counts.append(tp.sent)
    return counts[0] - counts[1]


MOE = "model.moe={experts = 4, top_k = 2}"


@pytest.mark.parametrize("model", [["model.arch=llama"], ["model.arch=llama", MOE], ["model.arch=gpt2"]])
def test_tp_collectives_per_block_are_the_models(model):
    """The planner's tp collectives per block and micro-batch are those a block runs (bf16, and FP8 gathering its
    dequantized float32 operands): without sequence parallelism 4 all-reduces (6 under full recomputation), with it
    the 4 gathers and 4 reduce-scatters, the forward's again under full, the 2 input gathers again under selective
    (its restore enters qkv's and the MLP's inputs into the tp region again)."""
    counted = {}
    for recompute in ("none", "selective", "full"):
        for sequence_parallel in (False, True):
            for recipe in ("none", "tensor"):
                settings = [f"precision.fp8={recipe}", f"memory.recompute={recompute}", "parallel.tp=2",
                            "parallel.dp=1", f"parallel.sequence_parallel={str(sequence_parallel).lower()}"]
                cfg = load_config("configs/tiny.toml", ["precision.compute=bfloat16", *settings, *model])
                sent, case = tp_sent_per_block(cfg), (recompute, sequence_parallel, recipe)
                gathers = sum(2 * n if kind == "all_reduce" else n for (kind, _), n in sent.items())
                counted[case] = gathers
                if recipe == "none":  # FP8's are cost_precision.py's list (the estimate runs on sequence parallelism)
                    assert RankWork.of(cfg, "bfloat16").tp_per_layer == gathers, case
                if sequence_parallel:  # cost_precision.py's list, collective by collective, with its wire bytes
                    wire = Counter()
                    for (_, nbytes), n in sent.items():
                        wire[nbytes] += n
                    planned = Counter(nbytes for _, nbytes, _ in tp_collectives(cfg, 2, MOE in model))
                    assert planned == wire, case
    assert [counted[mode, True, "none"] for mode in ("none", "selective", "full")] == [8, 10, 12]
    assert [counted[mode, False, "none"] for mode in ("none", "selective", "full")] == [8, 8, 12]


def test_selective_recomputation_under_sp_costs_its_two_gathers_again():
    """The estimate's tp part under selective recomputation with sequence parallelism: 10 gathers per block and
    micro-batch (8, and the 2 the restore runs again), on the plain ring."""
    cfg, _ = model_config("llama3-8b")
    cluster = load_cluster("h100")
    plain, selective = (estimate(cfg, Layout(dp=2, tp=4, pp=2, zero=1, micro_batch=1, recompute=mode), cluster)
                        for mode in ("none", "selective"))
    activation = 8192 * cfg.model.d_model * 2
    extra = selective["micro_batches"] * ring(cluster.intra, "all_gather", activation, 4, 2 * 16)
    assert selective["parts"]["tp"] - plain["parts"]["tp"] == pytest.approx(extra, rel=1e-12)
