"""Context parallelism (parallel.cp): the zig-zag split, ring attention and whole runs at parity with one process.

Parity runs use synthetic tokens (a pure function of seed and step, no dataset to prepare) and float64: every logged
step's loss at 1e-10 and the final parameters of the checkpoint at 1e-10 relative.
"""
from __future__ import annotations

import numpy as np
import pytest

from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.parallel.context import (
    attention_flops_per_rank,
    attention_pairs_per_rank,
    cp_bytes_per_step,
    ring_bytes_per_block,
    ring_pairs_computed,
    split_sequence,
    zigzag_positions,
)
from tests.mpi_helpers import run_python_mpi_results
from tests.test_train_parity import PARITY_STEPS, run_training

RTOL = 1e-10


# ----------------------------------------------------------------------------- pure functions
def test_zigzag_positions_cover_the_sequence_once_in_mirrored_pairs():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 4):
        every = np.concatenate([zigzag_positions(32, cp, r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(32))
    tokens = np.arange(2 * 16).reshape(2, 16)
    assert split_sequence(tokens, 4, 1).tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]


def test_zigzag_balances_causal_attention_work_at_cp4():
    zigzag, contiguous = (attention_flops_per_rank(4096, 4, 32, 128, layout) for layout in ("zigzag", "contiguous"))
    print(f"forward attention FLOPs per rank at cp 4, T 4096, 32 heads of 128: zig-zag {zigzag}, "
          f"contiguous {contiguous}")
    print(f"max / min: zig-zag {max(zigzag) / min(zigzag):.3f}, contiguous {max(contiguous) / min(contiguous):.3f}; "
          f"last rank / mean: contiguous {contiguous[-1] / np.mean(contiguous):.3f}")
    total = 4 * 32 * 128 * 4096 * 4097 // 2
    assert sum(zigzag) == sum(contiguous) == total  # the same causal work, split differently
    assert max(zigzag) / min(zigzag) < 1.05  # in fact equal: m^2 (2c-1) + m (m+1) on every rank
    assert contiguous[-1] / np.mean(contiguous) > 1.7  # the plain split's last rank does ~2x the mean
    assert attention_pairs_per_rank(4096, 4) == [p // (4 * 32 * 128) for p in zigzag]
    for cp in (2, 4, 8):  # what the code runs: 2c+1 chunk pairs on every rank (the fully masked ones skipped)
        assert ring_pairs_computed(cp) == [2 * cp + 1] * cp


def test_config_checks_name_the_key():
    with pytest.raises(ConfigError, match="2 \\* parallel.cp"):  # seq_len 32 is no multiple of 6
        load_config("configs/tiny.toml", ["parallel.cp=3"])
    with pytest.raises(ConfigError, match="tokens per cp rank are not divisible by parallel.tp"):
        load_config("configs/tiny.toml", ["parallel.cp=4", "parallel.tp=8", "model.n_head=8", "model.seq_len=48",
                                          "parallel.sequence_parallel=true"])


def test_memory_plan_counts_a_cp_ranks_tokens():
    from mpitrain.config import resolve_layout
    from mpitrain.plan.memory import activation_bytes, rank_model

    reports = {}
    for cp in (1, 2):
        cfg = load_config("configs/tiny.toml", [f"parallel.cp={cp}", "model.arch=llama"])
        resolve_layout(cfg, cp)
        reports[cp] = activation_bytes(cfg)
    attention = rank_model(cfg).units[1].attention
    assert attention.ring is not None
    b, t, h, d = cfg.train.micro_batch, cfg.model.seq_len // 2, attention.heads, attention.head_dim
    kept = attention.saved_arrays(b, t, np.float32)
    assert ((b, h, t), np.float32) in kept  # ring attention keeps its output's log-sum-exp, no (T/c) x T matrix
    assert not any(len(shape) == 4 and shape[-1] == t and shape[-2] > d for shape, _ in kept)
    print(f"activations per rank, tiny llama: cp 1 {reports[1]:,} B, cp 2 {reports[2]:,} B")
    assert reports[2] < 0.55 * reports[1]  # everything scales with T/c, attention's T x T by more

    from mpitrain.plan.memory import memory_report
    sharded = {}
    for layout in (["parallel.cp=2"], ["parallel.dp=2"]):  # ZeRO shards over dp x cp: the same N = 2 either way
        cfg = load_config("configs/tiny.toml", [*layout, "parallel.zero=1"])
        resolve_layout(cfg, 2)
        sharded[layout[0]] = memory_report(cfg, 34_624)
    assert sharded["parallel.cp=2"]["N"] == 2
    assert sharded["parallel.cp=2"]["bytes"]["optimizer"] == sharded["parallel.dp=2"]["bytes"]["optimizer"]


# ----------------------------------------------------------------------------- ring attention on its own (MPI)
RING_SCRIPT = """
import json
import numpy as np
from mpi4py import MPI
from mpitrain.backend import nbytes_of
from mpitrain.comm.group import Group
from mpitrain.layers import ops, ring_attention
from mpitrain.parallel.context import ContextParallel, ring_bytes_per_block, zigzag_positions

cp = ContextParallel(Group(MPI.COMM_WORLD, "cp"))
rng = np.random.default_rng(0)  # the same full-sequence arrays on every rank
B, H, Hkv, T, D = 2, 4, 2, 24, 8
q, dout = rng.standard_normal((B, H, T, D)), rng.standard_normal((B, H, T, D))
k, v = rng.standard_normal((B, Hkv, T, D)), rng.standard_normal((B, Hkv, T, D))
(ref, _), saved = ops.attention_forward(q, k, v, ops.causal_bias(T, T, np, np.float64))
ref_grads = ops.attention_backward(saved, dout)
mine = zigzag_positions(T, cp.size, cp.rank)
local = [x[:, :, mine] for x in (q, k, v)]
out, kept = ring_attention.forward(cp, *local)
forward_bytes = cp.group.bytes_sent["cp_ring"]
grads = ring_attention.backward(cp, kept, dout[:, :, mine])
errors = [float(np.abs(a - b[:, :, mine]).max() / np.abs(b).max()) for a, b in zip((out, *grads), (ref, *ref_grads))]
kv_full = 2 * B * Hkv * T * D * 8
theory = ring_bytes_per_block(kv_full, cp.size)
declared = [((B, H, T // cp.size, D), np.float64)] + [((B, Hkv, T // cp.size, D), np.float64)] * 2
declared += [((B, H, T // cp.size, D), np.float64), ((B, H, T // cp.size), np.float64)]
sizes = {"kept": nbytes_of(kept), "declared": sum(int(np.prod(s)) * 8 for s, _ in declared)}
total_bytes = cp.group.bytes_sent["cp_ring"]

# bfloat16: computed in float32; q, k, v and the output kept in bf16, the log-sum-exp in float32
from mpitrain.backend import BFLOAT16
low = [x.astype(BFLOAT16) for x in local]
out16, kept16 = ring_attention.forward(cp, *low)
grads16 = ring_attention.backward(cp, kept16, dout[:, :, mine].astype(BFLOAT16))
errors16 = [float(np.abs(a.astype(np.float64) - b[:, :, mine]).max() / np.abs(b).max())
            for a, b in zip((out16, *grads16), (ref, *ref_grads))]
declared16 = sum(int(np.prod(s)) * 2 for s, _ in declared[:4]) + int(np.prod(declared[4][0])) * 4
everyone = MPI.COMM_WORLD.gather({"errors": errors, "forward": forward_bytes, "total": total_bytes, "theory": theory,
                                  "errors16": errors16, "kept16": nbytes_of(kept16), "declared16": declared16,
                                  "dtypes16": [str(x.dtype) for x in kept16], **sizes})
if cp.rank == 0:
    print("RESULTS " + json.dumps(everyone))
"""


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_one_process_and_sends_the_ring_bytes(cp):
    ranks = run_python_mpi_results(cp, RING_SCRIPT, timeout=180)
    for rank in ranks:
        assert max(rank["errors"]) < 1e-12, rank  # output, dq, dk, dv
        # forward: c-1 hops of this rank's K/V, (c-1)/c of the full sequence's; backward: K/V again + dK/dV
        assert rank["forward"] == rank["theory"]["forward"]
        assert rank["total"] - rank["forward"] == rank["theory"]["backward"]
        assert rank["kept"] == rank["declared"]  # saved_arrays' ring declaration is what forward keeps
        assert max(rank["errors16"]) < 3e-2, rank  # bf16 inputs: a few bf16 roundings
        assert rank["dtypes16"] == ["bfloat16"] * 4 + ["float32"] and rank["kept16"] == rank["declared16"]
    full = ranks[0]["theory"]["forward"] * cp / (cp - 1)
    print(f"cp {cp}: ring bytes per rank and block, forward {ranks[0]['forward']:,}, backward "
          f"{ranks[0]['total'] - ranks[0]['forward']:,} (K/V of the full sequence {full:,.0f})")


# ----------------------------------------------------------------------------- whole runs at parity (MPI)
def train_run(n_ranks, run_dir, *overrides, resume=None, expect=0):
    settings = ["data.synthetic=true", "precision.compute=float64", f"train.steps={PARITY_STEPS}",
                "train.eval_batches=1", *overrides]
    return run_training(n_ranks, run_dir, settings, resume=resume, expect=expect, timeout=300)


def assert_same_run(reference, other, what):
    (ref_metrics, ref_params), (metrics, params) = reference, other
    assert [m["step"] for m in metrics] == [m["step"] for m in ref_metrics] == list(range(1, PARITY_STEPS + 1)), what
    for ref, got in zip(ref_metrics, metrics):
        assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL, abs=0), f"{what}, step {got['step']}"
        assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=RTOL, abs=0) if "val_loss" in ref else True
    assert params.keys() == ref_params.keys(), what
    for name, value in ref_params.items():
        err = np.linalg.norm(params[name] - value) / np.linalg.norm(value)
        assert err < RTOL, f"{what}: {name} relative difference {err:.2e}"


ARCH = {"gpt2": ["model.arch=gpt2"], "llama": ["model.arch=llama", "model.n_kv_head=2"]}
LAYOUTS = {  # name: (arch, ranks, overrides)
    "cp2": ("gpt2", 2, ["parallel.cp=2"]),
    "cp4": ("llama", 4, ["parallel.cp=4"]),
    "dp2-cp2-zero2": ("gpt2", 4, ["parallel.cp=2", "parallel.dp=2", "parallel.zero=2"]),
    "cp2-tp2-sp": ("llama", 4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2-pp2-recompute": ("gpt2", 4, ["parallel.cp=2", "parallel.pp=2", "memory.recompute=full"]),
    "tp2-cp2-pp2": ("llama", 8, ["parallel.cp=2", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                                 "parallel.zero=1"]),
}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    runs = {}

    def get(arch):
        if arch not in runs:
            runs[arch] = train_run(1, tmp_path_factory.mktemp(f"single-{arch}"), *ARCH[arch])
        return runs[arch]
    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_run_matches_one_process(tmp_path, single_process, name):
    arch, ranks, overrides = LAYOUTS[name]
    run = train_run(ranks, tmp_path / name, *ARCH[arch], *overrides)
    assert_same_run(single_process(arch), run, name)
    if name == "cp2":  # rank 0's ring bytes per step: 2 blocks x 2 micro-batches x (forward + backward)
        b, t, heads, d = 4, 32, 4, 8  # configs/tiny.toml; gpt2 has as many K/V heads as query heads
        per_block = ring_bytes_per_block(2 * b * heads * t * d * 8, 2)
        expected = 2 * 2 * (per_block["forward"] + per_block["backward"])
        for record in run[0]:
            assert record["comm_bytes"]["cp_ring"] == expected
        print(f"cp2 ring bytes per step and rank: {expected:,.0f} (measured {run[0][0]['comm_bytes']['cp_ring']:,})")
    if name == "cp4":  # llama, 2 K/V heads: the bytes per step of cp_bytes_per_step, the planner's formula
        expected = cp_bytes_per_step("ring", 4, 32, 4, 2, 8, 8, 4, blocks=2, micro_batches=2)
        for record in run[0]:
            assert {kind: record["comm_bytes"][kind] for kind in expected} == expected, record["comm_bytes"]
        print(f"cp4 ring bytes per step and rank: {expected} (measured cp_ring {run[0][0]['comm_bytes']['cp_ring']:,})")


def test_a_cp_checkpoint_resumes_under_another_layout(tmp_path, single_process):
    """Saved by cp 2 x ZeRO-1 (replicas over dp x cp), resumed by dp 2 x ZeRO-2 without cp: the one-process run."""
    run_dir = tmp_path / "moved"
    train_run(2, run_dir, *ARCH["gpt2"], "parallel.cp=2", "parallel.zero=1", "train.stop_at=5", expect=75)
    moved = train_run(2, run_dir, *ARCH["gpt2"], "parallel.zero=2", resume="auto")
    assert_same_run(single_process("gpt2"), moved, "cp 2 -> dp 2")
