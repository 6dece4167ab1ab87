"""FP8 recipes (mpitrain/layers/fp8.py): each quantizer against a reference written here (round to nearest even on
the format's value table, bit patterns compared), the linears' backward against its formula on the same quantized
operands in float64, and one launch that trains every recipe under tp 2 + sequence parallel, pp 2 and dp 2 ZeRO-3
beside one process: the same scales and the same losses."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.layers import fp8
from mpitrain.layers.linear import ColumnParallelLinear, RowParallelLinear
from mpitrain.layers.tensor_parallel import TensorParallel
from tests.mpi_helpers import run_python_mpi_results

DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def value_table(fmt):
    """(finite values, their codes) of an fp8 format, from its 256 bit patterns."""
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(DTYPES[fmt]).astype(np.float64)
    finite = np.isfinite(values)
    return values[finite], codes[finite]


def reference_cast(x, fmt):
    """Saturating round-to-nearest-even onto the format's values, as bytes: clip to +-max, pick the nearest value, a
    tie going to the code with an even last mantissa bit (-0 and +0 both read as 0)."""
    values, codes = value_table(fmt)
    top = values.max()
    out = np.empty(x.size, np.uint8)
    for i, v in enumerate(np.clip(np.asarray(x, np.float64).ravel(), -top, top)):
        distance = np.abs(values - v)
        best = np.flatnonzero(distance == distance.min())
        if len(best) > 1:
            best = best[codes[best] % 2 == 0]
        pick = codes[best[0]]
        out[i] = 0 if v == 0 else pick
    return out.reshape(np.shape(x))


def nonzero_bits(codes):
    """Bit patterns with -0 read as +0 (0x80 in both formats)."""
    bits = codes.view(np.uint8).copy()
    bits[bits == 0x80] = 0
    return bits


def random_tensor(shape, seed=0, spread=3.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp(spread * rng.standard_normal(shape))).astype(np.float32)


@pytest.mark.parametrize("fmt, top", [("e4m3", 448.0), ("e5m2", 57344.0)])
def test_per_tensor_scaling_matches_the_reference_and_clips_before_casting(fmt, top):
    x = random_tensor((37, 50))
    q = fp8.quantize_tensor(x, fmt)
    amax = np.abs(x).max()
    scale = np.float32(top) / np.float32(amax)
    assert q.scale_inv == np.float32(1) / scale
    assert np.array_equal(nonzero_bits(q.codes), reference_cast(x * scale, fmt))
    assert np.abs(q.dequantize(np.float64)).max() == pytest.approx(amax, rel=2 ** -3)
    # a scale from a smaller amax (a delayed one): out-of-range values saturate to the max, never NaN
    clipped = fp8.quantize_tensor(x, fmt, amax=amax / 10)
    values = clipped.codes.astype(np.float64)
    assert not np.isnan(values).any() and np.abs(values).max() == top
    assert np.isnan(np.float32(top * 2).astype(DTYPES["e4m3"])) or fmt == "e5m2"  # why the clip is needed
    zero = fp8.quantize_tensor(np.zeros((4, 4), np.float32), fmt)
    assert zero.scale_inv == 1 and not zero.codes.view(np.uint8).any()


def test_block_scaling_tiles_rows_by_128_and_weights_by_128x128():
    x = random_tensor((5, 300), seed=1)
    q = fp8.quantize_blocks(x, "e4m3", (1, 128))
    assert q.scale_inv.shape == (5, 3)  # 128 + 128 + 44: the edge tile is cut short
    for row in range(5):
        for tile in range(3):
            piece = x[row, tile * 128:(tile + 1) * 128]
            scale_inv = np.float32(1) / (np.float32(448) / np.float32(np.abs(piece).max()))
            assert q.scale_inv[row, tile] == scale_inv
            expected = reference_cast(piece * (np.float32(448) / np.float32(np.abs(piece).max())), "e4m3")
            assert np.array_equal(nonzero_bits(q.codes[row, tile * 128:(tile + 1) * 128]), expected)
    w = random_tensor((200, 130), seed=2)
    w[:128, :128] = 0.0  # an all-zero block: scale 1, codes 0
    qw = fp8.quantize_blocks(w, "e4m3", (128, 128))
    assert qw.scale_inv.shape == (2, 2) and qw.scale_inv[0, 0] == 1
    assert qw.scale_inv[1, 1] == np.float32(1) / (np.float32(448) / np.float32(np.abs(w[128:, 128:]).max()))
    assert not qw.codes[:128, :128].view(np.uint8).any()
    assert np.abs(qw.dequantize(np.float64) - w).max() <= np.abs(w).max() * 2 ** -4


def test_mxfp8_scales_are_ocp_powers_of_two_and_elements_clip():
    x = random_tensor((3, 96), seed=3)
    x[0, :32] = np.linspace(-500, 500, 32)  # amax 500: floor(log2) = 8, scale 2^0, so 500 -> 448 (the spec's clip)
    x[1, 32:64] = 0.0
    x[2, 64:96] *= 2.0 ** -130  # tiny amax: the exponent stops at e8m0's -127
    q = fp8.quantize_mx(x, "e4m3")
    assert q.scale_inv.dtype == np.dtype(ml_dtypes.float8_e8m0fnu) and q.scale_inv.shape == (3, 3)
    for row in range(3):
        for block in range(3):
            piece = x[row, block * 32:(block + 1) * 32].astype(np.float64)
            amax = np.abs(piece).max()
            power = 0 if amax == 0 else min(127, max(-127, math.floor(math.log2(amax)) - 8))
            assert q.scale_inv.view(np.uint8)[row, block] == power + 127  # e8m0: the biased exponent, no mantissa
            expected = reference_cast(piece / 2.0 ** power, "e4m3")
            assert np.array_equal(nonzero_bits(q.codes[row, block * 32:(block + 1) * 32]), expected)
    assert q.codes[0, :32].astype(np.float64).max() == 448.0
    down = fp8.quantize_mx(x.T.copy(), "e4m3", axis=0)  # a weight's blocks run down its rows (the reduction axis)
    assert np.array_equal(down.codes.view(np.uint8), q.codes.T.view(np.uint8))


def test_delayed_scaling_uses_the_max_of_the_previous_steps():
    history = fp8.DelayedScaling(2)
    assert history.amax_for(3.0) == 3.0  # empty history: this step's own amax
    history.roll()
    assert history.amax_for(1.0) == 3.0 and history.amax_for(5.0) == 3.0  # records 5 for this step
    history.roll()
    assert history.amax_for(0.5) == 5.0
    history.roll()  # the window of 2 now holds 0.5 and 5
    history.roll(0.25)
    assert history.amax_for(1.0) == 0.5  # 5 dropped out
    x = random_tensor((8, 8), seed=4)
    q = fp8.quantize_tensor(x, "e4m3", amax=history.amax_for(0.0))
    assert q.scale_inv == np.float32(1) / (np.float32(448) / np.float32(0.5))


@pytest.mark.parametrize("recipe", ["tensor", "delayed", "block", "mxfp8"])
def test_fp8_linears_backward_is_the_formula_on_the_quantized_operands(recipe):
    """Column then row linear, float64, one rank: outputs, input gradients and weight gradients against
    x_q @ W_q, dy_q @ W_q^T and x_q^T @ dy_q with each operand quantized here by the recipe's function."""
    rng = np.random.default_rng(5)
    b, t, c, f = 2, 3, 64, 160
    params = {"w1": rng.standard_normal((c, f)), "b1": rng.standard_normal(f), "w2": rng.standard_normal((f, c))}
    grads = {name: np.zeros_like(value) for name, value in params.items()}
    tp = TensorParallel()
    up, down = ColumnParallelLinear(tp, c, ["w1"], ["b1"]), RowParallelLinear(tp, f, "w2")
    up.fp8, down.fp8 = fp8.Fp8Gemms(recipe), fp8.Fp8Gemms(recipe)
    x, dy = rng.standard_normal((b, t, c)), rng.standard_normal((b, t, c)) * 1e-3

    q = recipe_quantizer(recipe)

    (h,), saved_up = up.forward(params, x)
    y, saved_down = down.forward(params, h)
    x2, h2 = x.reshape(-1, c), h.reshape(-1, f)
    w1q, w2q = q(params["w1"], "e4m3", True), q(params["w2"], "e4m3", True)
    assert np.allclose(h2, q(x2, "e4m3") @ w1q + params["b1"], rtol=1e-13, atol=0)
    assert np.allclose(y.reshape(-1, c), q(h2, "e4m3") @ w2q, rtol=1e-13, atol=0)
    assert not np.allclose(y.reshape(-1, c), h2 @ params["w2"], rtol=1e-6)  # the quantization is really there
    dh = down.backward(params, grads, saved_down, dy)
    dyq = q(dy.reshape(-1, c), "e5m2")
    assert np.allclose(dh.reshape(-1, f), dyq @ w2q.T, rtol=1e-13, atol=0)
    assert np.allclose(grads["w2"], q(h2, "e4m3").T @ dyq, rtol=1e-13, atol=0)
    dx = up.backward(params, grads, saved_up, [dh])
    dhq = q(dh.reshape(-1, f), "e5m2")
    assert np.allclose(dx.reshape(-1, c), dhq @ w1q.T, rtol=1e-13, atol=0)
    assert np.allclose(grads["w1"], q(x2, "e4m3").T @ dhq, rtol=1e-13, atol=0)
    assert np.allclose(grads["b1"], dh.reshape(-1, f).sum(axis=0), rtol=1e-13, atol=0)  # the unquantized dy


def recipe_quantizer(recipe):
    """The recipe's quantizer, called directly: (array, format, is a weight) -> its dequantized fp8 values."""
    def q(a, fmt, weight=False):
        if recipe in ("tensor", "delayed"):
            return fp8.quantize_tensor(a, fmt).dequantize(np.float64)
        if recipe == "block":
            return fp8.quantize_blocks(a, fmt, (128, 128) if weight else (1, 128)).dequantize(np.float64)
        return fp8.quantize_mx(a, fmt, axis=0 if weight else -1).dequantize(np.float64)
    return q


@pytest.mark.parametrize("recipe", ["tensor", "delayed", "block", "mxfp8"])
def test_lora_adapters_read_the_unquantized_input_beside_the_fp8_base(recipe):
    """LoRA on a frozen column and row linear, float64, one rank: y = x_q W_q + s (x a) b with x, a, b unquantized;
    the input gradient dy_q W_q^T + s dy b^T a^T; a's and b's gradients exact (x^T (s dy b^T), s (x a)^T dy)."""
    from mpitrain.layers.lora import Adapter

    rng = np.random.default_rng(6)
    b, t, c, f, r, s = 2, 3, 64, 160, 4, 2.0
    tp = TensorParallel()
    up, down = ColumnParallelLinear(tp, c, ["w1"], trainable=False), RowParallelLinear(tp, f, "w2", trainable=False)
    up.adapters["w1"] = Adapter("w1", "column", (c, f), r, s * r, tp)
    down.adapters["w2"] = Adapter("w2", "row", (f, c), r, s * r, tp)
    params = {"w1": rng.standard_normal((c, f)), "w2": rng.standard_normal((f, c)),
              "w1_lora_a": rng.standard_normal((c, r)), "w1_lora_b": rng.standard_normal((r, f)),
              "w2_lora_a": rng.standard_normal((f, r)), "w2_lora_b": rng.standard_normal((r, c))}
    grads = {name: np.zeros_like(value) for name, value in params.items() if "lora" in name}
    for linear in (up, down):
        linear.fp8 = fp8.Fp8Gemms(recipe)
        linear.fp8.cache_weights = recipe in ("block", "mxfp8")  # as apply_fp8 sets it for a frozen base
    q = recipe_quantizer(recipe)
    x, dy = rng.standard_normal((b, t, c)), rng.standard_normal((b, t, c)) * 1e-3
    x2, dy2 = x.reshape(-1, c), dy.reshape(-1, c)
    for _ in range(2):  # the second pass: block / mxfp8 multiply the cached base
        (h,), saved_up = up.forward(params, x)
        y, saved_down = down.forward(params, h)
    h2, w1q, w2q = h.reshape(-1, f), q(params["w1"], "e4m3", True), q(params["w2"], "e4m3", True)
    a1, b1, a2, b2 = (params[n] for n in ("w1_lora_a", "w1_lora_b", "w2_lora_a", "w2_lora_b"))
    assert np.allclose(h2, q(x2, "e4m3") @ w1q + s * (x2 @ a1) @ b1, rtol=1e-13, atol=1e-13)
    assert np.allclose(y.reshape(-1, c), q(h2, "e4m3") @ w2q + s * (h2 @ a2) @ b2, rtol=1e-13, atol=1e-13)
    assert not np.allclose(h2, q(x2, "e4m3") @ w1q + s * (q(x2, "e4m3") @ a1) @ b1, rtol=1e-6)  # x really unquantized
    dh = down.backward(params, grads, saved_down, dy)
    assert np.allclose(dh.reshape(-1, f), q(dy2, "e5m2") @ w2q.T + s * dy2 @ b2.T @ a2.T, rtol=1e-13, atol=1e-13)
    assert np.allclose(grads["w2_lora_b"], s * (h2 @ a2).T @ dy2, rtol=1e-13, atol=0)
    assert np.allclose(grads["w2_lora_a"], h2.T @ (s * dy2 @ b2.T), rtol=1e-13, atol=0)
    dx = up.backward(params, grads, saved_up, [dh])
    dh2 = dh.reshape(-1, f)
    assert np.allclose(dx.reshape(-1, c), q(dh2, "e5m2") @ w1q.T + s * dh2 @ b1.T @ a1.T, rtol=1e-13, atol=1e-13)
    assert np.allclose(grads["w1_lora_b"], s * (x2 @ a1).T @ dh2, rtol=1e-13, atol=0)
    assert np.allclose(grads["w1_lora_a"], x2.T @ (s * dh2 @ b1.T), rtol=1e-13, atol=0)
    assert set(up.fp8.cached) == ({"w1"} if recipe in ("block", "mxfp8") else set())


def test_bad_fp8_settings_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="precision.fp8"):
        load_config("configs/tiny.toml", ["precision.fp8=fp4"])
    with pytest.raises(ConfigError, match="precision.fp8_history"):
        load_config("configs/tiny.toml", ["precision.fp8=delayed", "precision.fp8_history=0"])
    with pytest.raises(ConfigError, match="precision.fp8 = 'block'.*parallel.tp = 2.*MLP"):  # shards of 64 < 128
        load_config("configs/tiny.toml", ["precision.fp8=block", "parallel.tp=2"])
    load_config("configs/tiny.toml", ["precision.fp8=mxfp8", "parallel.tp=2", "model.d_model=64", "model.n_head=2"])
    with pytest.raises(ConfigError, match="precision.fp8 = 'block'.*parallel.tp = 2"):  # the linears' own check
        fp8.check_block_alignment("block", 96, 2, "blocks.0.mlp.up.w_fc")
    moe = "model.moe={experts = 4, top_k = 2}"
    with pytest.raises(ConfigError, match="precision.fp8 = 'tensor' with model.moe under parallel.ep = 2.*row-wise"):
        load_config("configs/tiny.toml", ["precision.fp8=tensor", moe, "parallel.ep=2", "parallel.dp=2"])
    load_config("configs/tiny.toml", ["precision.fp8=mxfp8", moe, "parallel.ep=2", "parallel.dp=2"])  # row-wise
    with pytest.raises(ConfigError, match="parallel.tp = 2 > model.n_kv_head = 1: the replicated key/value heads"):
        load_config("configs/tiny.toml", ["precision.fp8=tensor", "model.arch=llama", "model.n_kv_head=1",
                                          "parallel.tp=2"])


def test_delayed_training_does_not_depend_on_how_often_it_evaluates():
    """Two delayed runs differing only in train.eval_every train bitwise alike: validation forwards quantize at the
    current scales and record no amax (Trainer.evaluate under scales_only)."""
    from mpi4py import MPI

    from mpitrain.train import Trainer

    def losses(eval_every):
        cfg = load_config("configs/tiny.toml", ["data.synthetic=true", "precision.compute=float64", "train.steps=4",
                                                "precision.fp8=delayed", f"train.eval_every={eval_every}",
                                                "logging.peak_flops=1e9", "optim.lr=1e-2"])
        trainer, out = Trainer(cfg, MPI.COMM_SELF), []
        for step in range(cfg.train.steps):
            out.append(trainer.train_step(step).loss)
            if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0:
                assert math.isfinite(trainer.evaluate())
        return out

    assert losses(1) == losses(0)


BASE = ["data.synthetic=true", "precision.compute=float64", "train.steps=2", "train.global_batch=4",
        "train.micro_batch=2", "model.d_model=256", "model.n_head=4", "model.seq_len=8", "model.n_layer=2",
        "train.thread_replicas=1", "logging.peak_flops=1e9", "optim.warmup_steps=1", "optim.lr=1e-2"]
LAYOUTS = {"one": [], "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"], "pp2": ["parallel.pp=2"],
           "dp2_zero3": ["parallel.zero=3"]}
LORA = ["lora.rank=4", 'lora.targets=["wq", "wv", "wo", "w_fc", "w_proj"]', "train.steps=3"]  # column and row
PARITY_JOB = """
    import json
    import numpy as np
    from mpi4py import MPI
    from mpitrain.backend import nbytes_of
    from mpitrain.config import load_config
    from mpitrain.train import Trainer
    from mpitrain.layers.fp8 import scale_summary, scales_only
    from mpitrain.plan.memory import activation_bytes

    world = MPI.COMM_WORLD
    BASE, LAYOUTS, LORA = __SETTINGS__

    def run(recipe, layout, extra=(), evaluate_first=False):
        comm = world.Split(world.rank if layout == "one" else 0, world.rank)
        cfg = load_config("configs/tiny.toml", BASE + [f"precision.fp8={recipe}"] + LAYOUTS[layout] + list(extra))
        trainer = Trainer(cfg, comm)
        if evaluate_first:  # a fresh trainer's validation forwards before its first step change nothing
            trainer.evaluate()
        steps = [trainer.train_step(step) for step in range(cfg.train.steps)]
        losses = [result.loss for result in steps]
        merged = {}
        for summary in world.allgather(scale_summary(trainer.fp8_gemms)):
            for key, (low, high) in summary.items():  # tp pieces: the whole tensor's smallest and largest scales
                old = merged.get(key, (low, high))
                merged[key] = (min(old[0], low), max(old[1], high))
        held = {"history_bytes": sum(h.history.nbytes for g in trainer.fp8_gemms for h in g.delayed.values()),
                "weight_elements": sum(n for g in trainer.fp8_gemms for n in g.weight_elements.values()),
                "cached_elements": sum(w.size for g in trainer.fp8_gemms for w in g.cached.values()),
                "cached_bytes": sum(w.nbytes for g in trainer.fp8_gemms for w in g.cached.values()),
                "scale_keys": sum(len(g.recent_scales) for g in trainer.fp8_gemms),
                "scale_bytes": sum(a.nbytes for g in trainer.fp8_gemms for recent in g.recent_scales.values()
                                   for pair in recent for a in pair)}
        comm.Free()
        return {"losses": losses, "scales": merged, "rank0_holds": world.bcast(held),
                "first_step_bytes": world.bcast(steps[0].comm_bytes)}

    def bf16_tp2(recipe):  # tp 2 + SP in bfloat16: one micro-batch's saved state, a step's tp gathers and scatters
        cfg = load_config("configs/tiny.toml", BASE + [f"precision.fp8={recipe}", "precision.compute=bfloat16"] +
                          LAYOUTS["tp2_sp"])
        trainer = Trainer(cfg, world)
        tokens = np.random.default_rng(0).integers(0, 256, (cfg.train.micro_batch, cfg.model.seq_len))
        with scales_only(trainer.fp8_gemms):  # a forward outside training, before the step (not in its bytes)
            saved = nbytes_of(trainer.model.forward(trainer.state, tokens, tokens)[1])
        trainer.train_step(0)  # resets the counters first: after it they hold the step's bytes alone
        sent = {kind: trainer.mesh.tp.bytes_sent[kind] for kind in ("all_gather", "reduce_scatter")}
        return {"saved": world.bcast(saved), "estimated": activation_bytes(cfg), "sent": world.bcast(sent)}

    results = {recipe: {layout: run(recipe, layout) for layout in LAYOUTS}
               for recipe in ["tensor", "delayed", "block", "mxfp8"]}
    results["selective"] = {recipe: run(recipe, "tp2_sp", ["memory.recompute=selective"])  # exact: as without it
                            for recipe in ["tensor", "delayed", "block", "mxfp8"]}
    results["none"] = {"one": run("none", "one")}
    results["evaluate_first"] = {recipe: run(recipe, "tp2_sp", evaluate_first=True) for recipe in ("tensor", "delayed")}
    results["bf16_tp2"] = {recipe: bf16_tp2(recipe) for recipe in ("none", "tensor")}
    results["lora"] = {recipe: {layout: run(recipe, layout, LORA) for layout in ("one", "tp2_sp")}
                       for recipe in ["tensor", "delayed", "block", "mxfp8"]}
    if world.rank == 0:
        print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def parity():
    return run_python_mpi_results(2, PARITY_JOB.replace("__SETTINGS__", repr((BASE, LAYOUTS, LORA))), timeout=400)


@pytest.mark.parametrize("recipe", ["tensor", "delayed", "block", "mxfp8"])
def test_every_layout_computes_the_one_process_scales_and_losses(parity, recipe):
    runs = parity[recipe]
    reference = runs["one"]
    assert len(reference["scales"]) == 2 * 16  # 2 blocks: x, w and dy of 4 linears, qkv with 3 weights (7 keys)
    for layout in ("tp2_sp", "pp2", "dp2_zero3"):
        run = runs[layout]
        assert run["scales"].keys() == reference["scales"].keys(), layout
        for key, (low, high) in reference["scales"].items():
            assert run["scales"][key] == pytest.approx([low, high], rel=1e-9), f"{layout} {key}"
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0), layout
    assert reference["losses"] != parity["none"]["one"]["losses"]  # FP8 changed the run
    for layout, run in runs.items():  # mpitrain memory's formula against what world rank 0 held
        planned = fp8.fp8_extra_bytes(load_config("configs/tiny.toml", BASE + [f"precision.fp8={recipe}"] +
                                                  LAYOUTS[layout]))
        held = run["rank0_holds"]
        assert held["history_bytes"] == planned["amax_history"], layout
        assert held["cached_bytes"] == planned["cached_weights"] == 0, layout  # no fp8 weight copy is kept
        # per-tensor scales: a window of the latest RECENT_SCALES per operand key (2 steps fill it only in part)
        assert held["scale_keys"] * fp8.RECENT_SCALES * 8 == planned["fp8_scales"], layout
        assert 0 < held["scale_bytes"] <= planned["fp8_scales"] if recipe in ("tensor", "delayed") else \
            held["scale_bytes"] == 0, layout
    assert reference["losses"][0] == pytest.approx(parity["none"]["one"]["losses"][0], rel=1e-2)  # before updates


@pytest.mark.parametrize("recipe", ["tensor", "delayed", "block", "mxfp8"])
def test_selective_recomputation_under_tp_and_sp_trains_as_without_it(parity, recipe):
    """tp 2 + sequence parallelism: qkv's and up's inputs, entered (gathered) again by selective recomputation, are
    quantized again to the forward's values (at the forward's amax), so the second step's loss (after one update of
    weight gradients that multiply them) and the scales are those without recomputation (tests/test_recompute.py:
    bitwise gradients in one process)."""
    plain, selective = parity[recipe]["tp2_sp"], parity["selective"][recipe]
    assert selective["losses"] == pytest.approx(plain["losses"], rel=1e-12, abs=0)
    assert selective["scales"] == plain["scales"]


@pytest.mark.parametrize("recipe", ["tensor", "delayed", "block", "mxfp8"])
def test_lora_under_fp8_computes_the_one_process_losses_under_tp(parity, recipe):
    """LoRA (adapters on column and row linears) beside the fp8 base: tp 2 + sequence parallel trains 3 steps at the
    one-process losses and scales; frozen block / mxfp8 bases are cached, and mpitrain memory's fp8 weights count
    exactly that cache."""
    one, tp2 = parity["lora"][recipe]["one"], parity["lora"][recipe]["tp2_sp"]
    assert tp2["losses"] == pytest.approx(one["losses"], rel=1e-6, abs=0)
    assert tp2["scales"].keys() == one["scales"].keys()
    for key, (low, high) in one["scales"].items():
        assert tp2["scales"][key] == pytest.approx([low, high], rel=1e-9), key
    for layout, run in (("one", one), ("tp2_sp", tp2)):
        planned = fp8.fp8_extra_bytes(load_config("configs/tiny.toml", BASE + [f"precision.fp8={recipe}"] +
                                                  LAYOUTS[layout] + LORA))
        held = run["rank0_holds"]
        assert held["cached_bytes"] == planned["cached_weights"], layout  # a frozen block / mxfp8 base, float64
        assert held["cached_elements"] == (held["weight_elements"] if recipe in ("block", "mxfp8") else 0), layout


def test_fp8_saved_inputs_and_tp_gathers_are_the_planned_bytes(parity):
    """tp 2 + sequence parallelism in bfloat16: a micro-batch's saved state is mpitrain memory's activation estimate
    to the byte with and without FP8 (qkv's and up's inputs saved dequantized, float32: 2 bytes more an element),
    and a step's tp gathers and scatters grow by the planner's tp_collectives bytes (the dequantized inputs and row
    linears' output gradients gathered in float32, gpt2's output gradients gathered again for the bias). The forward
    runs first: the step's bytes are the tp counters after it (train_step resets them), not a difference from a
    snapshot taken before it, which would take the forward's own gathers (one micro-batch's) off the step's."""
    from mpitrain.plan.cost_precision import tp_collectives
    none, tensor = parity["bf16_tp2"]["none"], parity["bf16_tp2"]["tensor"]
    for run in (none, tensor):
        assert run["saved"] == run["estimated"], run
    cfg = load_config("configs/tiny.toml", BASE + ["precision.fp8=tensor", "precision.compute=bfloat16"] +
                      LAYOUTS["tp2_sp"])
    rows, width, blocks = cfg.train.micro_batch * cfg.model.seq_len, cfg.model.d_model, cfg.model.n_layer
    assert tensor["saved"] - none["saved"] == blocks * 2 * rows * width * (4 - 2)
    plain = load_config("configs/tiny.toml", BASE + ["precision.compute=bfloat16"] + LAYOUTS["tp2_sp"])
    per_element = sum(wire for _, wire, _ in tp_collectives(cfg, 2, False)) - \
        sum(wire for _, wire, _ in tp_collectives(plain, 2, False))
    micro_batches = cfg.train.global_batch // cfg.train.micro_batch
    grown = sum(tensor["sent"].values()) - sum(none["sent"].values())
    assert grown == blocks * micro_batches * per_element * rows * width / 2 > 0  # a ring all-gather: (t - 1) / t


@pytest.mark.parametrize("recipe", ["tensor", "delayed"])
def test_an_evaluation_before_the_first_step_changes_nothing_under_tp_and_sp(parity, recipe):
    """tp 2 + sequence parallelism: validation forwards on a fresh trainer (scales_only) leave no state behind that
    its steps read (no cached gather, scale or amax): the same losses bit for bit, the same scales, and a first step
    whose counted bytes are a fresh trainer's."""
    plain, first = parity[recipe]["tp2_sp"], parity["evaluate_first"][recipe]
    assert first["losses"] == plain["losses"]
    assert first["scales"] == plain["scales"]
    assert first["first_step_bytes"] == plain["first_step_bytes"]
    assert plain["first_step_bytes"]["all_gather"] > 0


def test_delayed_histories_survive_a_checkpoint_under_pp(tmp_path):
    """pp 2, delayed scaling: a run resumed from its step-2 checkpoint trains steps 3 and 4 exactly as the
    uninterrupted run (the restored windows give the same scales; an empty window would not), and the index that rank
    0 writes holds both stages' histories."""
    import json

    from tests.mpi_helpers import describe, run_mpi

    settings = ["data.synthetic=true", "precision.compute=float64", "precision.fp8=delayed", "precision.fp8_history=3",
                "parallel.pp=2", "train.steps=4", "checkpoint.every=2", "checkpoint.keep=0", "logging.peak_flops=1e9",
                "optim.lr=1e-2"]

    def train(run_dir, *extra):
        args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir), *extra]
        for setting in settings:
            args += ["--set", setting]
        result = run_mpi(2, args, timeout=180)
        assert result.returncode == 0, describe(result)
        return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}

    whole = train(tmp_path / "whole")
    step2 = tmp_path / "whole" / "checkpoints" / "step_00000002"
    index = json.loads(next(step2.glob("*.json")).read_text())
    histories = index["extra_state"]["fp8_amax_history"]
    assert {name.split(".")[1] for name in histories} == {"0", "1"}  # both pipeline stages' blocks
    assert all(len(values) == 2 for values in histories.values())  # two steps recorded
    resumed = train(tmp_path / "resumed", "--resume", str(step2))
    assert [resumed[step] for step in (3, 4)] == [whole[step] for step in (3, 4)]


def grid_probes(fmt, dtype):
    """Every finite value of the format, the midpoints between neighbours (ties) and one float32 ulp either side,
    values beyond the max (and inf), float32 subnormals, signed zeros and NaN; in float64 also ties nudged by 2^-40
    relative (ml_dtypes rounds float64 through float32, so they round as the tie does)."""
    values, _ = value_table(fmt)
    finite = np.unique(values).astype(np.float32)
    ties = (finite[:-1] + finite[1:]) / 2
    top = finite.max()
    probes = [finite, ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(np.inf)),
              np.nextafter(top, np.float32(np.inf)) * np.float32([1, -1]),
              np.float32([2 * top, -1e30, np.inf, -np.inf]),
              np.float32([1e-45, -1e-45, 1e-40, 2.0 ** -126]), np.float32([0.0, -0.0, np.nan, -np.nan])]
    if dtype == np.float64:
        probes.append(ties.astype(np.float64) * (1 + 2.0 ** -40))
    return np.concatenate([p.astype(dtype) for p in probes])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rounding_by_arithmetic_is_ml_dtypes_cast_bit_for_bit(fmt, dtype):
    """comm.quantized.fp8_round (the route CuPy takes, run on numpy) after the clip equals ml_dtypes' cast of the
    clipped value: every value, tie, neighbour, beyond-max, subnormal, -0 (sign kept) and NaN (stays NaN)."""
    from mpitrain.comm.quantized import fp8_round

    x = grid_probes(fmt, dtype)
    top = fp8.FP8_MAX[fmt]
    clipped = np.clip(x, -top, top)
    expected = clipped.astype(DTYPES[fmt]).astype(np.float32)
    got = fp8_round(np, clipped.astype(np.float32), fmt)
    assert got.dtype == np.float32
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan) and nan.sum() == 2
    wrong = np.flatnonzero(got[~nan].view(np.uint32) != expected[~nan].view(np.uint32))  # -0 and +0 differ here
    assert wrong.size == 0, f"{wrong.size} differ, first {x[~nan][wrong[:3]]}: {got[~nan][wrong[:3]]}"
    assert np.array_equal(fp8.cast_saturating(x, fmt).view(np.uint8), clipped.astype(DTYPES[fmt]).view(np.uint8))


@pytest.mark.parametrize("recipe", ["tensor", "delayed", "block", "mxfp8"])
def test_fp8_on_cuda_is_accepted(recipe):
    """Its GEMMs go through cuBLASLt there (mpitrain/layers/fp8_lt.py; mxfp8 stays emulated on Hopper)."""
    cfg = load_config("configs/tiny.toml", [f"precision.fp8={recipe}", "train.device=cuda"])
    assert (cfg.precision.fp8, cfg.train.device) == (recipe, "cuda")
