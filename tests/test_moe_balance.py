"""MoE load balancing as DeepSeek-V3 does it (model.moe.balance = "bias", model.moe.seq_aux_loss): the routing bias's
update rule, that it steers the choice and not the gates, the sequence-level balance loss's gradient by finite
differences, bias balancing at float64 parity with one process under ep 2 and dp 2, a bitwise resume with the biases,
the per-layer load metrics, and the config checks."""
from __future__ import annotations

import numpy as np
import pytest

from mpitrain.config import ModelConfig, load_config
from mpitrain.config_moe import MoeSettings
from mpitrain.errors import ConfigError
from mpitrain.layers.expert_parallel import ExpertParallel
from mpitrain.layers.moe import MoE, update_routing_bias
from mpitrain.layers.tensor_parallel import TensorParallel
from tests.test_moe import RTOL, train_run


def make_layer(seed=0, **moe):
    cfg = ModelConfig(d_model=8, n_head=2, d_ff=12, n_layer=2, init_std=0.3, moe={"experts": 4, "top_k": 2, **moe})
    layer = MoE(cfg, MoeSettings.of(cfg), TensorParallel(None), ExpertParallel(None, 4))
    rng = np.random.default_rng(seed)
    params = {spec.name: rng.normal(0.0, 0.5, spec.shape) for spec in layer.specs}
    return layer, params


def test_the_bias_moves_towards_the_mean_load_by_the_rate_and_nothing_else():
    bias = np.array([0.5, 0.0, -0.25, 0.0])
    update_routing_bias(bias, [10, 2, 4, 0], 1e-3)  # mean 4: expert 0 overloaded, 1 and 3 underloaded, 2 at it
    assert bias.tolist() == [0.5 - 1e-3, 1e-3, -0.25, 1e-3]
    again = np.array([0.5, 0.0, -0.25, 0.0])
    update_routing_bias(again, np.array([10.0, 2.0, 4.0, 0.0]), 1e-3)
    assert np.array_equal(again, bias)  # a function of the loads alone: every rank that sees them agrees


def test_the_bias_steers_the_choice_and_the_gates_stay_the_probabilities():
    layer, params = make_layer(balance="bias")
    assert [s.name for s in layer.specs if not s.trainable] == ["router_bias"]
    x = np.random.default_rng(1).normal(size=(2, 5, 8))
    params["router_bias"][:] = 0.0
    _, plain = layer.forward(params, x)
    params["router_bias"][:] = [0.0, 0.0, 0.0, 5.0]  # expert 3 wins every token's choice
    _, steered = layer.forward(params, x)
    picked = steered["picked"]
    assert (picked["expert"][picked["rank"] == 0] == 3).all()
    assert not (plain["picked"]["expert"][plain["picked"]["rank"] == 0] == 3).all()
    assert np.array_equal(picked["gate"], steered["probs"][picked["token"], picked["expert"]])
    assert np.allclose(steered["probs"].sum(axis=1), 1.0) and picked["gate"].max() < 1.0


def objective(layer, params, x, weights):
    ctx = {"loss_scale": 1.0, "aux_losses": {}}
    y, saved = layer.forward(params, x, ctx)
    return float((y * weights).sum()) + ctx["aux_losses"]["weighted"], saved, ctx["aux_losses"]


@pytest.mark.parametrize("balance, zero_outputs", [("aux_loss", True), ("bias", True), ("bias", False)])
def test_sequence_level_balance_loss_gradient_matches_finite_differences(balance, zero_outputs):
    """float64: the router's and the input's gradients with the sequence-level loss (alone when the outputs' weights
    are zero), and the loss itself equal to its definition, E * sum_e f_e P_e per sequence, averaged."""
    moe = {"aux_loss": 0.0} if balance == "aux_loss" else {"balance": "bias"}
    layer, params = make_layer(seq_aux_loss=0.7, z_loss=0.0, **moe)
    if balance == "bias":
        params["router_bias"][:] = [0.02, -0.01, 0.0, 0.03]
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 5, 8))
    weights = np.zeros_like(x) if zero_outputs else rng.normal(size=x.shape)
    total, saved, record = objective(layer, params, x, weights)
    per_sequence = []
    for b in range(3):
        counts = np.bincount(saved["picked"]["expert"][saved["picked"]["token"] // 5 == b], minlength=4)
        per_sequence.append(4 * (counts / 10) @ saved["probs"][b * 5:(b + 1) * 5].mean(axis=0))
    assert record["seq_balance"] == pytest.approx(15 * np.mean(per_sequence), rel=1e-13)
    if zero_outputs:
        assert total == pytest.approx(15 * 0.7 * np.mean(per_sequence), rel=1e-13)
    grads = {name: np.zeros_like(value) for name, value in params.items() if name != "router_bias"}
    dx = layer.backward(params, grads, saved, weights)
    assert np.abs(grads["router"]).max() > 1e-4
    eps = 1e-6
    for name, array, analytic in [("router", params["router"], grads["router"]), ("x", x, dx)]:
        for flat in np.random.default_rng(3).choice(array.size, size=12, replace=False):
            index = np.unravel_index(flat, array.shape)
            old = array[index]
            array[index] = old + eps
            plus = objective(layer, params, x, weights)[0]
            array[index] = old - eps
            minus = objective(layer, params, x, weights)[0]
            array[index] = old
            assert analytic[index] == pytest.approx((plus - minus) / (2 * eps), rel=1e-5, abs=1e-8), (name, index)


def test_config_checks_name_the_key():
    with pytest.raises(ConfigError, match="model.moe.balance must be one of aux_loss, bias"):
        load_config(None, ["model.moe={experts = 4, balance = 'biased'}"])
    with pytest.raises(ConfigError, match="model.moe.aux_loss .*model.moe.balance = 'bias'"):
        load_config(None, ["model.moe={experts = 4, balance = 'bias', aux_loss = 0.01}"])
    with pytest.raises(ConfigError, match="model.moe.bias_rate must be a finite number >= 0"):
        load_config(None, ["model.moe={experts = 4, balance = 'bias', bias_rate = -1.0}"])
    cfg = load_config(None, ["model.moe={experts = 4, balance = 'bias', seq_aux_loss = 0.001}"])
    moe = MoeSettings.of(cfg.model)
    assert (moe.balance, moe.bias_rate, moe.seq_aux_loss, moe.batch_aux_loss) == ("bias", 0.001, 0.001, 0.0)


# ---- training runs: float64 parity with one process, the biases included ------------------------------------------
BIAS = ["model.moe={experts = 4, top_k = 2, balance = 'bias', bias_rate = 0.01, seq_aux_loss = 0.01}",
        "model.arch=gpt2"]


def assert_same_run(reference, other):
    """Losses and weights at 1e-10; the biases (sums of +-rate steps, possibly all 0) exactly equal."""
    def split(run):
        metrics, params = run
        return (metrics, {n: v for n, v in params.items() if not n.endswith("router_bias")},
                {n: v for n, v in params.items() if n.endswith("router_bias")})
    (ref_metrics, ref_weights, ref_biases), (metrics, weights, biases) = split(reference), split(other)
    assert [m["step"] for m in metrics] == [m["step"] for m in ref_metrics]
    for ref, got in zip(ref_metrics, metrics):
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_seq_balance"):
            assert got[key] == pytest.approx(ref[key], rel=RTOL, abs=0), (key, got["step"])
    assert weights.keys() == ref_weights.keys()
    for name, value in ref_weights.items():  # (LoRA's frozen zero biases must stay exactly zero)
        assert np.linalg.norm(weights[name] - value) <= RTOL * np.linalg.norm(value), name
    assert ref_biases.keys() == biases.keys() and len(biases) == 2
    for name, value in ref_biases.items():
        assert np.array_equal(biases[name], value), name


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bias-one")
    return path, train_run(1, path, *BIAS)


@pytest.fixture(scope="module")
def reference(reference_dir):
    return reference_dir[1]


def test_the_biases_move_and_the_loads_are_logged(reference):
    metrics, params = reference
    biases = {name: value for name, value in params.items() if name.endswith("router_bias")}
    assert sorted(biases) == ["blocks.0.router_bias", "blocks.1.router_bias"]
    assert any(np.abs(value).max() > 0 for value in biases.values())  # (one may be back at 0: they oscillate)
    for value in biases.values():  # every step moves each entry by 0 or +-rate: a multiple of the rate
        assert np.allclose(value / 0.01, np.round(value / 0.01), atol=1e-9)
    record = metrics[-1]
    assert set(record["expert_load"]) == {"0", "1"} and record["moe_seq_balance"] > 0.9
    for layer, load in record["expert_load"].items():
        assert load["max_over_uniform"] == pytest.approx(4 * max(record["expert_shares"][layer]), rel=1e-5)
        assert load["dropped"] == 0  # dropless


@pytest.mark.parametrize("ranks, layout", [(2, ["parallel.ep=2"]), (2, ["parallel.dp=2", "parallel.zero=1"]),
                                           (4, ["parallel.ep=2", "parallel.pp=2"]),
                                           (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
                                           (2, ["parallel.dp=2", "parallel.zero=3"])])
def test_bias_balancing_matches_one_process(tmp_path, reference, ranks, layout):
    assert_same_run(reference, train_run(ranks, tmp_path / "run", *BIAS, *layout))


def test_bias_balancing_with_lora_matches_one_process(tmp_path):
    """LoRA freezes the router: the bias, frozen too, still moves after each step, alike under ep 2."""
    settings = [*BIAS, "lora.rank=2", 'lora.targets=["wq", "expert_w_fc"]']
    one = train_run(1, tmp_path / "one", *settings)
    assert any(np.abs(v).max() > 0 for n, v in one[1].items() if n.endswith("router_bias"))
    assert_same_run(one, train_run(2, tmp_path / "ep2", *settings, "parallel.ep=2"))


@pytest.mark.parametrize("layout", [["parallel.cp=2"], ["parallel.cp=2", "parallel.ep=2"]])
def test_bias_balancing_under_context_parallelism_matches_one_process(tmp_path, reference, layout):
    """cp 2 (each cp rank routes half of every sequence; with ep 2 drawn from cp): the loads summed over dp x cp are
    the one process's, so are the biases, and the sequence-level loss sums each sequence's statistics over the cp
    ranks, so its value and gradient are the one process's too."""
    assert_same_run(reference, train_run(2, tmp_path / "cp2", *BIAS, *layout))


def test_a_stopped_run_resumes_bitwise_with_its_biases(tmp_path, reference):
    """Steps 1-5 on ep 2, saved with the biases, resumed for steps 6-10 on ep 2: the same losses and parameters
    as the uninterrupted ep 2 run, bit for bit (and as the one-process run to 1e-10)."""
    straight = train_run(2, tmp_path / "straight", *BIAS, "parallel.ep=2")
    train_run(2, tmp_path / "resumed", *BIAS, "parallel.ep=2", "train.stop_at=5", expect=75)
    resumed = train_run(2, tmp_path / "resumed", *BIAS, "parallel.ep=2", resume="auto")
    assert [m["loss"] for m in resumed[0]] == [m["loss"] for m in straight[0]]
    for name, value in straight[1].items():
        assert np.array_equal(resumed[1][name], value), name
    assert_same_run(reference, resumed)


def test_the_report_names_each_blocks_busiest_expert(reference_dir):
    pytest.importorskip("matplotlib")
    from mpitrain.profile.report import build_figure
    path, (metrics, _) = reference_dir
    load = metrics[-1]["expert_load"]
    title = build_figure(path).get_suptitle()
    expected = (f"MoE busiest expert / uniform at step {metrics[-1]['step']}: block 0 "
                f"{load['0']['max_over_uniform']:.2f}, block 1 {load['1']['max_over_uniform']:.2f}")
    assert title.endswith(expected), title


def test_the_console_line_names_the_worst_blocks_busiest_expert():
    from mpitrain.run.log import format_log_line
    record = {"step": 3, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0, "mfu": 0.1,
              "expert_load": {"0": {"max_over_uniform": 1.12, "dropped": 0}, "1": {"max_over_uniform": 1.31,
                                                                                  "dropped": 4}}}
    assert format_log_line(record, 10).endswith("| experts 1.31x")
    assert "experts" not in format_log_line({**record, "expert_load": {}}, 10)
