"""Mixture of experts (model.moe) and expert parallelism (parallel.ep): the layer's backward against finite
differences (router and auxiliary losses included), capacity dropping, the dispatch/combine exchange, and float64
parity of ep layouts (with dp, tp, pp) against one process, step by step."""
from __future__ import annotations

import numpy as np
import pytest

from mpitrain.config import ModelConfig, load_config, resolve_layout
from mpitrain.config_moe import MoeSettings
from mpitrain.errors import ConfigError
from mpitrain.layers.expert_parallel import ExpertParallel
from mpitrain.layers.moe import MoE, inactive_params
from mpitrain.layers.tensor_parallel import TensorParallel


def make_layer(arch="gpt2", experts=4, top_k=2, capacity_factor=0.0, seed=0):
    cfg = ModelConfig(arch=arch, d_model=8, n_head=2, d_ff=12, n_layer=2, init_std=0.3,
                      moe={"experts": experts, "top_k": top_k, "capacity_factor": capacity_factor,
                           "aux_loss": 0.3, "z_loss": 0.2})
    layer = MoE(cfg, MoeSettings.of(cfg), TensorParallel(None), ExpertParallel(None, experts))
    rng = np.random.default_rng(seed)
    params = {spec.name: rng.normal(0.0, 0.5, spec.shape) for spec in layer.specs}
    return layer, params


def objective(layer, params, x, weights):
    """sum(y * weights) plus the auxiliary losses' share of the loss sum (loss scale 1)."""
    ctx = {"loss_scale": 1.0, "aux_losses": {}}
    y, saved = layer.forward(params, x, ctx)
    return float((y * weights).sum()) + ctx["aux_losses"]["weighted"], saved


@pytest.mark.parametrize("arch, top_k, capacity_factor", [("gpt2", 1, 0.0), ("gpt2", 2, 0.0), ("llama", 2, 0.0),
                                                          ("gpt2", 2, 0.6)])
def test_backward_matches_finite_differences(arch, top_k, capacity_factor):
    layer, params = make_layer(arch, top_k=top_k, capacity_factor=capacity_factor)
    rng = np.random.default_rng(1)
    x, weights = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 8))
    _, saved = objective(layer, params, x, weights)
    grads = {name: np.zeros_like(value) for name, value in params.items()}
    dx = layer.backward(params, grads, saved, weights)
    if capacity_factor:  # some picks were dropped: the rule is really exercised
        assert len(saved["picked"]["token"]) < x.shape[0] * x.shape[1] * top_k
    eps = 1e-6

    def numeric(array, index):
        old = array[index]
        array[index] = old + eps
        plus = objective(layer, params, x, weights)[0]
        array[index] = old - eps
        minus = objective(layer, params, x, weights)[0]
        array[index] = old
        return (plus - minus) / (2 * eps)

    picks = np.random.default_rng(2)
    for name, value in [*params.items(), ("x", x)]:
        analytic = dx if name == "x" else grads[name]
        for flat in picks.choice(value.size, size=min(12, value.size), replace=False):
            index = np.unravel_index(flat, value.shape)
            assert analytic[index] == pytest.approx(numeric(value, index), rel=1e-5, abs=1e-7), (name, index)
    assert np.abs(grads["router"]).max() > 0


def test_aux_loss_gradient_reaches_the_router_alone():
    """With the outputs' weights zero, only the balance and z losses drive the router (and nothing else)."""
    layer, params = make_layer()
    x = np.random.default_rng(3).normal(size=(1, 6, 8))
    _, saved = objective(layer, params, x, np.zeros_like(x))
    grads = {name: np.zeros_like(value) for name, value in params.items()}
    layer.backward(params, grads, saved, np.zeros_like(x))
    assert np.abs(grads["router"]).max() > 1e-6
    assert all(not grads[name].any() for name in grads if name != "router")


def test_capacity_keeps_first_choices_first_and_caps_every_expert():
    layer, params = make_layer(experts=4, top_k=2, capacity_factor=0.5)
    params["router"][:] = 0
    params["router"][:, 0] = 1.0  # every token prefers expert 0
    x = np.abs(np.random.default_rng(4).normal(size=(1, 16, 8)))
    _, saved = objective(layer, params, x, np.zeros_like(x))
    picked = saved["picked"]
    capacity = int(np.ceil(0.5 * 16 * 2 / 4))
    counts = np.bincount(picked["expert"], minlength=4)
    assert counts.max() <= capacity and counts[0] == capacity
    assert (picked["rank"][picked["expert"] == 0] == 0).all()  # expert 0 full of first choices
    assert list(picked["token"][picked["expert"] == 0]) == list(range(capacity))  # in token order


def test_expert_exchange_permutations_are_inverse():
    from mpitrain.layers.expert_parallel import Routing
    received = np.array([[2, 0, 1], [0, 3, 1]])  # [sender, local expert], one empty block
    routing = Routing(sent=None, received=received)
    assert sorted(routing.to_expert_major) == list(range(7))
    assert (routing.to_expert_major[routing.to_source_major] == np.arange(7)).all()
    assert list(routing.per_local_expert) == [2, 3, 2]
    # source-major rows: s0e0 s0e0 s0e2 s1e1 s1e1 s1e1 s1e2 -> expert-major: s0e0 s0e0 s1e1 x3 s0e2 s1e2
    assert list(routing.to_expert_major) == [0, 1, 3, 4, 5, 2, 6]


def test_config_keys_are_checked_by_name():
    with pytest.raises(ConfigError, match="model.moe.top_k = 5"):
        load_config(None, ["model.moe={experts = 4, top_k = 5}"])
    with pytest.raises(ConfigError, match="unknown config key model.moe.expert;"):
        load_config(None, ["model.moe={expert = 4}"])
    with pytest.raises(ConfigError, match="parallel.ep = 2 needs experts"):
        load_config(None, ["parallel.ep=2"])
    with pytest.raises(ConfigError, match="not divisible by parallel.ep = 4"):
        load_config(None, ["model.moe={experts = 6}", "parallel.ep=4"])
    with pytest.raises(ConfigError, match="capacity_factor = 0.5 with parallel.cp = 2: capacity serves"):
        load_config(None, ["model.moe={experts = 4, capacity_factor = 0.5}", "parallel.cp=2"])
    assert load_config(None, ["model.moe={experts = 4}", "parallel.ep=2", "parallel.zero=3"]).parallel.zero == 3
    cfg = load_config(None, ["model.moe={experts = 8, top_k = 2, every = 2}", "model.n_layer=4"])
    assert [MoeSettings.of(cfg.model).is_moe_block(i) for i in range(4)] == [False, True, False, True]


def test_flops_count_active_parameters_only():
    from mpitrain.backend import make_backend
    from mpitrain.model.gpt import GPT
    cfg = ModelConfig(arch="llama", d_model=16, n_head=2, d_ff=32, n_layer=4, moe={"experts": 8, "top_k": 2,
                                                                                     "every": 2})
    assert inactive_params(cfg) == 2 * (8 - 2) * 3 * 16 * 32
    # top-1: a token uses one expert, the dense MLP's size less its two biases, plus the router (C x E)
    dense = ModelConfig(n_layer=2, d_model=16, n_head=2)
    moe = ModelConfig(n_layer=2, d_model=16, n_head=2, moe={"experts": 4, "top_k": 1})
    backend = make_backend("cpu", "float64")
    extra = 2 * (16 * 4 - 4 * 16 - 16)  # per block: router, less b_fc (F = 4C) and b_proj (C)
    assert GPT(moe, backend).flops_per_token() == GPT(dense, backend).flops_per_token() + 6 * extra


def test_memory_plan_holds_this_ranks_experts_and_names_the_active_parameters():
    from mpitrain.plan.memory import memory_report, rank_param_count
    overrides = ["model.moe={experts = 8, top_k = 2}", "train.micro_batch=1"]
    cfg1, cfg4 = load_config("configs/tiny.toml", overrides), load_config("configs/tiny.toml", [*overrides,
                                                                                               "parallel.ep=4"])
    resolve_layout(cfg1, 1)
    resolve_layout(cfg4, 4)
    per_expert = 2 * 32 * 128  # up and down, d_model 32, d_ff 128
    assert rank_param_count(cfg1) - rank_param_count(cfg4) == 2 * (8 - 2) * per_expert  # 2 blocks, 6 experts away
    assert "2 of 8 experts per MoE block on each rank" in memory_report(cfg4, rank_param_count(cfg4))[
        "formulas"]["params"]


EXCHANGE = """
import json
import numpy as np
from mpi4py import MPI
from mpitrain.comm.mesh import Mesh
from mpitrain.config import ModelConfig
from mpitrain.layers.moe import MoE
from mpitrain.config_moe import MoeSettings
from mpitrain.layers.tensor_parallel import TensorParallel
from mpitrain.layers.expert_parallel import ExpertParallel

mesh = Mesh(MPI.COMM_WORLD, dp=2, ep=2)
cfg = ModelConfig(d_model=8, n_head=2, d_ff=12, moe={"experts": 4, "top_k": 2, "aux_loss": 0.1, "z_loss": 0.1})
moe = MoeSettings.of(cfg)
mine = MoE(cfg, moe, TensorParallel(None), ExpertParallel(mesh.ep, 4))
whole = MoE(cfg, moe, TensorParallel(None), ExpertParallel(None, 4))
rng = np.random.default_rng(0)
full = {spec.name: rng.normal(0, 0.5, spec.full_shape) for spec in whole.specs}
full["router"][:, 3] = -50.0  # expert 3 (rank 1's second) receives no token from anyone
p = {spec.name: np.ascontiguousarray(spec.piece(full[spec.name])) for spec in mine.specs}
x = np.abs(np.random.default_rng(10 + mesh.rank).normal(size=(2, 6, 8)))  # with router[:, 3] < 0: no picks of 3
dy = np.random.default_rng(20 + mesh.rank).normal(size=x.shape)
mesh.ep.reset_counters()
mesh.dp.reset_counters()
ctx = {"loss_scale": 0.5, "aux_losses": {}}
y, saved = mine.forward(p, x, ctx)
g = {name: np.zeros_like(v) for name, v in p.items()}
dx = mine.backward(p, g, saved, dy)
sent = mesh.ep.counters()["all_to_all"] + mesh.dp.counters()["all_to_all"]
# the same tokens through one process holding every expert
ref_ctx = {"loss_scale": 0.5, "aux_losses": {}}
ref_y, ref_saved = whole.forward(full, x, ref_ctx)
ref_g = {name: np.zeros_like(v) for name, v in full.items()}
ref_dx = whole.backward(full, ref_g, ref_saved, dy)
# expected bytes: a pick whose expert lives on the other rank travels there twice (x, then the output's gradient)
# and back twice (the output, then x's gradient): each rank sends its own such picks and the other rank's back
logits = x.reshape(-1, 8) @ full["router"]
picks = np.argsort(-logits, axis=1, kind="stable")[:, :2]
away = MPI.COMM_WORLD.allgather(int((picks // 2 != mesh.ep.rank).sum()))
summed = {name: np.empty_like(v) for name, v in ref_g.items()}
for name in ref_g:
    MPI.COMM_WORLD.Allreduce(ref_g[name], summed[name])  # both ranks' tokens' gradients, as expert_dp x ep hold them
errors = {"y": float(np.abs(y - ref_y).max()), "dx": float(np.abs(dx - ref_dx).max()),
          "router": float(np.abs(g["router"] - ref_g["router"]).max())}
for spec in mine.specs[1:]:
    errors[spec.name] = float(np.abs(g[spec.name] - spec.piece(summed[spec.name])).max())
rows_for_expert3 = int(saved["routing"].per_local_expert[-1]) if mesh.ep.rank == 1 else -1
results = MPI.COMM_WORLD.gather({"errors": errors, "sent": sent, "expected": 2 * sum(away) * 8 * 8,
                                 "aux": ctx["aux_losses"]["weighted"], "ref_aux": ref_ctx["aux_losses"]["weighted"],
                                 "rows_for_expert3": rows_for_expert3})
if mesh.rank == 0:
    print("RESULTS " + json.dumps(results))
"""


def test_dispatch_and_combine_match_one_process_and_count_exactly_the_routed_bytes():
    from tests.mpi_helpers import run_python_mpi_results
    results = run_python_mpi_results(2, EXCHANGE, timeout=120)
    for rank, result in enumerate(results):
        assert all(error < 1e-12 for error in result["errors"].values()), (rank, result["errors"])
        assert result["sent"] == result["expected"] > 0, rank
        assert result["aux"] == pytest.approx(result["ref_aux"], rel=1e-14)
    assert results[1]["rows_for_expert3"] == 0  # an expert with no token at all works


# ---- training runs: float64 parity of expert-parallel layouts with one process, every step ----------------------
RTOL = 1e-10


def train_run(n_ranks, run_dir, *overrides, steps=None, resume=None, expect=0):
    from tests.test_train_parity import PARITY_STEPS, run_training
    steps = steps or PARITY_STEPS
    settings = ["data.synthetic=true", "precision.compute=float64", f"train.steps={steps}", "train.micro_batch=2",
                "train.eval_batches=1", *overrides]
    return run_training(n_ranks, run_dir, settings, resume=resume, expect=expect, timeout=300)


def assert_same_run(reference, other):
    (ref_metrics, ref_params), (metrics, params) = reference, other
    assert [m["step"] for m in metrics] == [m["step"] for m in ref_metrics]
    for ref, got in zip(ref_metrics, metrics):
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            assert got[key] == pytest.approx(ref[key], rel=RTOL, abs=0), (key, got["step"])
    assert ref_params.keys() == params.keys()
    for name, value in ref_params.items():
        err = np.linalg.norm(params[name] - value) / np.linalg.norm(value)
        assert err < RTOL, f"{name}: relative difference {err:.2e}"


MOE_CASES = {  # name: (model.moe, extra settings of every run)
    "E4-top1": ("{experts = 4, top_k = 1}", ["model.arch=gpt2"]),
    "E8-top2-llama": ("{experts = 8, top_k = 2, every = 2}", ["model.arch=llama", "model.n_kv_head=2"]),
    "E4-top2-capacity": ("{experts = 4, top_k = 2, capacity_factor = 0.75}", ["model.arch=gpt2"]),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    runs = {}
    for name, (moe, extra) in MOE_CASES.items():
        runs[name] = train_run(1, tmp_path_factory.mktemp(name), f"model.moe={moe}", *extra)
    return runs


@pytest.mark.parametrize("case, ranks, layout", [
    ("E4-top1", 2, ["parallel.ep=2"]),
    ("E4-top1", 2, ["parallel.zero=3"]),  # ep 1: the experts are whole on every rank and shard like the rest
    ("E4-top1", 2, ["parallel.ep=2", "memory.recompute=full"]),  # the exchange runs again in backward
    ("E4-top1", 2, ["parallel.ep=2", "memory.recompute=selective"]),  # routing and expert inputs kept
    ("E4-top2-capacity", 4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                             "memory.recompute=selective"]),  # the norm's output gathered again along the sequence
    ("E8-top2-llama", 4, ["parallel.ep=2", "parallel.pp=2", "parallel.zero=1", "memory.recompute=selective"]),
    ("E8-top2-llama", 4, ["parallel.ep=4"]),
    ("E4-top2-capacity", 4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
])  # and dp 4 with ep 2 (expert_dp of 2) in the resume test below
def test_expert_parallel_layouts_match_one_process(tmp_path, references, case, ranks, layout):
    moe, extra = MOE_CASES[case]
    run = train_run(ranks, tmp_path / "run", f"model.moe={moe}", *extra, *layout)
    assert_same_run(references[case], run)
    shares = np.array(list(run[0][-1]["expert_shares"].values()))  # per MoE block, over the whole step
    assert np.allclose(shares.sum(axis=1), 1) and shares.shape[1] == (8 if "E8" in case else 4)


def test_a_stopped_expert_parallel_run_resumes_in_one_process(tmp_path, references):
    """Steps 1-5 on dp 4 with ep 2 (experts reduced over expert_dp of 2), saved (each expert written once, by one of
    its expert_dp replicas) and resumed for steps 6-10 in one process: the one-process run's losses and weights."""
    moe, extra = MOE_CASES["E8-top2-llama"]
    settings = [f"model.moe={moe}", *extra]
    train_run(4, tmp_path, *settings, "parallel.ep=2", "train.stop_at=5", expect=75)
    assert_same_run(references["E8-top2-llama"], train_run(1, tmp_path, *settings, resume="auto"))


def test_five_d_layout_dp2_tp2_pp2_with_experts_matches_one_process(tmp_path, references):
    moe, extra = MOE_CASES["E8-top2-llama"]
    run = train_run(8, tmp_path / "run", f"model.moe={moe}", *extra, "parallel.ep=2", "parallel.tp=2",
                    "parallel.pp=2")
    assert_same_run(references["E8-top2-llama"], run)


def test_all_to_all_bytes_are_the_routed_tokens_bytes(tmp_path):
    """ep = dp = 2 with 2 experts, top-2: every token picks both, so each rank sends each of its tokens to the
    other rank's expert once and gets the other rank's back: 4 crossings (dispatch and combine, forward and
    backward) of micro-batch tokens x d_model values, per MoE layer and micro-batch. Exactly that, in bfloat16
    (2 bytes: the gradients travel in the compute dtype too)."""
    metrics, _ = train_run(2, tmp_path / "run", "model.moe={experts = 2, top_k = 2}", "parallel.ep=2",
                           "precision.compute=bfloat16", steps=2)
    tokens, d_model, layers, micro_batches = 2 * 32, 32, 2, 8 // (2 * 2)
    for record in metrics:
        assert record["comm_bytes"]["all_to_all"] == 4 * tokens * d_model * 2 * layers * micro_batches
        assert np.isfinite(record["loss"]) and 0.9 < record["moe_balance"] < 1.5


# ---- ZeRO with expert parallelism: experts sharded over expert_dp, the rest over dp ------------------------------
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_with_expert_parallel_matches_one_process(tmp_path, references, zero):
    """dp 4 with ep 2: each expert's state is sharded over its expert_dp group of 2, the dense tensors over dp 4
    (block 1, an MoE block, is both: two parts, each reduce-scattered and gathered over its own group)."""
    moe, extra = MOE_CASES["E8-top2-llama"]
    run = train_run(4, tmp_path / "run", f"model.moe={moe}", *extra, "parallel.ep=2", f"parallel.zero={zero}")
    assert_same_run(references["E8-top2-llama"], run)


def test_zero3_expert_parallel_checkpoint_resumes_under_zero2_without_ep(tmp_path, references):
    """Steps 1-3 on dp 4, ep 2, ZeRO-3 (expert shards cut over expert_dp), resumed on dp 2, ep 1, ZeRO-2 (every
    expert whole on both ranks, cut over dp): the one-process run's losses and weights."""
    moe, extra = MOE_CASES["E8-top2-llama"]
    settings = [f"model.moe={moe}", *extra]
    train_run(4, tmp_path, *settings, "parallel.ep=2", "parallel.zero=3", "train.stop_at=3", expect=75)
    assert_same_run(references["E8-top2-llama"], train_run(2, tmp_path, *settings, "parallel.zero=2", resume="auto"))


ZERO_EP_MEMORY_JOB = """
import json
from mpi4py import MPI
from mpitrain.backend import make_backend
from mpitrain.comm.mesh import Mesh
from mpitrain.config import load_config, resolve_layout
from mpitrain.model.gpt import GPT
from mpitrain.optim.adamw import AdamW, AdamWHyper
from mpitrain.state.factory import make_state
world, out = MPI.COMM_WORLD, {}
for stage in (0, 1, 2, 3):
    cfg = load_config("configs/tiny.toml", ["model.moe={experts = 8, top_k = 2}", "parallel.ep=2",
                                            "train.micro_batch=1", f"parallel.zero={stage}",
                                            "precision.compute=bfloat16"])
    resolve_layout(cfg, world.size)
    backend = make_backend("cpu", "bfloat16")
    mesh = Mesh(world, dp=world.size, ep=2)
    model = GPT(cfg.model, backend, ep_group=mesh.ep)
    state = make_state(cfg, model, backend, mesh)
    held = state.memory()
    specs = [spec for layout in model.layouts for spec in layout.specs]
    out[stage] = {"total": sum(held.values()) + AdamW(state.optimizer_segments(), AdamWHyper()).state_nbytes(),
                  "experts": sum(s.size for s in specs if s.reduce_over == "expert_dp"),
                  "dense": sum(s.size for s in specs if s.reduce_over != "expert_dp"),
                  "expert_dp": mesh.expert_dp.size}
if world.rank == world.size - 1:
    print("RESULTS " + json.dumps(out))
"""


def test_zero_state_of_experts_per_rank_falls_by_the_expert_dp_size():
    """Bytes of the arrays a rank holds (bf16 params and grads, fp32 master and Adam moments) on dp 4 with ep 2:
    the sharded bytes per parameter divided by 4 for the dense tensors and by expert_dp = 2 for this rank's experts
    (4 of 8 per MoE block), as ZeRO's formulas say, up to padding."""
    from tests.mpi_helpers import run_python_mpi_results
    bytes_per_param = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}  # (whole, sharded): 2 + 2 + 4 + 4 + 4
    measured = {int(k): v for k, v in run_python_mpi_results(4, ZERO_EP_MEMORY_JOB, timeout=120).items()}
    dense, experts = measured[0]["dense"], measured[0]["experts"]
    assert measured[0]["expert_dp"] == 2 and experts == 2 * 4 * 2 * 32 * 128  # 2 blocks, 4 experts, up and down
    padding = 6 * 3 * 16  # at most 3 elements in each of 6 parts (embed, 2 per MoE block, head), 16 bytes each
    for stage, (whole, sharded) in bytes_per_param.items():
        expected = whole * (dense + experts) + sharded * (dense / 4 + experts / 2)
        assert expected <= measured[stage]["total"] <= expected + padding, (stage, measured[stage], expected)
        # the planner's memory model (mpitrain memory / plan) predicts the same state bytes
        from mpitrain.plan.memory import memory_report, rank_param_count
        cfg = load_config("configs/tiny.toml", ["model.moe={experts = 8, top_k = 2}", "parallel.ep=2",
                                                "train.micro_batch=1", f"parallel.zero={stage}",
                                                "precision.compute=bfloat16"])
        resolve_layout(cfg, 4)
        predicted = memory_report(cfg, rank_param_count(cfg))["bytes"]["state"]
        assert predicted <= measured[stage]["total"] <= predicted + padding, (stage, measured[stage], predicted)
