"""`mpitrain memory`: the activation estimate against the saved state a tensor-parallel or pipeline rank really
holds (equal to the byte)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.mpi_helpers import REPO_ROOT, run_python_mpi_results

JOB = """
import json, sys
import numpy as np
from mpi4py import MPI
from mpitrain.backend import make_backend, nbytes_of
from mpitrain.comm.mesh import Mesh
from mpitrain.config import load_config, resolve_layout
from mpitrain.model.gpt import GPT
from mpitrain.state.replicated import ReplicatedState
from mpitrain.plan.memory import activation_bytes
world = MPI.COMM_WORLD
cfg = load_config("configs/tiny.toml", sys.argv[1:])
resolve_layout(cfg, world.size)
backend = make_backend("cpu", cfg.precision.compute)
mesh = Mesh(world, tp=cfg.parallel.tp, dp=cfg.parallel.dp)
model = GPT(cfg.model, backend, tp_group=mesh.tp, sequence_parallel=cfg.parallel.sequence_parallel)
state = ReplicatedState(model.layouts, backend, 0)
rng = np.random.default_rng(0)
tokens = rng.integers(0, 256, (cfg.train.micro_batch, cfg.model.seq_len))
_, saved = model.forward(state, tokens, tokens)
if world.rank == 0:
    print("RESULTS " + json.dumps({"measured": nbytes_of(saved), "estimated": activation_bytes(cfg)}))
"""


@pytest.mark.parametrize("overrides", [
    ["parallel.tp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"],
    ["parallel.tp=2", "model.arch=llama", "model.n_kv_head=2", "parallel.sequence_parallel=true"],
    ["parallel.tp=4", "model.arch=llama", "model.n_kv_head=2"],
], ids=["tp2", "tp2-sp", "llama-tp2-sp", "llama-tp4-replicated-kv"])
def test_activation_estimate_under_tensor_parallelism(overrides):
    """Exact: the estimate sums the arrays each sublayer declares it saves (saved_arrays), the same declaration
    tests/test_layers.py checks against the saved state, so it is the bytes a tp rank holds to the byte."""
    numbers = run_python_mpi_results(int(overrides[0][-1]), JOB.replace("sys.argv[1:]", repr(overrides)))
    assert numbers["estimated"] == numbers["measured"], numbers


def test_memory_command_prints_the_formulas():
    out = subprocess.run([sys.executable, "-m", "mpitrain", "memory", "configs/tiny.toml", "-n", "2", "--set",
                          "parallel.zero=3"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert "e*Psi/N" in out.stdout and "2e*Psi/N" in out.stdout and "activations" in out.stdout


PIPELINE_JOB = """
import json
from mpi4py import MPI
from mpitrain.config import load_config
from mpitrain.plan.memory import activation_bytes
from mpitrain.train import Trainer
cfg = load_config("configs/tiny.toml", OVERRIDES)
trainer = Trainer(cfg, MPI.COMM_WORLD)
trainer.train_step(0)
rank = MPI.COMM_WORLD.rank  # pp = world: pipeline rank = world rank
numbers = MPI.COMM_WORLD.gather({"measured": trainer.pipeline.activation_peak_bytes,
                                 "estimated": activation_bytes(cfg, pp_rank=rank)}, root=0)
if rank == 0:
    print("RESULTS " + json.dumps(numbers))
"""


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_activation_estimate_of_the_first_and_last_stage(schedule):
    """The first stage holds the embedding and the most micro-batches (1F1B: p), the last the head's probabilities
    (b, T, V) for fewer (1F1B: 1): each stage's estimate is its measured peak, to the byte."""
    overrides = ["data.synthetic=true", "logging.peak_flops=1e9", "parallel.pp=2", "model.n_layer=4",
                 "train.micro_batch=1", f"parallel.schedule={schedule}"]
    first, last = run_python_mpi_results(2, PIPELINE_JOB.replace("OVERRIDES", repr(overrides)))
    assert first["estimated"] == first["measured"], first  # the declared bytes times the schedule's peak
    assert last["estimated"] == last["measured"], last
    assert last["estimated"] != first["estimated"]  # the stages differ: one number for both would not do


def _activations(seq_len: int, attention: str, *overrides: str) -> int:
    from mpitrain.config import load_config, resolve_layout
    from mpitrain.plan.memory import activation_bytes
    cfg = load_config("configs/tiny.toml", ["precision.compute=bfloat16", f"model.seq_len={seq_len}", *overrides])
    resolve_layout(cfg, 1)
    return activation_bytes(cfg, attention=attention)


@pytest.mark.parametrize("arch", [["model.arch=gpt2"], ["model.arch=llama", "model.n_kv_head=2"]])
def test_fused_attention_count_has_no_t_squared_term(arch):
    """The fused attention saves the output and each row's float32 log-sum-exp instead of the (b, h, T, T)
    probabilities: doubling T doubles its count, while the unfused count gains the T x T term per block."""
    b, layers, heads, head_dim, t = 4, 2, 4, 8, 32  # configs/tiny.toml: micro-batch 4, 2 blocks of 4 heads of 8
    fused = {n: _activations(n, "fused", *arch) for n in (t, 2 * t)}
    unfused = {n: _activations(n, "unfused", *arch) for n in (t, 2 * t)}
    assert fused[2 * t] == 2 * fused[t]
    probabilities = layers * b * heads * 2  # bf16 bytes of the T x T matrices per T^2
    assert unfused[2 * t] - 2 * unfused[t] == probabilities * (2 * t) ** 2 - 2 * probabilities * t ** 2
    instead = layers * b * heads * t * (head_dim * 2 + 4)  # the output (bf16) and log-sum-exp (float32)
    assert fused[t] == unfused[t] - probabilities * t ** 2 + instead


@pytest.mark.parametrize("overrides", [["memory.recompute=selective"], ["memory.recompute=full"],
                                       ["parallel.cp=2", "parallel.dp=1", "train.micro_batch=4"]])
def test_fused_and_unfused_counts_agree_where_no_probabilities_are_kept(overrides):
    """Recomputing blocks keep no probabilities, and ring attention (cp > 1) keeps the output and log-sum-exp
    already: the fused count changes nothing there."""
    from mpitrain.config import load_config, resolve_layout
    from mpitrain.plan.memory import activation_bytes
    cfg = load_config("configs/tiny.toml", ["precision.compute=bfloat16", *overrides])
    resolve_layout(cfg, cfg.parallel.cp)
    assert activation_bytes(cfg, attention="fused") == activation_bytes(cfg, attention="unfused")


def test_default_attention_is_fused_only_on_a_gpu_in_bf16_or_fp16():
    from mpitrain.plan.memory import default_attention
    assert [default_attention(compute, on_gpu) for compute, on_gpu in
            [("bfloat16", True), ("float16", True), ("float32", True), ("bfloat16", False)]] == \
        ["fused", "fused", "unfused", "unfused"]


MOE = "model.moe={experts = 4, top_k = 2, every = 2}"


@pytest.mark.parametrize("model", [["model.arch=llama", "model.n_kv_head=2", MOE], ["model.arch=gpt2"]],
                         ids=["llama-moe", "gpt2"])
def test_deferred_weight_gradient_bytes_are_what_a_split_backward_holds(model):
    """zb1p's deferred work per micro-batch (deferred_bytes_per_micro_batch) is the bytes of the work items a
    one-process backward with `deferred` leaves, to the byte, in bf16: the FP8 linears' dequantized x and dy in
    float32 under precision.fp8 (twice the bf16 bytes), the head's in bf16; a MoE layer's router and experts take
    their weight gradients at once and leave nothing."""
    import numpy as np

    from mpitrain.backend import make_backend, nbytes_of
    from mpitrain.config import load_config, resolve_layout
    from mpitrain.layers.fp8 import apply_fp8
    from mpitrain.model.gpt import GPT
    from mpitrain.plan.memory import deferred_bytes_per_micro_batch
    from mpitrain.state.replicated import ReplicatedState
    held = {}
    for recipe in ("none", "tensor"):
        cfg = load_config("configs/tiny.toml", ["precision.compute=bfloat16", f"precision.fp8={recipe}", *model])
        resolve_layout(cfg, 1)
        backend = make_backend("cpu", "bfloat16")
        gpt = GPT(cfg.model, backend)
        apply_fp8(gpt.units, recipe)
        state = ReplicatedState(gpt.layouts, backend, 0)
        tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_len))
        _, saved = gpt.forward(state, tokens, np.roll(tokens, -1, axis=1))
        deferred = {}
        gpt.backward(state, saved, 1.0, deferred=deferred)
        held[recipe] = nbytes_of(deferred)
        assert deferred_bytes_per_micro_batch(cfg, cfg.train.micro_batch) == held[recipe], recipe
    assert held["tensor"] > held["none"]  # the float32 operands really are counted
