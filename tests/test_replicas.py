"""Thread replicas (mpitrain/parallel/replicas.py): a micro-batch's rows split over threads give one pass's loss and
gradients (float64: the same sums in another order), never hang when a replica fails, and are refused by name where
the layout communicates inside the layers. The whole training run under replicas, at dp 1 and 2, is checked against
one thread in tests/test_train_parity.py."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from mpitrain.backend import make_backend
from mpitrain.config import LoraConfig, ModelConfig, load_config
from mpitrain.errors import ConfigError
from mpitrain.layers.recompute import apply_recompute
from mpitrain.model.gpt import GPT
from mpitrain.parallel.replicas import ThreadReplicas, replica_count, replica_rows
from mpitrain.profile.breakdown import Breakdown
from mpitrain.state.replicated import ReplicatedState

SMALL = {"n_layer": 2, "d_model": 32, "n_head": 4, "vocab_size": 64, "seq_len": 16}
VARIANTS = {"gpt2": {}, "llama": {"arch": "llama", "n_kv_head": 2}}
RTOL = 1e-12


def test_rows_are_contiguous_even_and_never_empty():
    assert replica_rows(8, 2) == [slice(0, 4), slice(4, 8)]
    assert replica_rows(5, 3) == [slice(0, 1), slice(1, 3), slice(3, 5)]
    assert replica_rows(2, 4) == [slice(0, 1), slice(1, 2)]  # fewer rows than replicas: one row each


def one_pass(cfg: ModelConfig, replicas: int, batch: int = 5, micro_batches: int = 2, lora=None, recompute="none"):
    """Loss sums and gradients of `micro_batches` micro-batches accumulated into one state, in float64."""
    backend = make_backend("cpu", "float64")
    model = GPT(cfg, backend, lora=lora)
    apply_recompute(model, recompute, 0)
    state = ReplicatedState(model.layouts, backend, 0)
    runner = ThreadReplicas(model, replicas) if replicas > 1 else model
    rng, losses = np.random.default_rng(5), []
    for _ in range(micro_batches):
        tokens = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))
        loss, saved = runner.forward(state, tokens, np.roll(tokens, -1, axis=1), loss_scale=1.0)
        runner.backward(state, saved, 1.0 / tokens.size)
        losses.append(float(loss))
    return losses, state.grads.data.copy()


@pytest.mark.parametrize("arch", sorted(VARIANTS))
@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_give_one_pass_loss_and_gradients(arch, replicas):
    cfg = ModelConfig(**SMALL, **VARIANTS[arch])
    losses, grads = one_pass(cfg, 1)
    other_losses, other_grads = one_pass(cfg, replicas)
    assert other_losses == pytest.approx(losses, rel=RTOL)
    assert np.any(grads)
    assert np.linalg.norm(other_grads - grads) / np.linalg.norm(grads) < RTOL
    # the sums really are taken in another order: the gradients are not bitwise those of one pass
    assert not np.array_equal(other_grads, grads)


def test_replicas_are_deterministic():
    """The sums' order is fixed (each replica's rows, then replica 0 adding the others in turn), not the threads'
    timing: two runs agree bitwise, so a resumed run is the uninterrupted one under replicas too."""
    cfg = ModelConfig(**SMALL, **VARIANTS["gpt2"])
    first, second = one_pass(cfg, 3), one_pass(cfg, 3)
    assert first[0] == second[0] and np.array_equal(first[1], second[1])


def test_replicas_with_lora_and_recomputation():
    cfg, lora = ModelConfig(**SMALL, **VARIANTS["llama"]), LoraConfig(rank=2, targets=["wq", "wv", "w_up"])
    losses, grads = one_pass(cfg, 1, lora=lora, recompute="full")
    other_losses, other_grads = one_pass(cfg, 2, lora=lora, recompute="full")
    assert other_losses == pytest.approx(losses, rel=RTOL)
    assert np.linalg.norm(other_grads - grads) / np.linalg.norm(grads) < RTOL


def test_a_failing_replica_raises_its_error_instead_of_hanging():
    """Replica 0 waits for the others unit by unit: a replica that fails must release it, and its error surface."""
    cfg = ModelConfig(**SMALL)
    backend = make_backend("cpu", "float64")
    model = GPT(cfg, backend)
    state = ReplicatedState(model.layouts, backend, 0)
    runner = ThreadReplicas(model, 2)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (4, cfg.seq_len))
    _, saved = runner.forward(state, tokens, tokens, loss_scale=1.0)
    saved[1] = saved[1][:1]  # replica 1's saved state lost its blocks: its backward fails after the head

    with pytest.raises(IndexError):
        runner.backward(state, saved, 1.0 / tokens.size)


def test_thread_replicas_are_refused_by_name_where_layers_communicate():
    for override, named in [("parallel.tp=2", "parallel.tp = 2"), ("parallel.zero=3", "parallel.zero = 3"),
                            ("parallel.pp=2", "parallel.pp = 2")]:
        with pytest.raises(ConfigError, match="train.thread_replicas = 2") as error:
            load_config("configs/tiny.toml", ["train.thread_replicas=2", override])
        assert named in str(error.value)


def test_auto_takes_the_threads_where_the_layout_allows():
    cfg = load_config("configs/tiny.toml", [])  # micro_batch 4
    assert cfg.train.thread_replicas == 0
    assert replica_count(cfg, 2) == 2
    assert replica_count(cfg, 8) == 4  # never more replicas than rows
    assert replica_count(cfg, 1) == 1
    assert replica_count(load_config("configs/tiny.toml", ["parallel.tp=2"]), 2) == 1
    assert replica_count(load_config("configs/tiny.toml", ["train.thread_replicas=1"]), 2) == 1
    assert replica_count(load_config("configs/tiny.toml", ["train.thread_replicas=3"]), 1) == 3


def test_the_breakdown_ignores_other_threads_parts():
    """A replica thread's dW is timed as a part by the linears; only the step's own thread charges the breakdown."""
    ticks = iter(range(100))
    breakdown = Breakdown(clock=lambda: float(next(ticks)), delays={})
    breakdown.start_step()
    with breakdown.part("forward"):
        other = threading.Thread(target=lambda: breakdown.part("backward_weight").__enter__())
        other.start()
        other.join()
    parts = breakdown.finish_step()
    assert parts.get("backward_weight", 0.0) == 0.0 and parts["forward"] == 1.0  # one tick: push to pop


def test_the_memory_plan_counts_the_replicas_gradients():
    from mpitrain.config import resolve_layout
    from mpitrain.plan.memory import memory_report, rank_param_count
    reports = {}
    for replicas in (1, 3):
        cfg = load_config("configs/tiny.toml", [f"train.thread_replicas={replicas}"])
        resolve_layout(cfg, 1)
        reports[replicas] = memory_report(cfg, rank_param_count(cfg))["bytes"]
    assert reports[3]["grads"] == 3 * reports[1]["grads"]
    assert reports[3]["params"] == reports[1]["params"]
