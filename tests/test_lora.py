"""LoRA (mpitrain/layers/lora.py): adapters' gradients, what trains and what stays put, the merged export, and
float64 parity of the layouts against one process."""
from __future__ import annotations

import numpy as np
import pytest

from mpitrain.backend import make_backend
from mpitrain.config import LoraConfig, ModelConfig
from mpitrain.data.prepare import prepare_dataset
from mpitrain.layers.lora import merge
from mpitrain.model.gpt import GPT
from mpitrain.optim.adamw import AdamW, AdamWHyper
from mpitrain.state.params import init_tensor
from mpitrain.state.replicated import ReplicatedState
from tests.mpi_helpers import describe, run_mpi
from tests.test_train_parity import run_training

TARGETS = {"gpt2": ["wq", "wk", "wv", "wo", "w_fc", "w_proj"], "llama": ["wq", "wk", "wv", "wo", "w_gate", "w_up",
                                                                       "w_down"]}


def small_model(arch, compute="float64", rank=2, n_layer=2, d_model=16, vocab=40, targets=None):
    cfg = ModelConfig(arch=arch, n_layer=n_layer, d_model=d_model, n_head=4, vocab_size=vocab, seq_len=8)
    backend = make_backend("cpu", compute)
    lora = LoraConfig(rank=rank, alpha=4.0, targets=targets or TARGETS[arch]) if rank else None
    model = GPT(cfg, backend, lora=lora)
    return model, ReplicatedState(model.layouts, backend, 0), backend


def randomise_adapters(state, seed=0):
    """b starts at zero, which would hide a's gradient and the merge: give every adapter tensor random values."""
    rng = np.random.default_rng(seed)
    for _, view in state.params.named_views():
        view[...] = rng.normal(0, 0.3, view.shape)


def loss_and_grads(model, state, tokens, targets):
    state.zero_grads()
    state.begin_micro_batch(last=True)
    loss, saved = model.forward(state, tokens, targets)
    model.backward(state, saved, 1.0)
    state.finish()
    return float(loss)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_adapter_gradients_match_finite_differences(arch):
    model, state, _ = small_model(arch)
    randomise_adapters(state)
    rng = np.random.default_rng(1)
    tokens, targets = rng.integers(0, 40, (2, 8)), rng.integers(0, 40, (2, 8))
    loss_and_grads(model, state, tokens, targets)
    params, grads = state.params, state.grads
    names = [n for n, _ in params.named_views()]
    assert names and all("_lora_" in n for n in names), names  # only adapters train
    analytic = grads.data.copy()
    checked = 0
    for index in rng.choice(params.size, 40, replace=False):
        keep = params.data[index]
        params.data[index] = keep + 1e-6
        plus = loss_and_grads(model, state, tokens, targets)
        params.data[index] = keep - 1e-6
        minus = loss_and_grads(model, state, tokens, targets)
        params.data[index] = keep
        numeric = (plus - minus) / 2e-6
        assert analytic[index] == pytest.approx(numeric, rel=1e-5, abs=1e-8), index
        checked += abs(numeric) > 1e-6
    assert checked > 20  # the check saw real gradients, not zeros


def test_trainable_parameters_and_optimizer_bytes_fall_by_99_percent():
    """A 6-layer model, rank 8 on wq and wv, against full fine-tuning of the same model."""
    sizes = {}
    for rank in (0, 8):
        _, state, _ = small_model("llama", rank=rank, n_layer=6, d_model=256, vocab=2048, targets=["wq", "wv"])
        optimizer = AdamW(state.optimizer_segments(), AdamWHyper())
        sizes[rank] = (state.params.size, optimizer.state_nbytes())
    full, lora = sizes[0], sizes[8]
    assert lora[0] == 6 * 2 * (256 * 8 + 8 * 256), lora
    assert lora[0] <= 0.01 * full[0] and lora[1] <= 0.01 * full[1], (full, lora)
    print(f"trainable {lora[0]:,} of {full[0]:,}; optimizer bytes {lora[1]:,} of {full[1]:,}")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_flops_per_token_count_no_weight_gradient_for_the_frozen_base(arch):
    """MFU's FLOPs under LoRA: the frozen base's matmuls run forward (2) and input gradient (2) only, the adapters
    train (6 each); attention is unchanged. Checked against the plain model's count, term by term."""
    base, _, _ = small_model(arch, rank=0)
    lora, state, _ = small_model(arch, rank=2)
    cfg = base.cfg
    attention = 12.0 * cfg.n_layer * cfg.d_model * cfg.seq_len
    base_matmul_weights = (base.flops_per_token() - attention) / 6
    adapters = state.params.size
    assert adapters == lora.n_trainable == lora.n_params - base.n_params > 0
    assert lora.flops_per_token() == pytest.approx(4 * base_matmul_weights + 6 * adapters + attention, rel=1e-12)
    assert lora.flops_per_token() < base.flops_per_token()


def test_merged_weights_give_the_logits_of_base_plus_adapters():
    model, state, _ = small_model("llama", compute="float32")
    randomise_adapters(state)
    tokens = np.random.default_rng(2).integers(0, 40, (2, 8))
    with_adapters = model.last_logits(state, tokens)
    tensors = {}
    for source in (state.params, state.frozen):
        tensors.update({name: np.array(view, dtype=np.float64) for name, view in source.named_views()})
    merged = merge(tensors, rank=2, alpha=4.0)
    plain, plain_state, _ = small_model("llama", compute="float32", rank=0)
    for name, view in plain_state.params.named_views():
        view[...] = merged[name]
    difference = np.abs(plain.last_logits(plain_state, tokens) - with_adapters).max()
    assert difference <= 1e-6 * max(1.0, np.abs(with_adapters).max()), difference
    assert np.abs(with_adapters - plain_logits_without_adapters(tensors, tokens)).max() > 1e-3  # adapters matter


def plain_logits_without_adapters(tensors, tokens):
    plain, plain_state, _ = small_model("llama", compute="float32", rank=0)
    for name, view in plain_state.params.named_views():
        view[...] = tensors[name]
    return plain.last_logits(plain_state, tokens)


def test_memory_plan_counts_the_frozen_base_and_the_adapters_state_exactly():
    from mpitrain.config import load_config, resolve_layout
    from mpitrain.plan.memory import memory_report, rank_param_count
    cfg = load_config("configs/tiny.toml", ["precision.compute=float64", *LORA])
    resolve_layout(cfg, 1)
    report = memory_report(cfg, rank_param_count(cfg))["bytes"]
    backend = make_backend("cpu", "float64")
    model = GPT(cfg.model, backend, lora=cfg.lora)
    state = ReplicatedState(model.layouts, backend, 0)
    held = state.memory()
    optimizer = AdamW(state.optimizer_segments(), AdamWHyper())
    assert (report["params"], report["grads"], report["optimizer"]) == \
        (held["params"], held["grads"], optimizer.state_nbytes()), (report, held)
    assert 0 < report["grads"] < report["params"] / 5  # the base has no gradient


def test_adapters_on_kv_weights_replicated_over_tp_are_refused():
    from mpitrain.errors import ConfigError
    from mpitrain.layers.tensor_parallel import TensorParallel
    tp = TensorParallel(None)
    tp.size = 2  # shapes only, as `mpitrain memory` builds a rank's model
    cfg = ModelConfig(arch="llama", n_layer=1, d_model=16, n_head=4, n_kv_head=1, vocab_size=40, seq_len=8)
    with pytest.raises(ConfigError, match="wk is replicated over tp"):
        GPT(cfg, make_backend("cpu", "float64"), tp=tp, lora=LoraConfig(rank=2, targets=["wq", "wk"]))
    GPT(cfg, make_backend("cpu", "float64"), tp=tp, lora=LoraConfig(rank=2, targets=["wq", "wo"]))


@pytest.mark.parametrize("kind", ["column", "row"])
def test_a_split_backward_defers_the_adapters_weight_gradients(kind):
    """zb1p's B pass hands the adapters' dA/dB to the W pass as work items (the frozen base has none); run there they
    give the gradients of an unsplit backward, bitwise, and the input gradient does not wait for them."""
    from mpitrain.layers.linear import ColumnParallelLinear, RowParallelLinear, run_weight_grads
    from mpitrain.layers.lora import Adapter
    from mpitrain.layers.tensor_parallel import TensorParallel
    tp, rng = TensorParallel(None), np.random.default_rng(4)
    linear = (ColumnParallelLinear(tp, 6, ["w"], trainable=False) if kind == "column"
              else RowParallelLinear(tp, 6, "w", trainable=False))
    linear.adapters["w"] = Adapter("w", kind, (6, 5), 2, 4.0, tp)
    p = {"w": rng.normal(size=(6, 5)), "w_lora_a": rng.normal(size=(6, 2)), "w_lora_b": rng.normal(size=(2, 5))}
    x, dy = rng.normal(size=(2, 3, 6)), rng.normal(size=(2, 3, 5))

    def backward(deferred):
        g = {"w_lora_a": np.zeros((6, 2)), "w_lora_b": np.zeros((2, 5))}
        dx = linear.backward(p, g, x, [dy] if kind == "column" else dy, deferred=deferred)
        return dx, g
    dx_now, g_now = backward(None)
    deferred = []
    dx_split, g_split = backward(deferred)
    assert sorted(name for name, _, _ in deferred) == ["w_lora_a", "w_lora_b"]
    assert not any(g.any() for g in g_split.values())  # nothing taken in B
    run_weight_grads(deferred, g_split)
    assert np.array_equal(dx_split, dx_now)
    for name in g_now:
        assert g_now[name].any() and np.array_equal(g_split[name], g_now[name]), name


def test_targets_are_checked_by_name():
    from mpitrain.errors import ConfigError
    with pytest.raises(ConfigError, match="lora.targets.*unknown w_nope"):
        small_model("gpt2", targets=["wq", "w_nope"])


# ------------------------------------------------------------------------------------------ runs under MPI
@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "stdlib.h5"
    prepare_dataset("python-stdlib", path, max_bytes=200_000)
    return path


LORA = ["lora.rank=4", "lora.alpha=8.0", 'lora.targets=["wq", "wk", "wv", "wo", "w_fc", "w_proj"]']


def train_run(n_ranks, run_dir, dataset, *overrides, resume=None, expect=0):
    settings = [f"data.path={dataset}", "precision.compute=float64", "train.steps=6", *LORA, *overrides]
    return run_training(n_ranks, run_dir, settings, resume=resume, expect=expect, timeout=300)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("reference")


@pytest.fixture(scope="module")
def reference(reference_dir, dataset):
    return train_run(1, reference_dir, dataset)


def test_base_weights_stay_bitwise_and_adapters_train(reference):
    from mpitrain.config import load_config
    cfg = load_config("configs/tiny.toml", LORA)
    metrics, params = reference
    model = GPT(cfg.model, make_backend("cpu", "float64"), lora=cfg.lora)
    base = adapters = 0
    for layout in model.layouts:
        for spec in layout.specs:
            name = f"{layout.name}.{spec.name}"
            start = init_tensor(spec, layout.name, cfg.train.seed)
            if spec.trainable:
                adapters += 1
                assert not np.array_equal(params[name], start), name  # trained
            else:
                base += 1
                assert np.array_equal(params[name], start), name  # bitwise
    assert base > 10 and adapters == 2 * 6 * cfg.model.n_layer
    assert metrics[-1]["loss"] < metrics[0]["loss"]


@pytest.mark.parametrize("ranks, layout", [(2, ["parallel.dp=2"]), (2, ["parallel.tp=2"]),
                                           (2, ["parallel.dp=2", "parallel.zero=1"]),
                                           (2, ["parallel.dp=2", "parallel.zero=3"]),
                                           (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
                                           (2, ["parallel.pp=2"]),
                                           (2, ["parallel.pp=2", "train.micro_batch=2", "parallel.schedule=zb1p"]),
                                           # adapters' tp-partial gradients are reduced in the W pass
                                           (4, ["parallel.tp=2", "parallel.pp=2", "train.micro_batch=2",
                                                "parallel.schedule=zb1p"]),
                                           (2, ["parallel.tp=2", "memory.recompute=full"])],
                         ids=["dp2", "tp2", "zero1", "zero3", "tp2-sp", "pp2", "pp2-zb1p", "tp2-pp2-zb1p",
                              "tp2-recompute"])
def test_layouts_match_one_process_in_float64(tmp_path, dataset, reference, ranks, layout):
    ref_metrics, ref_params = reference
    metrics, params = train_run(ranks, tmp_path, dataset, *layout)
    for ref, got in zip(ref_metrics, metrics, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-10, abs=0), got["step"]
    for name, value in ref_params.items():
        err = np.linalg.norm(params[name] - value)
        assert err <= 1e-10 * np.linalg.norm(value), f"{name}: difference {err:.2e}"  # zero tensors: exactly


def test_a_stopped_lora_run_resumes_bitwise(tmp_path, dataset, reference):
    """Adapters, their AdamW moments and the frozen base go through a checkpoint and back exactly."""
    train_run(1, tmp_path, dataset, "train.stop_at=3", expect=75)
    metrics, params = train_run(1, tmp_path, dataset, resume="auto")
    assert metrics[-1]["loss"] == reference[0][-1]["loss"]
    for name, value in reference[1].items():
        assert np.array_equal(params[name], value), name


def test_a_zero3_lora_run_stopped_resumes_in_one_process(tmp_path, dataset, reference):
    """ZeRO-3 shards the frozen base (mpitrain/state/zero.py, ShardedFrozen): its checkpoint holds each rank's
    shard of the base, which one process reads back whole; the run then ends as the one-process run."""
    train_run(2, tmp_path, dataset, "parallel.zero=3", "train.stop_at=3", expect=75)
    metrics, params = train_run(1, tmp_path, dataset, resume="auto")
    assert metrics[-1]["loss"] == pytest.approx(reference[0][-1]["loss"], rel=1e-10, abs=0)
    for name, value in reference[1].items():
        if "_lora_" in name:
            assert np.linalg.norm(params[name] - value) <= 1e-10 * np.linalg.norm(value), name
        else:
            assert np.array_equal(params[name], value), name  # the base: bitwise, through the shards


def test_a_bfloat16_lora_run_keeps_the_base_exactly_in_its_checkpoint(tmp_path, dataset):
    import ml_dtypes

    from mpitrain.config import load_config
    _, params = train_run(1, tmp_path, dataset, "precision.compute=bfloat16", "train.steps=2")
    cfg = load_config("configs/tiny.toml", LORA)
    model = GPT(cfg.model, make_backend("cpu", "bfloat16"), lora=cfg.lora)
    for layout in model.layouts:
        for spec in layout.specs:
            if not spec.trainable:
                start = init_tensor(spec, layout.name, cfg.train.seed).astype(ml_dtypes.bfloat16).astype(np.float64)
                assert np.array_equal(params[f"{layout.name}.{spec.name}"], start), spec.name


def test_export_merge_lora_gives_the_logits_of_base_plus_adapters(tmp_path, reference, reference_dir):
    """The CLI's merged file against the trained adapters, both evaluated in float32."""
    import h5py

    from mpitrain.config import load_config
    out = tmp_path / "merged.h5"
    result = run_mpi(1, ["-m", "mpitrain", "ckpt", "export", str(reference_dir), str(out), "--merge-lora"])
    assert result.returncode == 0 and "12 LoRA adapters merged" in result.stdout, describe(result)
    _, params = reference
    with h5py.File(out, "r") as f:
        merged = {name: f["params"][name][()] for name in f["params"]}
    assert not any("_lora_" in name for name in merged) and len(merged) == len(params) - 24
    cfg = load_config("configs/tiny.toml", LORA)
    backend = make_backend("cpu", "float32")
    logits = []
    for lora, tensors in ((cfg.lora, params), (None, merged), (None, params)):  # the last: adapters left out
        model = GPT(cfg.model, backend, lora=lora)
        state = ReplicatedState(model.layouts, backend, None)
        for source in [buffer for buffer in (state.params, state.frozen) if buffer is not None]:
            for name, view in source.named_views():
                view[...] = tensors[name]
        tokens = np.random.default_rng(3).integers(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
        logits.append(model.last_logits(state, tokens))
    tolerance = 1e-6 * np.abs(logits[0]).max()
    assert np.abs(logits[0] - logits[1]).max() <= tolerance, np.abs(logits[0] - logits[1]).max()
    assert np.abs(logits[0] - logits[2]).max() > 100 * tolerance  # the trained adapters matter


def test_init_from_loads_weights_only_into_another_layout(tmp_path, dataset):
    """A base run (no LoRA), then a LoRA run at tp = 2 and a plain one at dp = 2 starting from its weights: both
    start at step 1 with the base model's loss (b = 0), and the LoRA run keeps the base tensors bitwise."""
    base_dir = tmp_path / "base"
    _, base = train_run(1, base_dir, dataset, "lora.rank=0", "train.steps=3")
    lora_metrics, lora_params = train_run(2, tmp_path / "lora", dataset, "parallel.tp=2", "train.steps=2",
                                          f"train.init_from={base_dir}")
    plain_metrics, _ = train_run(2, tmp_path / "plain", dataset, "lora.rank=0", "parallel.dp=2", "train.steps=2",
                                 f"train.init_from={base_dir}")
    assert lora_metrics[0]["step"] == plain_metrics[0]["step"] == 1
    assert lora_metrics[0]["loss"] == pytest.approx(plain_metrics[0]["loss"], rel=1e-10, abs=0)
    for name, value in base.items():
        assert np.array_equal(lora_params[name], value), name
    assert any(not np.array_equal(lora_params[n], 0) for n in lora_params if n.endswith("_lora_b"))


def test_init_from_a_missing_path_is_one_clear_line(tmp_path, dataset):
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path / "run"), "--set",
            f"data.path={dataset}", "--set", f"train.init_from={tmp_path / 'nowhere'}"]
    result = run_mpi(1, args)
    assert result.returncode != 0 and "train.init_from" in result.stderr and "Traceback" not in result.stderr, \
        describe(result)


# ---- mixture of experts: adapters on the experts' weights, the router frozen unless named ------------------------
MOE_TARGETS = {"gpt2": ["wq", "wo", "expert_w_fc", "expert_w_proj"],
               "llama": ["wv", "expert_w_gate", "expert_w_up", "expert_w_down"]}


def moe_model(arch, targets):
    cfg = ModelConfig(arch=arch, n_layer=2, d_model=16, n_head=4, vocab_size=40, seq_len=8,
                      moe={"experts": 4, "top_k": 2, "aux_loss": 0.1, "z_loss": 0.05, "balance": "aux_loss"})
    backend = make_backend("cpu", "float64")
    model = GPT(cfg, backend, lora=LoraConfig(rank=2, alpha=4.0, targets=targets))
    return model, ReplicatedState(model.layouts, backend, 0)


@pytest.mark.parametrize("arch, router", [("gpt2", False), ("llama", True)])
def test_expert_adapters_and_a_named_router_match_finite_differences(arch, router):
    """float64: every trainable tensor's gradient (the experts' and attention's adapters, the router when named),
    the auxiliary losses included, against central differences of the loss; nothing else trains."""
    targets = MOE_TARGETS[arch] + (["router"] if router else [])
    model, state = moe_model(arch, targets)
    randomise_adapters(state)
    names = [n for n, _ in state.params.named_views()]
    assert any("expert_w_" in n and "_lora_" in n for n in names)
    assert all("_lora_" in n or (router and n.endswith(".router")) for n in names), names
    assert any(n.endswith(".router") for n in names) == router
    rng = np.random.default_rng(1)
    tokens, targets_ = rng.integers(0, 40, (2, 8)), rng.integers(0, 40, (2, 8))

    def loss():
        state.zero_grads()
        state.begin_micro_batch(last=True)
        value, saved = model.forward(state, tokens, targets_, loss_scale=1.0)
        value += model.pop_aux_losses()["weighted"]
        model.backward(state, saved, 1.0)
        state.finish()
        return float(value)
    loss()
    analytic, params = state.grads.data.copy(), state.params
    checked = 0
    for index in rng.choice(params.size, 60, replace=False):
        keep = params.data[index]
        params.data[index] = keep + 1e-6
        plus = loss()
        params.data[index] = keep - 1e-6
        minus = loss()
        params.data[index] = keep
        assert analytic[index] == pytest.approx((plus - minus) / 2e-6, rel=1e-5, abs=1e-8), index
        checked += abs(analytic[index]) > 1e-6
    assert checked > 30


MOE_LORA = ["model.moe={experts = 4, top_k = 2}", "model.arch=gpt2", "lora.rank=4", "lora.alpha=8.0",
            'lora.targets=["wq", "wv", "expert_w_fc", "expert_w_proj", "router"]']


@pytest.fixture(scope="module")
def moe_lora_reference(tmp_path_factory):
    from tests.test_moe import train_run as moe_train_run
    return moe_train_run(1, tmp_path_factory.mktemp("moe-lora-one"), *MOE_LORA)


@pytest.mark.parametrize("ranks, layout", [(2, ["parallel.ep=2"]), (2, ["parallel.dp=2", "parallel.zero=1"]),
                                           (4, ["parallel.ep=2", "parallel.zero=1"]),
                                           (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
                                           (2, ["parallel.tp=2", "parallel.etp=1"])])
def test_moe_lora_layouts_match_one_process(tmp_path, moe_lora_reference, ranks, layout):
    """Expert adapters split over ep (reduced over expert_dp with dp 4 x ep 2), over tp with the experts (etp = tp:
    the up weights' b by columns, the down weight's a by rows) or whole (etp = 1), the router trained, ZeRO-1 over
    the adapters: losses, gradient norms and every tensor (the frozen base unchanged) at 1e-10 in float64."""
    from tests.test_moe import RTOL
    from tests.test_moe import train_run as moe_train_run
    run = moe_train_run(ranks, tmp_path / "run", *MOE_LORA, *layout)
    (ref_metrics, ref_params), (metrics, params) = moe_lora_reference, run
    assert [m["step"] for m in metrics] == [m["step"] for m in ref_metrics]
    for ref, got in zip(ref_metrics, metrics):
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            assert got[key] == pytest.approx(ref[key], rel=RTOL, abs=0), (key, got["step"])
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():  # frozen zero biases must stay exactly zero
        assert np.linalg.norm(params[name] - value) <= RTOL * np.linalg.norm(value), name
    assert np.abs(params["blocks.0.expert_w_fc_lora_b"]).max() > 0  # the experts' adapters trained
