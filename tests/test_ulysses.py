"""Ulysses context parallelism (parallel.cp_kind = "ulysses"): the layer against one process, its gradients by finite
differences, its all-to-all bytes, and whole runs at parity with one process in float64."""
from __future__ import annotations

import numpy as np
import pytest

from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.layers.ulysses_attention import bytes_per_block
from mpitrain.parallel.context import cp_bytes_per_step
from mpitrain.plan.cost import ulysses_bytes_per_micro_batch
from tests.mpi_helpers import run_python_mpi_results
from tests.test_context_parallel import ARCH, assert_same_run, train_run

LAYER_SCRIPT = """
import json
import numpy as np
from mpi4py import MPI
from mpitrain.comm.group import Group
from mpitrain.data.documents import documents_of
from mpitrain.layers import attention_core, ops, ulysses_attention
from mpitrain.parallel.context import ContextParallel, zigzag_positions

cp = ContextParallel(Group(MPI.COMM_WORLD, "cp"), kind="ulysses")
rng = np.random.default_rng(0)  # the same full-sequence arrays on every rank
B, H, Hkv, T, D = 2, 4, HKV, 16, 4
q, dout = rng.standard_normal((B, H, T, D)), rng.standard_normal((B, H, T, D))
k, v = rng.standard_normal((B, Hkv, T, D)), rng.standard_normal((B, Hkv, T, D))
tokens = rng.integers(0, 4, (B, T))  # packed documents: a new one after every 0
documents = documents_of(tokens, 0) if DOCS else None
if DOCS:
    mask = attention_core.document_bias(documents.ids, documents.positions, documents.ids, documents.positions, np,
                                        np.float64)
else:
    mask = ops.causal_bias(T, T, np, np.float64)
(ref, _), saved = ops.attention_forward(q, k, v, mask)
ref_grads = ops.attention_backward(saved, dout)
mine = zigzag_positions(T, cp.size, cp.rank)
local = [np.ascontiguousarray(x[:, :, mine]) for x in (q, k, v)]
whole_rows = None if documents is None else (documents.ids, documents.positions)
out, kept = ulysses_attention.forward(cp, *local, whole_rows)
forward_bytes = cp.group.bytes_sent["all_to_all"]
grads = ulysses_attention.backward(cp, kept, np.ascontiguousarray(dout[:, :, mine]))
backward_bytes = cp.group.bytes_sent["all_to_all"] - forward_bytes
errors = [float(np.abs(a - b[:, :, mine]).max() / np.abs(b).max()) for a, b in zip((out, *grads), (ref, *ref_grads))]
theory = ulysses_attention.bytes_per_block(local[0].nbytes, local[1].nbytes, Hkv, cp.size)
declared = ulysses_attention.saved_arrays(B, H, Hkv, T // cp.size, D, cp.size, np.float64)
kept_core = {"kept": [list(x.shape) for x in kept[0][:5]], "declared": [list(shape) for shape, _ in declared]}

def loss(shifted, which, where, eps):  # sum(out * dout) over all ranks, one element of rank 0's inputs moved
    inputs = [x.copy() for x in local]
    if cp.rank == 0 and shifted:
        inputs[which][where] += eps
    y, _ = ulysses_attention.forward(cp, *inputs, whole_rows)
    return MPI.COMM_WORLD.allreduce(float((y * dout[:, :, mine]).sum()))

fd_errors = []
for which in range(3):  # q, k, v: finite differences of rank 0's inputs against the analytic gradient
    for _ in range(3):
        where = tuple(int(rng.integers(0, n)) for n in local[which].shape)
        eps = 1e-6
        numeric = (loss(True, which, where, eps) - loss(True, which, where, -eps)) / (2 * eps)
        analytic = MPI.COMM_WORLD.bcast(float(grads[which][where]) if cp.rank == 0 else None)
        fd_errors.append(abs(numeric - analytic) / max(abs(analytic), 1e-3))
from mpitrain.backend import BFLOAT16  # bf16: the core computes in float32, the results come back in bf16
out16, kept16 = ulysses_attention.forward(cp, *[x.astype(BFLOAT16) for x in local], whole_rows)
grads16 = ulysses_attention.backward(cp, kept16, dout[:, :, mine].astype(BFLOAT16))
errors16 = [float(np.abs(a.astype(np.float64) - b[:, :, mine]).max() / np.abs(b).max())
            for a, b in zip((out16, *grads16), (ref, *ref_grads))]
dtypes16 = [str(x.dtype) for x in (out16, *grads16)]
everyone = MPI.COMM_WORLD.gather({"errors16": errors16, "dtypes16": dtypes16,
                                  "errors": errors, "forward": forward_bytes, "backward": backward_bytes,
                                  "theory": theory, "fd": fd_errors, **kept_core})
if cp.rank == 0:
    print("RESULTS " + json.dumps(everyone))
"""


@pytest.mark.parametrize("cp, kv_heads, documents", [(2, 4, False), (2, 2, True), (4, 2, False), (4, 1, True)])
def test_ulysses_layer_equals_one_process_with_finite_difference_gradients(cp, kv_heads, documents):
    """K/V heads split (kv_heads a multiple of cp) and replicated (cp a multiple of kv_heads), causal and packed
    documents: output and dq/dk/dv equal one process, the gradients equal finite differences of the distributed
    forward, and the all-to-all bytes equal bytes_per_block."""
    script = LAYER_SCRIPT.replace("HKV", str(kv_heads)).replace("DOCS", str(documents))
    for rank in run_python_mpi_results(cp, script, timeout=180):
        assert max(rank["errors"]) < 1e-12, rank  # output, dq, dk, dv
        assert max(rank["fd"]) < 1e-6, rank
        assert rank["forward"] == rank["theory"]["forward"] and rank["backward"] == rank["theory"]["backward"]
        assert rank["kept"] == rank["declared"]  # saved_arrays declares the core forward keeps
        assert max(rank["errors16"]) < 3e-2 and rank["dtypes16"] == ["bfloat16"] * 4, rank


def test_config_refuses_heads_that_do_not_split():
    with pytest.raises(ConfigError, match="heads cannot be split evenly"):  # tiny: 4 heads, seq_len 32
        load_config("configs/tiny.toml", ["parallel.cp=8", "parallel.cp_kind=ulysses"])
    with pytest.raises(ConfigError, match="parallel.tp = 2\\) are not divisible by parallel.cp = 4"):
        load_config("configs/tiny.toml", ["parallel.cp=4", "parallel.tp=2", "parallel.cp_kind=ulysses"])


def test_memory_plan_counts_the_whole_sequence_of_a_ranks_heads():
    from mpitrain.config import resolve_layout
    from mpitrain.plan.memory import activation_bytes, rank_model

    cfg = load_config("configs/tiny.toml", ["parallel.cp=2", "parallel.cp_kind=ulysses", "model.arch=llama",
                                            "model.n_kv_head=2"])
    resolve_layout(cfg, 2)
    attention = rank_model(cfg).units[1].attention
    assert attention.ulysses is not None and attention.ring is None
    b, t, d = cfg.train.micro_batch, cfg.model.seq_len, attention.head_dim
    kept = attention.saved_arrays(b, t // 2, np.float32)
    assert ((b, 2, t, d), np.float32) in kept and ((b, 1, 2 * t, t), np.float32) in kept  # 2 of 4 heads, all T
    ring = load_config("configs/tiny.toml", ["parallel.cp=2", "model.arch=llama", "model.n_kv_head=2"])
    resolve_layout(ring, 2)
    print(f"activations per rank, tiny llama cp 2: ulysses {activation_bytes(cfg):,} B, "
          f"ring {activation_bytes(ring):,} B")
    assert activation_bytes(cfg) > activation_bytes(ring)  # the probabilities of whole sequences, not lse


def test_plan_bytes_formula():
    cfg = load_config("configs/tiny.toml", ["parallel.cp=4", "parallel.cp_kind=ulysses", "model.arch=llama",
                                            "model.n_kv_head=2"])
    b, t, h, d = cfg.train.micro_batch, cfg.model.seq_len, cfg.model.n_head, cfg.model.head_dim
    q = b * t // 4 * h * d * 8  # float64 Q of T/4 tokens; K/V replicated: one head to each of the 4 ranks
    assert ulysses_bytes_per_micro_batch(cfg, 8, 2) == 2 * 2 * 3 / 4 * (2 * q + 2 * q)


MEMORY_JOB = """
import json
import numpy as np
from mpi4py import MPI
from mpitrain.backend import make_backend, nbytes_of
from mpitrain.comm.mesh import Mesh
from mpitrain.config import ModelConfig
from mpitrain.layers.recompute import apply_recompute
from mpitrain.model.gpt import GPT
from mpitrain.parallel.context import ContextParallel, apply_context_parallel, split_sequence
from mpitrain.state.replicated import ReplicatedState

mesh = Mesh(MPI.COMM_WORLD, dp=1, cp=2)
cfg = ModelConfig(n_layer=3, d_model=32, n_head=4, vocab_size=64, seq_len=16, **VARIANT)
tokens = np.random.default_rng(5).integers(0, 64, (2, 16))
out = {}
for mode in ("none", "selective", "full"):
    backend = make_backend("cpu", "float64")
    model = GPT(cfg, backend)
    apply_context_parallel(model, ContextParallel(mesh.cp, kind="ulysses"))
    apply_recompute(model, mode)
    state = ReplicatedState(model.layouts, backend, 0)
    local = split_sequence(tokens, 2, mesh.cp.rank)
    loss, saved = model.forward(state, local, split_sequence(np.roll(tokens, -1, axis=1), 2, mesh.cp.rank))
    per_micro_batch, shared = model.saved_bytes(2, backend.dtype)
    out[mode] = {"measured": nbytes_of(saved), "declared": per_micro_batch + shared}
if MPI.COMM_WORLD.rank == 0:
    print("RESULTS " + json.dumps(out))
"""


@pytest.mark.parametrize("variant", [{}, {"arch": "llama", "n_kv_head": 2}])
def test_saved_state_counted_equals_declared(variant):
    """cp 2 ulysses: the arrays one micro-batch's saved state keeps, counted, equal what `mpitrain memory`
    declares, without, with selective and with full recomputation."""
    out = run_python_mpi_results(2, MEMORY_JOB.replace("VARIANT", repr(variant)), timeout=120)
    for mode in out:
        assert out[mode]["measured"] == out[mode]["declared"], (mode, out)


LAYOUTS = {  # name: (arch, ranks, overrides)
    "cp2-gpt2": ("gpt2", 2, ["parallel.cp=2"]),
    "cp2-llama-gqa": ("llama", 2, ["parallel.cp=2"]),  # 2 K/V heads over 2 ranks: split
    "cp4-llama-gqa": ("llama", 4, ["parallel.cp=4"]),  # 2 K/V heads over 4 ranks: replicated
    "cp2-tp2-llama-selective": ("llama", 4, ["parallel.cp=2", "parallel.tp=2", "memory.recompute=selective"]),
    "cp2-pp2-recompute": ("gpt2", 4, ["parallel.cp=2", "parallel.pp=2", "memory.recompute=full"]),
}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    runs = {}

    def get(arch, *extra):
        if (arch, extra) not in runs:
            runs[arch, extra] = train_run(1, tmp_path_factory.mktemp(f"single-{arch}"), *ARCH[arch], *extra)
        return runs[arch, extra]
    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ulysses_run_matches_one_process(tmp_path, single_process, name):
    arch, ranks, overrides = LAYOUTS[name]
    run = train_run(ranks, tmp_path / name, *ARCH[arch], *overrides, "parallel.cp_kind=ulysses")
    assert_same_run(single_process(arch), run, name)
    if name == "cp2-gpt2":  # rank 0's all-to-all bytes per step: 2 blocks x 2 micro-batches x (forward + backward)
        b, t, heads, d = 4, 32, 4, 8  # configs/tiny.toml; gpt2 has as many K/V heads as query heads
        local = b * heads * (t // 2) * d * 8
        per_block = bytes_per_block(local, local, heads, 2)
        expected = 2 * 2 * (per_block["forward"] + per_block["backward"])
        cfg = load_config("configs/tiny.toml", [*ARCH[arch], *overrides, "parallel.cp_kind=ulysses"])
        assert 2 * ulysses_bytes_per_micro_batch(cfg, 8, 2) == expected  # the plan's formula, 2 micro-batches
        for record in run[0]:
            assert record["comm_bytes"]["all_to_all"] == expected
            assert record["comm_bytes"]["cp_ring"] == 0
        print(f"cp2 ulysses all-to-all bytes per step and rank: {expected:,.0f}")
    if name == "cp4-llama-gqa":  # 2 K/V heads over 4 ranks: replicated; cp_bytes_per_step, the planner's formula
        expected = cp_bytes_per_step("ulysses", 4, 32, 4, 2, 8, 8, 4, blocks=2, micro_batches=2)
        for record in run[0]:
            assert {kind: record["comm_bytes"][kind] for kind in expected} == expected, record["comm_bytes"]
        print(f"cp4 ulysses bytes per step and rank: {expected} (measured all_to_all "
              f"{run[0][0]['comm_bytes']['all_to_all']:,})")


def test_ulysses_with_packed_documents_matches_one_process(tmp_path, single_process):
    documents = ("data.document_mask=true",)
    run = train_run(2, tmp_path / "docs", *ARCH["llama"], "parallel.cp=2", "parallel.cp_kind=ulysses", *documents)
    assert_same_run(single_process("llama", *documents), run, "cp2 ulysses, packed documents")
