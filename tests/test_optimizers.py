"""The lean optimizers (optim.name = adafactor | adam8bit | sgd): against hand-written reference math in float64,
their state's bytes per parameter, exact checkpoint round trips, and bitwise resume of a training run."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from mpitrain.optim import quant4
from mpitrain.optim.adafactor import Adafactor
from mpitrain.optim.adam8bit import BLOCK, Adam8bit, quantization_map
from mpitrain.optim.adamw import AdamW, AdamWHyper
from mpitrain.optim.sgd import SGD
from mpitrain.state.params import FlatBuffer, ParamSpec, UnitLayout, intersect
from mpitrain.state.strategy import Segment, ShardLayout
from tests.test_checkpoint import PREEMPTED, losses, small_epochs, train  # noqa: F401 (fixture)

STEPS = 8
LRS = [1e-2 * (1 + i % 3) for i in range(STEPS)]


def _layout(rows=5, cols=7):
    """Two matrices (decayed), a bias and a norm gain (not decayed)."""
    return UnitLayout("u", [ParamSpec("b", (cols,), "zeros"), ParamSpec("w1", (rows, cols), "normal", 0.1),
                            ParamSpec("g", (rows,), "ones"), ParamSpec("w2", (cols, 3), "normal", 0.1)])


def _problem(layout, seed=0):
    rng = np.random.default_rng(seed)
    params = FlatBuffer.allocate([layout], np, np.float64)
    grads = FlatBuffer.allocate([layout], np, np.float64)
    params.data[:] = rng.normal(size=params.size)
    gradients = [rng.normal(size=params.size) * (1 + rng.random()) for _ in range(STEPS)]
    return params, grads, gradients


def _tensors(layout):
    """(start, end, shape, decayed) of every tensor in the flat buffer."""
    out, offset = [], 0
    for spec in layout.specs:
        out.append((offset, offset + spec.size, spec.shape, spec.decay))
        offset += spec.size
    return out


def _run(optimizer, grads, gradients, grad_scale=0.5):
    for step, g in enumerate(gradients):
        grads.data[:] = g
        optimizer.step(LRS[step], grad_scale)


# -- Adafactor
def reference_adafactor(params, gradients, tensors, wd, grad_scale, factor_2d=True, beta1=0.9, clip_pieces=None,
                        d=1.0, store_m=None):
    """Shazeer & Stern's Adafactor: factored (or full) second moment with beta2_t = 1 - t^-0.8, the update clipped
    to rms <= d (0: no clipping) over each of clip_pieces (global ranges; default: each tensor), then the first
    moment (beta1 > 0), debiased as Adam's; store_m(m, t): the moment as stored (default: exactly)."""
    p = params.copy()
    state, m = {}, np.zeros_like(p)
    clip_pieces = clip_pieces or [(start, end) for start, end, _, _ in tensors]
    for t, g_all in enumerate(gradients, start=1):
        beta2, lr = 1.0 - t ** -0.8, LRS[t - 1]
        update = np.zeros_like(p)
        for start, end, shape, _ in tensors:
            g = g_all[start:end].reshape(shape) * grad_scale
            u = g ** 2 + 1e-30
            if len(shape) == 2 and factor_2d:
                r, c = state.get(start, (np.zeros(shape[0]), np.zeros(shape[1])))
                r = beta2 * r + (1 - beta2) * u.mean(axis=1)
                c = beta2 * c + (1 - beta2) * u.mean(axis=0)
                state[start] = (r, c)
                v_hat = np.outer(r, c) / r.mean()
            else:
                v_hat = beta2 * state.get(start, np.zeros(shape)) + (1 - beta2) * u
                state[start] = v_hat
            update[start:end] = (g / np.sqrt(v_hat)).ravel()
        for start, end in clip_pieces if d else ():
            update[start:end] /= max(1.0, np.sqrt(np.mean(update[start:end] ** 2)) / d)
        if beta1:
            m = beta1 * m + (1 - beta1) * update
            m = store_m(m, t) if store_m else m
            update = m / (1 - beta1 ** t)
        for start, end, _, decayed in tensors:
            if decayed:
                p[start:end] *= 1 - lr * wd
        p -= lr * update
    return p


@pytest.mark.parametrize("beta1", [0.9, 0.0])
def test_adafactor_matches_reference_math(beta1):
    layout = _layout()
    params, grads, gradients = _problem(layout)
    start = params.data.copy()
    segment = Segment(params.data, grads.data, params.ranges(lambda spec: spec.decay))
    optimizer = Adafactor([segment], ShardLayout(params, [(0, params.size)]), weight_decay=0.1, beta1=beta1)
    assert sorted(r.size for r in optimizer.rows.values()) == [5, 7]  # both matrices factored
    assert len(optimizer.pieces[0]) == 4  # every tensor clipped on its own
    _run(optimizer, grads, gradients)
    expected = reference_adafactor(start, gradients, _tensors(layout), 0.1, 0.5, beta1=beta1)
    np.testing.assert_allclose(params.data, expected, rtol=1e-12, atol=1e-14)
    clipped_nowhere = reference_adafactor(start, gradients, _tensors(layout), 0.1, 0.5, beta1=beta1, d=0)
    assert np.abs(clipped_nowhere - expected).max() > 1e-6  # the clipping acted (the test can tell)


def reference_int4(m, seed):
    """quant4's storage written out block by block: scale = absmax / 7, codes floor(m / scale + uniform draw) in
    -7..7 (stochastic rounding, the draws being quant4.uniform's for `seed`, one per element)."""
    out = np.zeros_like(m)
    draws = quant4.uniform(seed, 0, m.size, np)
    for lo in range(0, m.size, 128):
        block = m[lo:lo + 128]
        scale = np.abs(block).max() / 7
        if scale > 0:
            out[lo:lo + 128] = np.clip(np.floor(block / scale + draws[lo:lo + 128]), -7, 7) * scale
    return out


def test_adafactor_with_int4_momentum_matches_reference_math():
    """optim.adafactor_momentum = int4: the first moment stored in 4 bits (blocks of 128, stochastic rounding);
    740 parameters make 6 blocks, the last one short."""
    layout = _layout(rows=20, cols=30)
    params, grads, gradients = _problem(layout, seed=2)
    start = params.data.copy()
    segment = Segment(params.data, grads.data, params.ranges(lambda spec: spec.decay))
    optimizer = Adafactor([segment], ShardLayout(params, [(0, params.size)]), weight_decay=0.1, momentum="int4")
    # blocks are each tensor's: w1 (600 elements) 5, w2 (90) 1, b (30) 1, g (20) 1
    assert optimizer.m is None and optimizer.m_codes.size == 370 and optimizer.m_scales[0].size == 8
    _run(optimizer, grads, gradients)

    def store_m(m, t):  # each tensor's blocks, seeded by the step and the tensor's name
        out = np.empty_like(m)
        for (a, b, _, _), spec in zip(_tensors(layout), layout.specs):
            out[a:b] = reference_int4(m[a:b], (t << 32) | zlib.crc32(f"u.{spec.name}".encode()))
        return out

    expected = reference_adafactor(start, gradients, _tensors(layout), 0.1, 0.5, store_m=store_m)
    np.testing.assert_allclose(params.data, expected, rtol=1e-12, atol=1e-14)
    exact_m = reference_adafactor(start, gradients, _tensors(layout), 0.1, 0.5)
    assert np.abs(exact_m - expected).max() > 1e-6  # the 4-bit storage shows (the test can tell)


def test_int4_storage_rounds_without_bias():
    """Stochastic rounding: averaged over many draws the stored value is the value (a moving average stored every
    step keeps its small increments); rounding to nearest is off by up to half a code step, and the test sees it."""
    values = np.random.default_rng(3).normal(size=300)
    step = np.abs(values[:128]).max() / 7  # the first block's code step
    stored = np.mean([quant4.dequantize(*quant4.quantize(values, np, seed=k), np) for k in range(2000)], axis=0)
    assert np.abs(stored - values)[:128].max() < 0.06 * step
    nearest = quant4.dequantize(*quant4.quantize(values, np), np)
    assert np.abs(nearest - values)[:128].max() > 0.3 * step
    codes = quant4.quantize(values, np, seed=1)[0]
    assert np.array_equal(quant4.unpack(quant4.pack(codes, np), 300, np), codes) and quant4.pack(codes, np).size == 150


def test_adafactor_momentum_storage_is_a_checked_key():
    from mpitrain.config import load_config
    from mpitrain.errors import ConfigError
    assert load_config("configs/tiny.toml", ["optim.name=adafactor"]).optim.adafactor_momentum == "int4"
    with pytest.raises(ConfigError, match="optim.adafactor_momentum = 'int3': expected int4 or full"):
        load_config("configs/tiny.toml", ["optim.name=adafactor", "optim.adafactor_momentum=int3"])


@pytest.mark.parametrize("momentum", ["full", "int4"])
def test_adafactor_on_cut_matrices_is_the_whole_tensor_run(momentum):
    """Segments cutting w1 mid-row and w2 (as ZeRO shard boundaries do): the pieces' row and column sums and their
    clipping sums are combined per tensor, so the run is the one-segment run (every tensor factored and clipped
    whole), to rounding."""
    layout = _layout(rows=20, cols=30)
    decay = FlatBuffer.geometry([layout]).ranges(lambda spec: spec.decay)
    results = []
    for windows in ([(0, 740)], [(0, 45), (45, 611), (611, 740)]):
        params, grads, gradients = _problem(layout, seed=1)
        segments = [Segment(params.data[a:b], grads.data[a:b], intersect(decay, a, b)) for a, b in windows]
        optimizer = Adafactor(segments, ShardLayout(params, windows), weight_decay=0.1, momentum=momentum)
        _run(optimizer, grads, gradients)
        results.append(params.data)
        assert sorted(r.size for r in optimizer.rows.values()) == [20, 30]  # w1 (20 x 30) and w2 (30 x 3) factored
    np.testing.assert_allclose(results[1], results[0], rtol=1e-13, atol=1e-15)


# -- 8-bit Adam
def reference_quantize(values, table):
    codes, scales = [], []
    for lo in range(0, len(values), BLOCK):
        block = values[lo:lo + BLOCK]
        absmax = np.abs(block).max()
        scales.append(absmax)
        normalised = block / absmax if absmax > 0 else block
        codes.append(np.abs(normalised[:, None] - table[None, :]).argmin(axis=1))  # nearest code by value
    return np.concatenate(codes), np.array(scales)


def reference_dequantize(codes, scales, table):
    return table[codes] * np.repeat(scales, BLOCK)[:len(codes)]


def reference_adam8bit(p, gradients, decayed, hyper, grad_scale, sizes):
    """AdamW whose moments are quantized after every step, blocks starting at each segment's start."""
    p = p.copy()
    tables = {"m": quantization_map(True), "v": quantization_map(False)}
    state = {k: [(np.full(n, int(np.searchsorted(tables[k], 0.0))), np.zeros(-(-n // BLOCK))) for n in sizes]
             for k in "mv"}
    for t, g_all in enumerate(gradients, start=1):
        lr, offset = LRS[t - 1], 0
        p[decayed] *= 1 - lr * hyper.weight_decay
        for index, n in enumerate(sizes):
            g = g_all[offset:offset + n] * grad_scale
            m = hyper.beta1 * reference_dequantize(*state["m"][index], tables["m"]) + (1 - hyper.beta1) * g
            v = hyper.beta2 * reference_dequantize(*state["v"][index], tables["v"]) ** 2 + (1 - hyper.beta2) * g * g
            m_hat, v_hat = m / (1 - hyper.beta1 ** t), v / (1 - hyper.beta2 ** t)
            p[offset:offset + n] -= lr * m_hat / (np.sqrt(v_hat) + hyper.eps)
            state["m"][index] = reference_quantize(m, tables["m"])
            state["v"][index] = reference_quantize(np.sqrt(v), tables["v"])  # stored: the rms
            offset += n
    return p, state


def _flat_problem(size, seed):
    rng = np.random.default_rng(seed)
    p = rng.normal(size=size)
    scales = np.exp(rng.normal(size=size) * 2)  # gradients over several decades, as real ones
    gradients = [rng.normal(size=size) * scales for _ in range(STEPS)]
    return p, gradients


def test_adam8bit_matches_reference_math():
    sizes = [BLOCK * 2 + 300, 1000]  # a segment of 3 blocks (the last short) and one of a single short block
    p, gradients = _flat_problem(sum(sizes), seed=2)
    decayed = np.zeros(sum(sizes), dtype=bool)
    decayed[100:3000] = True
    params, grads = p.copy(), np.zeros_like(p)
    segments, offset = [], 0
    for n in sizes:
        local = [(max(100, offset) - offset, min(3000, offset + n) - offset)] if offset < 3000 else []
        segments.append(Segment(params[offset:offset + n], grads[offset:offset + n], local))
        offset += n
    hyper = AdamWHyper(weight_decay=0.1)
    optimizer = Adam8bit(segments, hyper)
    for step, g in enumerate(gradients):
        grads[:] = g
        optimizer.step(LRS[step], 0.5)
    expected, state = reference_adam8bit(p, gradients, decayed, hyper, 0.5, sizes)
    np.testing.assert_allclose(params, expected, rtol=1e-12, atol=1e-14)
    for k in "mv":
        np.testing.assert_array_equal(optimizer.codes[k], np.concatenate([c for c, _ in state[k]]))
        np.testing.assert_allclose(optimizer.absmax[k], np.concatenate([s for _, s in state[k]]), rtol=1e-14)


def test_adam8bit_stays_close_to_adamw():
    """The quantized moments change the steps by a few percent, not their direction (a broken map would not)."""
    p, gradients = _flat_problem(3 * BLOCK, seed=3)
    results = []
    for kind in (AdamW, Adam8bit):
        params, grads = p.copy(), np.zeros_like(p)
        optimizer = kind([Segment(params, grads, [])], AdamWHyper(weight_decay=0.0))
        for step, g in enumerate(gradients):
            grads[:] = g
            optimizer.step(LRS[step])
        results.append(params - p)
    exact, quantized = results
    assert np.linalg.norm(quantized - exact) / np.linalg.norm(exact) < 0.05


def test_quantization_map_keeps_relative_precision_over_decades():
    table = quantization_map(False)
    values = 10.0 ** np.linspace(-6.5, 0, 1000)
    from mpitrain.optim.adam8bit import dequantize, quantize
    codes, absmax = quantize(values, table, np)
    error = np.abs(dequantize(codes, absmax, table) - values) / values
    assert error.max() < 0.035  # a linear map would round everything below 1/510 of the absmax to 0
    assert len(table) == 256 and len(quantization_map(True)) == 255


# -- SGD
def test_sgd_with_momentum_matches_reference_math():
    layout = _layout()
    params, grads, gradients = _problem(layout, seed=4)
    p = params.data.copy()
    optimizer = SGD([Segment(params.data, grads.data, params.ranges(lambda s: s.decay))], momentum=0.9,
                    weight_decay=0.1)
    _run(optimizer, grads, gradients)
    buffer = np.zeros_like(p)
    decayed = np.zeros(p.size, dtype=bool)
    for a, b in params.ranges(lambda s: s.decay):
        decayed[a:b] = True
    for step, g in enumerate(gradients):
        p[decayed] *= 1 - LRS[step] * 0.1
        buffer = 0.9 * buffer + 0.5 * g
        p -= LRS[step] * buffer
    np.testing.assert_allclose(params.data, p, rtol=1e-12, atol=1e-14)


# -- state bytes per parameter, measured from the arrays held
def test_optimizer_state_bytes_per_parameter():
    layout = UnitLayout("u", [ParamSpec("w", (512, 512), "normal", 0.02)])
    params = FlatBuffer.allocate([layout], np, np.float32)
    grads = FlatBuffer.allocate([layout], np, np.float32)
    n = params.size
    segment = Segment(params.data, grads.data, [])
    matrices = ShardLayout(params, [(0, n)])
    per_parameter = {
        "adamw": AdamW([segment], AdamWHyper()).state_nbytes() / n,
        "adafactor": Adafactor([segment], matrices).state_nbytes() / n,
        "adafactor with int4 first moment": Adafactor([segment], matrices, momentum="int4").state_nbytes() / n,
        "adafactor without first moment": Adafactor([segment], matrices, beta1=0).state_nbytes() / n,
        "adam8bit": Adam8bit([segment], AdamWHyper()).state_nbytes() / n,
        "sgd": SGD([segment], momentum=0.9).state_nbytes() / n,
    }
    print(per_parameter)
    assert per_parameter["adamw"] == 8
    assert per_parameter["adafactor"] == pytest.approx(4 + 2 * 512 * 4 / n)  # first moment + rows + cols
    assert per_parameter["adafactor without first moment"] == pytest.approx(2 * 512 * 4 / n)  # 1/64 byte
    assert per_parameter["adafactor without first moment"] < 0.05
    assert per_parameter["adafactor with int4 first moment"] == pytest.approx(0.5 + 4 / 128 + 2 * 512 * 4 / n)
    assert per_parameter["adafactor with int4 first moment"] < 0.55
    assert per_parameter["adam8bit"] == pytest.approx(2 + 2 * 4 / BLOCK)
    assert per_parameter["sgd"] == 4


# -- checkpoint round trips (in-process): element-wise arrays out, into a fresh optimizer, bitwise the same
def _trained(kind, sizes, seed):
    p, gradients = _flat_problem(sum(sizes), seed)
    params, grads = p.copy(), np.zeros_like(p)
    segments, offset = [], 0
    for n in sizes:
        segments.append(Segment(params[offset:offset + n], grads[offset:offset + n], []))
        offset += n
    geometry = FlatBuffer.allocate([UnitLayout("u", [ParamSpec("w", (sum(sizes) // 64, 64), "zeros")])], np,
                                   np.float64)
    windows, offset = [], 0
    for n in sizes:
        windows.append((offset, offset + n))
        offset += n
    make = {"adam8bit": lambda: Adam8bit(segments, AdamWHyper()),
            "adafactor": lambda: Adafactor(segments, ShardLayout(geometry, windows)),
            "adafactor-int4": lambda: Adafactor(segments, ShardLayout(geometry, windows),
                                                momentum="int4"),
            "sgd": lambda: SGD(segments)}[kind]
    optimizer = make()
    for step, g in enumerate(gradients[:4]):
        grads[:] = g
        optimizer.step(LRS[step])
    return optimizer, make, params, grads, gradients


@pytest.mark.parametrize("kind", ["adam8bit", "adafactor", "adafactor-int4", "sgd"])
def test_checkpoint_arrays_restore_bitwise(kind):
    sizes = [64 * 80]  # one segment holding the whole (80 x 64) matrix
    optimizer, make, params, grads, gradients = _trained(kind, sizes, seed=5)
    saved = {k: np.array(v, copy=True) for k, v in optimizer.checkpoint_arrays().items()}
    before = [np.array(a, copy=True) for a in optimizer.state_arrays()]
    fresh = make()
    for k, array in fresh.checkpoint_arrays().items():
        array[...] = saved[k]  # what the checkpoint's load_into does
    fresh.after_restore()
    fresh.steps_taken = optimizer.steps_taken
    for a, b in zip(before, fresh.state_arrays()):
        np.testing.assert_array_equal(a, b)
    snapshot = params.copy()
    grads[:] = gradients[4]
    optimizer.step(1e-2)
    once = params.copy()
    params[:] = snapshot
    fresh.step(1e-2)
    np.testing.assert_array_equal(params, once)


@pytest.mark.parametrize("kind", ["adam8bit", "adafactor", "adafactor-int4"])
def test_checkpoint_arrays_restore_into_other_segments(kind):
    """Saved from one segment, restored into two cutting the matrix mid-row (another ZeRO layout): the blocks and
    the factored statistics are the tensor's in both, so the state comes back as it was saved."""
    optimizer, _, _, _, _ = _trained(kind, [64 * 80], seed=6)
    saved = {k: np.array(v, copy=True) for k, v in optimizer.checkpoint_arrays().items()}
    other, _, _, _, _ = _trained(kind, [64 * 30 + 5, 64 * 50 - 5], seed=6)
    for k, array in other.checkpoint_arrays().items():
        array[...] = saved[k]
    other.after_restore()
    restored = other.checkpoint_arrays()
    key = "adam8bit_v_code" if kind == "adam8bit" else "adafactor_v"
    if kind == "adam8bit":
        table = quantization_map(False)
        a = table[saved[key]] * saved["adam8bit_v_absmax"]
        b = table[restored[key]] * restored["adam8bit_v_absmax"]
        np.testing.assert_allclose(b, a, rtol=0.04, atol=a.max() * 1e-7)
    else:
        np.testing.assert_allclose(restored[key], saved[key], rtol=1e-12)  # factored in both: the same estimate
    if kind == "adafactor-int4":  # the blocks are the tensor's in both layouts: the stored moment restores as it was
        for key in ("adafactor_m4_code", "adafactor_m4_scale"):
            np.testing.assert_array_equal(restored[key], saved[key])


# -- a training run under MPI: stopped and resumed, bitwise the same (the state sharded by ZeRO-1 over 2 ranks:
# Adafactor's whole row and column statistics come back from every holder's element-wise pieces)
@pytest.mark.parametrize("name, zero", [("adam8bit", 1), ("adafactor", 1)])
def test_stop_and_resume_is_bitwise_the_same_run(tmp_path, small_epochs, name, zero):
    data = small_epochs
    settings = [f"optim.name={name}", "checkpoint.every=2", "model.seq_len=32", f"parallel.zero={zero}",
                "precision.compute=float64"]
    train(2, tmp_path / "straight", data, *settings)
    train(2, tmp_path / "resumed", data, *settings, "train.stop_at=4", expect=PREEMPTED)
    out = train(2, tmp_path / "resumed", data, *settings, resume="auto")
    assert "checkpoint: resumed from" in out.stdout
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert len(straight) == 10 and straight == resumed  # every step's loss, bitwise
    assert straight[10] < straight[1]
    # the index names each tensor's parameter dtype (8-bit codes are uint8), and export carries the optimizer state
    import subprocess
    import sys

    import h5py

    from mpitrain.checkpoint.store import Checkpoint, committed_checkpoints
    newest = committed_checkpoints(tmp_path / "resumed" / "checkpoints")[-1]
    assert {info["dtype"] for info in Checkpoint.open(newest).tensors().values()} == {"float64"}
    out = tmp_path / "export.h5"
    subprocess.run([sys.executable, "-m", "mpitrain", "ckpt", "export", str(newest), str(out), "--optimizer"],
                   check=True, capture_output=True, timeout=120)
    with h5py.File(out) as f:
        assert {"params", f"{name}_v_code" if name == "adam8bit" else "adafactor_row"} <= set(f.keys())


FOOTPRINT_JOB = """
import json
from mpi4py import MPI
from mpitrain.config import load_config
from mpitrain.train import Trainer

measured = {}
for zero in (0, 1, 3):
    for name in ("adafactor", "adam8bit", "sgd"):
        cfg = load_config("configs/tiny.toml", ["data.synthetic=true", "logging.peak_flops=1e9",
                                                f"parallel.zero={zero}", f"optim.name={name}"])
        trainer = Trainer(cfg, MPI.COMM_WORLD)
        measured[f"{name} {zero}"] = trainer.optimizer.state_nbytes()
if MPI.COMM_WORLD.rank == 0:
    print("FOOTPRINT " + json.dumps(measured))
"""


def test_memory_plan_counts_the_optimizer_state_a_run_holds(tmp_path):
    """`mpitrain memory`'s optimizer row (plan/memory.py -> optim/footprint.py) equals the bytes the optimizers of
    a 2-rank run hold on rank 0, exactly, at ZeRO-0, 1 and 3."""
    import json

    from mpitrain.config import load_config, resolve_layout
    from mpitrain.optim.footprint import lean_state_bytes
    from mpitrain.plan.memory import memory_report, rank_model
    from mpitrain.state.frozen import split_frozen
    from tests.mpi_helpers import describe, run_mpi
    script = tmp_path / "footprint.py"
    script.write_text(FOOTPRINT_JOB)
    result = run_mpi(2, [str(script)], timeout=120)
    assert result.returncode == 0, describe(result)
    measured = json.loads(result.stdout.split("FOOTPRINT ", 1)[1].splitlines()[0])
    for key, held in measured.items():
        name, zero = key.split()
        cfg = load_config("configs/tiny.toml", ["data.synthetic=true", f"parallel.zero={zero}", f"optim.name={name}"])
        resolve_layout(cfg, 2)
        layouts = split_frozen(rank_model(cfg).layouts)[0]
        assert lean_state_bytes(name, layouts, int(zero), 2, 4) == held, key
        report = memory_report(cfg, sum(layout.size for layout in layouts))
        assert report["bytes"]["optimizer"] == held, key  # float32: the parameters are the master
        assert name in report["formulas"]["optimizer"]


def test_lean_optimizers_train_about_as_well_as_adamw(tmp_path, small_epochs):
    """A short run of the tiny model: Adafactor's and 8-bit Adam's validation loss within 10% of AdamW's (the
    quickstart comparison, 500 steps and 3%, is in docs/memory.md; this one is small enough for CI, and a broken
    optimizer, e.g. moments rounded to zero, lands far outside it)."""
    val = {}
    for name in ("adamw", "adafactor", "adam8bit"):
        run_dir = tmp_path / name
        train(1, run_dir, small_epochs, f"optim.name={name}", "train.steps=30", "model.seq_len=32")
        val[name] = losses_and_val(run_dir)
    print(val)
    first, adamw = val["adamw"]
    assert adamw < 0.8 * first  # it learned something
    for name in ("adafactor", "adam8bit"):
        assert abs(val[name][1] - adamw) < 0.10 * adamw, (name, val)


def losses_and_val(run_dir):
    import json
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records[0]["loss"], [r["val_loss"] for r in records if "val_loss" in r][-1]


def test_resuming_with_another_momentum_storage_is_one_clear_line(tmp_path, small_epochs):
    """A checkpoint saved with optim.adafactor_momentum = full (an Adafactor run from before int4 was the default)
    resumed under int4: one line that names the missing state and the key to check, not a traceback."""
    settings = ["optim.name=adafactor", "train.steps=3", "model.seq_len=32"]
    train(1, tmp_path, small_epochs, *settings, "optim.adafactor_momentum=full", "train.stop_at=2", expect=PREEMPTED)
    out = train(1, tmp_path, small_epochs, *settings, resume="auto", expect=1)
    text = out.stdout + out.stderr
    assert "has no adafactor_m4_code" in text and "optim.adafactor_momentum" in text and "Traceback" not in text
