"""Activation recomputation (memory.recompute): exact, and the saved bytes it promises, measured.

Exact: a block recomputes with the same operations on the same inputs, so losses and gradients equal the run
without recomputation; in one process bitwise (LoRA adapters too), and under tp 2 with SP, pp 2 (zb1p: weight
gradients deferred) and dp 2 with ZeRO-1 the real trainer gives the same losses and parameters (float64, 1e-12).
Bytes: the arrays actually saved by one micro-batch, counted (backend.nbytes_of), equal the declaration `mpitrain
memory` sums, and at configs/bench-small.toml's depth full keeps <= 1/8 and selective <= 1/2 of none.
"""
from __future__ import annotations

import numpy as np
import pytest

from mpitrain.backend import make_backend, nbytes_of
from mpitrain.config import LoraConfig, ModelConfig, load_config
from mpitrain.errors import ConfigError
from mpitrain.layers.fp8 import apply_fp8
from mpitrain.layers.recompute import apply_recompute
from mpitrain.model.gpt import GPT
from mpitrain.plan.memory import activation_bytes
from mpitrain.state.replicated import ReplicatedState
from tests.mpi_helpers import run_python_mpi_results

SMALL = {"n_layer": 3, "d_model": 32, "n_head": 4, "vocab_size": 64, "seq_len": 16}
VARIANTS = {"gpt2": {}, "llama": {"arch": "llama", "n_kv_head": 2}}


def one_step(cfg: ModelConfig, mode: str, layers: int = 0, dtype="float64", batch: int = 2, backward=True,
             lora=None, fp8="none"):
    """Loss, gradients, measured and declared saved bytes of one micro-batch through the model in one process."""
    backend = make_backend("cpu", dtype)
    model = GPT(cfg, backend, lora=lora)
    apply_fp8(model.units, fp8)
    apply_recompute(model, mode, layers)
    state = ReplicatedState(model.layouts, backend, 0)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (batch, cfg.seq_len))
    loss, saved = model.forward(state, tokens, np.roll(tokens, -1, axis=1))
    measured = nbytes_of(saved)
    if backward:
        model.backward(state, saved, 1.0 / tokens.size)
    return float(loss), state.grads.data.copy(), measured, model.saved_bytes(batch, backend.dtype)


@pytest.mark.parametrize("arch", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_recomputation_gives_the_same_loss_and_gradients_bitwise(arch, dtype):
    cfg = ModelConfig(**SMALL, **VARIANTS[arch])
    loss, grads, _, _ = one_step(cfg, "none", dtype=dtype)
    assert np.any(grads.astype(np.float64))
    for mode, layers in [("selective", 0), ("full", 0), ("full", 2), ("selective", 1)]:
        other_loss, other_grads, _, _ = one_step(cfg, mode, layers, dtype=dtype)
        assert other_loss == loss, (mode, layers)
        assert np.array_equal(other_grads, grads), (mode, layers)


def test_recomputation_with_lora_adapters_is_bitwise():
    """LoRA's adapters recompute their own intermediate from the linear's saved input: selective keeps it."""
    cfg, lora = ModelConfig(**SMALL, **VARIANTS["llama"]), LoraConfig(rank=2, targets=["wq", "wv", "w_up", "w_down"])
    loss, grads, _, _ = one_step(cfg, "none", lora=lora)
    assert np.any(grads)
    for mode in ("selective", "full"):
        other_loss, other_grads, _, _ = one_step(cfg, mode, lora=lora)
        assert other_loss == loss and np.array_equal(other_grads, grads), mode


@pytest.mark.parametrize("recipe", ["tensor", "delayed", "block", "mxfp8"])
def test_recomputation_under_fp8_multiplies_the_forwards_quantized_inputs_bitwise(recipe):
    """Selective recomputation enters qkv's and up's inputs again quantized as the forward did (per-tensor recipes:
    by the forward's kept amax), so their weight gradients are bitwise those without recomputation; the kept amax
    is a float, not an array the declared saved bytes miss."""
    cfg = ModelConfig(**SMALL, **VARIANTS["llama"])
    loss, grads, _, _ = one_step(cfg, "none", fp8=recipe)
    assert loss != one_step(cfg, "none")[0]  # FP8 changed the step
    for mode in ("selective", "full"):
        other_loss, other_grads, measured, (per_micro_batch, shared) = one_step(cfg, mode, fp8=recipe)
        assert other_loss == loss and np.array_equal(other_grads, grads), mode
        assert measured == per_micro_batch + shared, mode


@pytest.mark.parametrize("arch", sorted(VARIANTS))
@pytest.mark.parametrize("mode, layers", [("none", 0), ("selective", 0), ("full", 0), ("full", 1)])
def test_the_declared_saved_bytes_are_the_bytes_saved(arch, mode, layers):
    """GPT.saved_bytes (what `mpitrain memory` counts) equals the arrays the saved state keeps alive, per mode."""
    cfg = ModelConfig(**SMALL, **VARIANTS[arch])
    _, _, measured, (per_micro_batch, shared) = one_step(cfg, mode, layers)
    assert measured == per_micro_batch + shared


def test_bench_small_full_keeps_an_eighth_and_selective_a_half():
    """Measured on the arrays one micro-batch of configs/bench-small.toml really saves (float32)."""
    cfg = load_config("configs/bench-small.toml").model
    measured = {mode: one_step(cfg, mode, dtype="float32", batch=8, backward=False)[2]
                for mode in ("none", "selective", "full")}
    assert measured["full"] <= measured["none"] / 8, measured
    assert measured["selective"] <= measured["none"] / 2, measured


def test_memory_plan_counts_each_mode():
    """`mpitrain memory`'s activation line follows memory.recompute and memory.recompute_layers."""
    def bytes_for(*overrides):
        return activation_bytes(load_config("configs/bench-small.toml", ["precision.compute=float32", *overrides]))
    none, full, selective = bytes_for(), bytes_for("memory.recompute=full"), bytes_for("memory.recompute=selective")
    first_two = bytes_for("memory.recompute=full", "memory.recompute_layers=2")
    assert full < selective < none and full < first_two < none


@pytest.mark.parametrize("setting", ["memory.recompute=some", "memory.recompute_layers=-1"])
def test_bad_settings_name_the_key(setting):
    with pytest.raises(ConfigError, match=setting.split("=")[0]):
        load_config("configs/tiny.toml", [setting])


JOB = """
import json
import numpy as np
from mpi4py import MPI
from mpitrain.config import load_config
from mpitrain.train import Trainer

def run(*overrides):
    cfg = load_config("configs/tiny.toml", ["precision.compute=float64", "data.synthetic=true", *LAYOUT, *overrides])
    trainer = Trainer(cfg, MPI.COMM_WORLD)
    losses = [trainer.train_step(step).loss for step in range(1, 4)]
    params = np.concatenate([np.ravel(segment.params) for segment in trainer.state.optimizer_segments()])
    return losses, params

reference_losses, reference = run()
worst = {}
for mode in MODES:
    losses, params = run(*mode)
    loss_error = max(abs(a - b) / abs(a) for a, b in zip(losses, reference_losses))
    param_error = float(np.linalg.norm(params - reference) / np.linalg.norm(reference))
    worst[" ".join(mode)] = max(MPI.COMM_WORLD.allgather(max(loss_error, param_error)))
if MPI.COMM_WORLD.rank == 0:
    print("RESULTS " + json.dumps(worst))
"""

LAYOUTS = {
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2-zb1p": ["parallel.pp=2", "train.micro_batch=2", "parallel.schedule=zb1p"],  # weight gradients deferred
    "dp2-zero1": ["parallel.dp=2", "parallel.zero=1"],
}
MODES = [("memory.recompute=selective",), ("memory.recompute=full",),
         ("memory.recompute=full", "memory.recompute_layers=1")]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_training_with_recomputation_is_exact_across_layouts(layout):
    """3 steps of the real trainer per mode against no recomputation in the same layout: every rank's parameters
    and the losses agree to 1e-12 (relative)."""
    job = JOB.replace("LAYOUT", repr(LAYOUTS[layout])).replace("MODES", repr(MODES))
    worst = run_python_mpi_results(2, job, timeout=600)
    assert len(worst) == len(MODES) and all(error <= 1e-12 for error in worst.values()), worst


MOE = {"gpt2": {"moe": {"experts": 4, "top_k": 2}},
       "llama": {"arch": "llama", "n_kv_head": 2, "moe": {"experts": 4, "top_k": 2, "capacity_factor": 0.75}}}


@pytest.mark.parametrize("arch", sorted(MOE))
def test_moe_blocks_recompute_bitwise_and_selective_keeps_less(arch):
    """MoE blocks: selective keeps the routing and the experts' inputs and recomputes only the norms and the
    experts' nonlinearities; the same loss and gradients bitwise, and at least the dropped arrays' bytes fewer than
    none (a capacity-dropped pick has no nonlinearity output: 3/4 of them with capacity factor 0.75)."""
    cfg = ModelConfig(**SMALL, **MOE[arch])
    loss, grads, none_bytes, _ = one_step(cfg, "none")
    assert np.any(grads)
    measured = {}
    for mode in ("selective", "full"):
        other_loss, other_grads, measured[mode], _ = one_step(cfg, mode)
        assert other_loss == loss and np.array_equal(other_grads, grads), mode
    assert measured["full"] < measured["selective"] < none_bytes, (measured, none_bytes)
    # what selective drops per MoE block: the entered input (B T C) and the nonlinearity's output (N k F)
    n, width = 2 * SMALL["seq_len"], 4 * SMALL["d_model"]
    dropped = 3 * 8 * (n * SMALL["d_model"] + n * 2 * width)
    assert none_bytes - measured["selective"] >= dropped * (0.75 if "capacity_factor" in str(MOE[arch]) else 1)


@pytest.mark.parametrize("arch, extra", [("gpt2", []), ("llama", ["data.document_mask=true"])])
def test_ring_attention_selective_recomputation_matches_one_process(tmp_path, arch, extra):
    """cp 2 with selective recomputation (the ring's core kept whole, norms and entries recomputed) against one
    process without recomputation: losses and parameters at 1e-10 in float64 (packed documents: their masks ride
    in the kept core)."""
    from tests.test_context_parallel import ARCH, assert_same_run, train_run
    reference = train_run(1, tmp_path / "one", *ARCH[arch], *extra)
    ring = train_run(2, tmp_path / "cp2", *ARCH[arch], *extra, "parallel.cp=2", "memory.recompute=selective")
    assert_same_run(reference, ring, f"cp 2 selective, {arch}")


def test_moe_blocks_with_expert_adapters_recompute_bitwise():
    """LoRA on the experts: their adapters recompute x a from the kept dispatched rows and nonlinearity outputs."""
    cfg = ModelConfig(**SMALL, **MOE["llama"])
    lora = LoraConfig(rank=2, targets=["wq", "expert_w_gate", "expert_w_down", "router"])
    loss, grads, _, _ = one_step(cfg, "none", lora=lora)
    assert np.any(grads)
    for mode in ("selective", "full"):
        other_loss, other_grads, _, _ = one_step(cfg, mode, lora=lora)
        assert other_loss == loss and np.array_equal(other_grads, grads), mode


def test_selective_under_ring_attention_recomputes_no_attention_flops():
    from mpitrain.profile.flops import recomputed_flops_per_token
    cfg = ModelConfig(**SMALL)
    assert recomputed_flops_per_token(cfg, [3], "selective", ring=True) == 0.0
    assert recomputed_flops_per_token(cfg, [3], "selective") == 3 * 4.0 * cfg.d_model * cfg.seq_len
    assert recomputed_flops_per_token(cfg, [3], "full", ring=True) == recomputed_flops_per_token(cfg, [3], "full")


RING_MEMORY_JOB = """
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
for mode in ("none", "selective"):
    backend = make_backend("cpu", "float64")
    model = GPT(cfg, backend)
    apply_context_parallel(model, ContextParallel(mesh.cp))
    apply_recompute(model, mode)
    state = ReplicatedState(model.layouts, backend, 0)
    local = split_sequence(tokens, 2, mesh.cp.rank)
    loss, saved = model.forward(state, local, split_sequence(np.roll(tokens, -1, axis=1), 2, mesh.cp.rank))
    per_micro_batch, shared = model.saved_bytes(2, backend.dtype)
    out[mode] = {"measured": nbytes_of(saved), "declared": per_micro_batch + shared}
if MPI.COMM_WORLD.rank == 0:
    print("RESULTS " + json.dumps(out))
"""


@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_ring_attention_selective_keeps_less_than_none_and_says_so(arch):
    """cp 2: the arrays one micro-batch's saved state keeps, counted, equal what `mpitrain memory` declares, and
    selective (the ring's core kept, the norms' states, the projections' inputs and the nonlinearity's output
    dropped) keeps less than none."""
    out = run_python_mpi_results(2, RING_MEMORY_JOB.replace("VARIANT", repr(VARIANTS[arch])), timeout=120)
    print(f"cp 2, {arch}: selective keeps {out['selective']['measured'] / out['none']['measured']:.2f} of none")
    for mode in out:
        assert out[mode]["measured"] == out[mode]["declared"], (mode, out)
    assert out["selective"]["measured"] < 0.8 * out["none"]["measured"], out
