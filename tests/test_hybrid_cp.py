"""Hybrid context parallelism (parallel.cp_kind = "hybrid": Ulysses inside a node, the ring across nodes): the layer
against one process with finite-difference gradients and its bytes against cp_bytes_per_block at cp 4 as 2 x 2,
4 x 1 (one node: Ulysses) and 1 x 4 (one rank per node: the ring); whole runs on fake nodes at parity with one
process in float64, and the bytes per step of ring, Ulysses and hybrid runs against cp_bytes_per_step."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpitrain.comm.mesh import Degrees
from mpitrain.comm.nodes import NodeLayout
from mpitrain.config import load_config
from mpitrain.errors import ConfigError, LayoutError
from mpitrain.layout_checks import groups_split_by_node
from mpitrain.parallel.context import (
    ContextParallel,
    check_cp_blocks_on_nodes,
    check_heads_split,
    cp_bytes_per_block,
    cp_bytes_per_step,
)
from tests.mpi_helpers import run_python_mpi_results
from tests.test_context_parallel import ARCH, assert_same_run, train_run

LAYER_SCRIPT = """
import json
import numpy as np
from mpi4py import MPI
from mpitrain.comm.group import Group
from mpitrain.data.documents import documents_of
from mpitrain.layers import attention_core, hybrid_attention, ops
from mpitrain.parallel.context import ContextParallel, cp_bytes_per_block, zigzag_positions

world = MPI.COMM_WORLD
rng = np.random.default_rng(0)  # the same full-sequence arrays on every rank
B, H, Hkv, T, D = 2, 4, 2, 16, 4
q, dout = rng.standard_normal((B, H, T, D)), rng.standard_normal((B, H, T, D))
k, v = rng.standard_normal((B, Hkv, T, D)), rng.standard_normal((B, Hkv, T, D))
documents = documents_of(rng.integers(0, 4, (B, T)), 0)  # packed documents: a new one after every 0
results = {}
for inside_size, docs in ((2, False), (2, True), (4, False), (1, True)):  # 2 x 2; one node; one rank per node
    node, position = divmod(world.rank, inside_size)
    inside = Group(world.Split(node, position), "cp_inside")
    across = Group(world.Split(position, node), "cp_across")
    cp = ContextParallel(Group(world.Split(0, world.rank), "cp"), kind="hybrid", inside=inside, across=across)
    if docs:
        mask = attention_core.document_bias(documents.ids, documents.positions, documents.ids, documents.positions,
                                            np, np.float64)
    else:
        mask = ops.causal_bias(T, T, np, np.float64)
    (ref, _), saved = ops.attention_forward(q, k, v, mask)
    ref_grads = ops.attention_backward(saved, dout)
    mine = zigzag_positions(T, cp.size, cp.rank)
    local = [np.ascontiguousarray(x[:, :, mine]) for x in (q, k, v)]
    rows = (documents.ids, documents.positions) if docs else None
    out, kept = hybrid_attention.forward(cp, *local, rows)
    sent_forward = {"all_to_all": inside.bytes_sent["all_to_all"], "cp_ring": across.bytes_sent["cp_ring"]}
    grads = hybrid_attention.backward(cp, kept, np.ascontiguousarray(dout[:, :, mine]))
    sent_backward = {"all_to_all": inside.bytes_sent["all_to_all"] - sent_forward["all_to_all"],
                     "cp_ring": across.bytes_sent["cp_ring"] - sent_forward["cp_ring"]}
    errors = [float(np.abs(a - b[:, :, mine]).max() / np.abs(b).max())
              for a, b in zip((out, *grads), (ref, *ref_grads))]
    declared = hybrid_attention.saved_arrays(B, H, Hkv, T // 4, D, inside_size, np.float64)
    fd = []
    if inside_size == 2:  # finite differences of the distributed forward at rank 0's inputs
        def loss(which, where, eps):
            inputs = [x.copy() for x in local]
            if cp.rank == 0:
                inputs[which][where] += eps
            y, _ = hybrid_attention.forward(cp, *inputs, rows)
            return world.allreduce(float((y * dout[:, :, mine]).sum()))
        for which in range(3):
            for _ in range(2):
                where = tuple(int(rng.integers(0, n)) for n in local[which].shape)
                numeric = (loss(which, where, 1e-6) - loss(which, where, -1e-6)) / 2e-6
                analytic = world.bcast(float(grads[which][where]) if cp.rank == 0 else None)
                fd.append(abs(numeric - analytic) / max(abs(analytic), 1e-3))
    theory = cp_bytes_per_block("hybrid", B, T, H, Hkv, D, 8, 4, inside=inside_size)
    from mpitrain.backend import BFLOAT16  # bf16: the ring computes in float32, the results come back in bf16
    out16, kept16 = hybrid_attention.forward(cp, *[x.astype(BFLOAT16) for x in local], rows)
    grads16 = hybrid_attention.backward(cp, kept16, dout[:, :, mine].astype(BFLOAT16))
    errors16 = [float(np.abs(a.astype(np.float64) - b[:, :, mine]).max() / np.abs(b).max())
                for a, b in zip((out16, *grads16), (ref, *ref_grads))]
    results[f"{inside_size}{'-docs' if docs else ''}"] = {
        "errors": errors, "fd": fd, "errors16": errors16, "dtypes16": [str(x.dtype) for x in (out16, *grads16)],
        "forward": sent_forward, "backward": sent_backward,
        "theory": {kind: theory[kind] for kind in ("all_to_all", "cp_ring")},
        "kept": [list(x.shape) for x in kept[0][:5]], "declared": [list(shape) for shape, _ in declared]}
everyone = world.gather(results)
if world.rank == 0:
    print("RESULTS " + json.dumps(everyone))
"""


def test_hybrid_layer_equals_one_process_at_every_split_of_cp4():
    """cp 4 with 4 query and 2 K/V heads as 2 nodes x 2 (K/V split over a node), 1 x 4 (replicated: Ulysses) and
    4 x 1 (the ring), causal and packed documents: output and dq/dk/dv equal one process, gradients equal finite
    differences, the bytes each level sends equal cp_bytes_per_block, saved_arrays declares what is kept."""
    for rank in run_python_mpi_results(4, LAYER_SCRIPT, timeout=180):
        for split, got in rank.items():
            assert max(got["errors"]) < 1e-12, (split, got)
            assert max(got["fd"], default=0) < 1e-6, (split, got)
            assert max(got["errors16"]) < 3e-2 and got["dtypes16"] == ["bfloat16"] * 4, (split, got)
            assert got["kept"] == got["declared"], (split, got)
            for counter in ("all_to_all", "cp_ring"):
                for direction in ("forward", "backward"):
                    assert got[direction][counter] == got["theory"][counter][direction], (split, counter, got)
        assert rank["2"]["fd"] and rank["2"]["forward"]["cp_ring"] > 0 and rank["2"]["forward"]["all_to_all"] > 0
        assert rank["4"]["forward"]["cp_ring"] == 0 and rank["1-docs"]["forward"]["all_to_all"] == 0


def test_bytes_formulas_of_the_three_kinds():
    b, t, h, kv, d, e = 2, 64, 8, 2, 16, 2
    q = b * h * t // 4 * d * e  # this rank's Q at cp 4
    ring, ulysses = (cp_bytes_per_block(kind, b, t, h, kv, d, e, 4) for kind in ("ring", "ulysses"))
    full_kv = 2 * b * kv * t * d * e
    assert ring == {"cp_ring": {"forward": 3 / 4 * full_kv, "backward": 3 / 2 * full_kv},
                    "all_to_all": {"forward": 0.0, "backward": 0.0}}
    # 2 K/V heads over 4 ranks: replicated, one head to each rank
    assert ulysses["all_to_all"]["forward"] == ulysses["all_to_all"]["backward"] == 3 / 4 * (2 * q + 2 * q / h * 4)
    hybrid = cp_bytes_per_block("hybrid", b, t, h, kv, d, e, 4, inside=2)
    assert hybrid["all_to_all"]["forward"] == 1 / 2 * (2 * q + 2 * q / h * kv)  # K/V split over the node's 2
    assert hybrid["cp_ring"]["forward"] == 1 / 2 * 2 * b * 1 * t * d * e  # one K/V head per rank, 2 nodes
    assert cp_bytes_per_block("hybrid", b, t, h, kv, d, e, 4, inside=4) == ulysses
    assert cp_bytes_per_block("hybrid", b, t, h, kv, d, e, 4, inside=1) == ring
    step = cp_bytes_per_step("hybrid", b, t, h, kv, d, e, 4, inside=2, blocks=3, micro_batches=2, recompute="full")
    assert step["cp_ring"] == 3 * 2 * (2 * hybrid["cp_ring"]["forward"] + hybrid["cp_ring"]["backward"])


def test_heads_that_do_not_split_over_a_node_and_scattered_nodes_are_refused():
    hybrid = SimpleNamespace(kind="hybrid", inside=SimpleNamespace(size=8))
    with pytest.raises(ConfigError, match="the 4 query and 2 key/value heads per tp rank do not split over the 8 cp "
                                          "ranks per node = 8"):
        check_heads_split(hybrid, 4, 2)
    check_heads_split(SimpleNamespace(kind="hybrid", inside=SimpleNamespace(size=4)), 4, 2)  # K/V replicated
    with pytest.raises(ConfigError, match="do not split over parallel.cp = 4"):
        check_heads_split(ContextParallel(None, size=4, kind="ulysses"), 4, 3)
    group = SimpleNamespace(size=4, rank=1)  # cp rank 1 at position 0 of node 1: nodes hold every other cp rank
    with pytest.raises(LayoutError, match="needs each node's cp ranks consecutive in the cp group: cp rank 1"):
        ContextParallel(group, kind="hybrid", inside=SimpleNamespace(size=2, rank=0),
                        across=SimpleNamespace(size=2, rank=1))
    interleaved = NodeLayout.from_leaders(0, [0, 1, 0, 1], ["a", "b", "a", "b"])  # every rank sees every group
    with pytest.raises(LayoutError, match=r"cp group \[0, 1, 2, 3\] runs on nodes \[0, 1, 0, 1\]"):
        check_cp_blocks_on_nodes(SimpleNamespace(degrees=Degrees(cp=4), nodes=interleaved))
    check_cp_blocks_on_nodes(SimpleNamespace(degrees=Degrees(cp=4), nodes=NodeLayout.blocks(4, 0, 2)))
    shapes_only = ContextParallel(None, size=4, kind="hybrid")  # mpitrain memory: no nodes known, all ring
    assert (shapes_only.inside.size, shapes_only.across.size) == (1, 4)


def test_config_splits_the_cp_group_by_node_under_hybrid_only():
    assert groups_split_by_node(load_config("configs/tiny.toml", ["parallel.cp=4", "parallel.cp_kind=hybrid"])) == \
        ("cp",)
    assert "cp" not in groups_split_by_node(load_config("configs/tiny.toml", ["parallel.cp=4"]))
    with pytest.raises(ConfigError, match="parallel.cp_kind"):
        load_config("configs/tiny.toml", ["parallel.cp=2", "parallel.cp_kind=tree"])


def tiny_bytes_per_step(kind: str, inside: int, tp: int, blocks: int, recompute: str) -> dict[str, float]:
    """cp_bytes_per_step of a configs/tiny.toml llama run with 2 K/V heads at cp 4 in float64 (2 micro-batches of
    4 rows, 4 heads of 8, 2 blocks over the pipeline's stages)."""
    return cp_bytes_per_step(kind, 4, 32, 4 // tp, 2 // tp, 8, 8, 4, inside=inside, blocks=blocks, micro_batches=2,
                             recompute=recompute)


MEMORY_JOB = """
import json
import numpy as np
from mpi4py import MPI
from mpitrain.backend import make_backend, nbytes_of
from mpitrain.comm.mesh import Mesh
from mpitrain.config import ModelConfig
from mpitrain.data.documents import documents_of
from mpitrain.layers.recompute import apply_recompute
from mpitrain.model.gpt import GPT
from mpitrain.parallel.context import ContextParallel, apply_context_parallel, split_sequence
from mpitrain.state.replicated import ReplicatedState

mesh = Mesh(MPI.COMM_WORLD, cp=4, split_by_node=("cp",))  # MPITRAIN_FAKE_NODES=2: 2 cp ranks per node
cfg = ModelConfig(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=16, arch="llama", n_kv_head=2)
tokens = np.random.default_rng(5).integers(0, 64, (2, 16))
out = {}
for mode, packed in (("none", False), ("selective", False), ("full", False), ("none", True), ("selective", True)):
    backend = make_backend("cpu", "float64")
    model = GPT(cfg, backend)
    cp = ContextParallel.of_mesh(mesh, "hybrid")
    apply_context_parallel(model, cp)
    apply_recompute(model, mode)
    model.document_mask = packed  # the whole rows' document ids and positions, kept by the ring's core
    state = ReplicatedState(model.layouts, backend, 0)
    local = split_sequence(tokens, 4, cp.rank)
    loss, saved = model.forward(state, local, split_sequence(np.roll(tokens, -1, axis=1), 4, cp.rank),
                                documents=documents_of(tokens, 0) if packed else None)
    per_micro_batch, shared = model.saved_bytes(2, backend.dtype)
    out[mode + (" packed" if packed else "")] = {"measured": nbytes_of(saved), "declared": per_micro_batch + shared,
                                                 "inside": cp.inside.size}
if MPI.COMM_WORLD.rank == 0:
    print("RESULTS " + json.dumps(out))
"""


def test_hybrid_saved_state_counted_equals_declared():
    """cp 4 as 2 x 2: the arrays one micro-batch's saved state keeps, counted, equal what `mpitrain memory` declares,
    without, with selective and with full recomputation, and with packed documents."""
    out = run_python_mpi_results(4, MEMORY_JOB, timeout=120, env={"MPITRAIN_FAKE_NODES": "2"})
    assert {got["inside"] for got in out.values()} == {2} and len(out) == 5
    for mode, got in out.items():
        assert got["measured"] == got["declared"], (mode, out)
    assert out["full"]["measured"] < out["selective"]["measured"] < out["none"]["measured"]


RUNS = {  # name: (ranks, fake nodes, cp per node, overrides)
    "cp4-2x2-gqa-selective": (4, 2, 2, ["parallel.cp=4", "memory.recompute=selective"]),  # K/V split over a node
    "tp2-cp4-2x2": (8, 2, 2, ["parallel.cp=4", "parallel.tp=2"]),  # one K/V head per tp rank: replicated
    "pp2-cp4-2x2-full": (8, 4, 2, ["parallel.cp=4", "parallel.pp=2", "memory.recompute=full", "parallel.zero=1"]),
}


@pytest.fixture(scope="module")
def single_llama(tmp_path_factory):
    return train_run(1, tmp_path_factory.mktemp("single-llama"), *ARCH["llama"])


@pytest.mark.parametrize("name", list(RUNS))
def test_hybrid_run_on_fake_nodes_matches_one_process(tmp_path, monkeypatch, single_llama, name):
    """Losses every step and the final parameters at 1e-10 against one process; every step's bytes on the cp groups'
    two levels equal cp_bytes_per_step."""
    ranks, nodes, inside, overrides = RUNS[name]
    monkeypatch.setenv("MPITRAIN_FAKE_NODES", str(nodes))
    run = train_run(ranks, tmp_path / name, *ARCH["llama"], *overrides, "parallel.cp_kind=hybrid")
    assert_same_run(single_llama, run, name)
    tp = 2 if "parallel.tp=2" in overrides else 1
    pp = 2 if "parallel.pp=2" in overrides else 1
    recompute = "full" if "memory.recompute=full" in overrides else "none"
    expected = tiny_bytes_per_step("hybrid", inside, tp, blocks=2 // pp, recompute=recompute)
    for record in run[0]:
        assert record["comm_bytes"]["cp_ring"] == expected["cp_ring"], (record["comm_bytes"], expected)
        assert record["comm_bytes"]["all_to_all"] == expected["all_to_all"], (record["comm_bytes"], expected)
    print(f"{name}: bytes per step and rank {expected} (measured cp_ring {run[0][0]['comm_bytes']['cp_ring']:,}, "
          f"all_to_all {run[0][0]['comm_bytes']['all_to_all']:,})")
