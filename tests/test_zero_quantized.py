"""ZeRO++'s quantized communication: the block codecs against references written here (bit patterns, scales,
clipping, ties), their exact byte counts, and ZeRO-3 runs whose counted bytes match the formulas and whose error
against the exact run stays inside the codecs' bounds, down to one SGD step's weights on every layout."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mpitrain.comm.quantized import WORST_RELATIVE_ERROR, decode, encode, wire_nbytes
from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.optim.schedule import lr_at
from mpitrain.state.zero_quantized import QuantizedComm, gather_bytes, reduce_scatter_bytes, zero_step_bytes
from tests.mpi_helpers import run_python_mpi_results


# ---- references: the formats from their definitions, element by element, without numpy's rint or ml_dtypes -----------
def e4m3fn_values() -> dict[int, float]:
    """Every finite float8 e4m3fn bit pattern -> its value: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent
    0 is subnormal; S.1111.111 is NaN and there is no infinity."""
    values = {}
    for bits in range(256):
        sign, exponent, mantissa = bits >> 7, (bits >> 3) & 0xF, bits & 0x7
        if exponent == 0xF and mantissa == 0x7:
            continue
        magnitude = mantissa / 8 * 2.0 ** -6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        values[bits] = -magnitude if sign else magnitude
    return values


E4M3FN = e4m3fn_values()


def nearest_e4m3fn(v: float) -> int:
    """The bit pattern nearest to v (after the clip to +-448), ties to the even pattern; zero keeps v's sign."""
    v = min(max(v, -448.0), 448.0)
    best = min(E4M3FN.items(), key=lambda item: (abs(item[1] - v), item[0] & 1, (item[1] == 0) and
                                                 (math.copysign(1, v) != (-1 if item[0] >> 7 else 1))))
    return best[0]


def reference_encode(x: np.ndarray, block: int, codec: str) -> tuple[list[int], list[np.float32]]:
    """(codes as byte values, scales) one element at a time; Python's round() rounds ties to even."""
    levels = {"int8": 127, "int4": 7, "fp8": 448}[codec]
    codes, scales = [], []
    for start in range(0, x.size, block):
        piece = [np.float32(v) for v in x[start:start + block]]
        scale = np.float32(max(abs(v) for v in piece)) / np.float32(levels)
        scales.append(np.float32(scale))
        for v in piece:
            quotient = float(v / scale) if scale > 0 else 0.0  # float32 division, as on the wire
            if codec == "fp8":
                codes.append(nearest_e4m3fn(quotient))
            else:
                codes.append(max(-levels, min(levels, round(quotient))) & (0xFF if codec == "int8" else 0xF))
    if codec == "int4":
        codes += [0] * (len(codes) % 2)
        codes = [low | (high << 4) for low, high in zip(codes[0::2], codes[1::2])]
    return codes, scales


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("n, block", [(1000, 64), (333, 32), (7, 4)])
def test_codec_matches_the_reference_bits_scales_and_byte_counts(codec, n, block):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-8, 3, n))).astype(np.float32)  # fp8 subnormals too
    x[:block] = 0  # an all-zero block: scale 0, codes 0
    payload, scales = encode(x, block, codec)
    codes, ref_scales = reference_encode(x, block, codec)
    assert payload.dtype == np.uint8 and scales.dtype == np.float32
    assert payload.tolist() == codes
    assert scales.tolist() == [float(s) for s in ref_scales]
    assert payload.nbytes + scales.nbytes == wire_nbytes(codec, n, block)
    assert payload.nbytes == (n if codec != "int4" else (n + 1) // 2) and scales.size == -(-n // block)
    got = decode(payload, scales, n, block, codec)
    absmax = np.repeat([np.abs(x[i:i + block]).max() for i in range(0, n, block)], block)[:n]
    assert np.all(np.abs(got - x) <= WORST_RELATIVE_ERROR[codec] * absmax * (1 + 1e-6)), codec
    assert np.all(got[:block] == 0) and np.all(np.isfinite(got))


def test_ties_round_to_even_and_int4_packs_low_nibble_first():
    ties = np.array([127, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -126.5], np.float32)  # scale 1: quotients exact
    payload, scales = encode(ties, 8, "int8")
    assert scales.tolist() == [1.0]
    assert payload.view(np.int8).tolist() == [127, 0, 2, 2, 0, -2, 4, -126]
    payload, _ = encode(np.array([7, 0.5, 1.5, -2.5, -7, 3.5], np.float32), 6, "int4")  # 7, 0, 2, -2, -7, 4
    assert payload.tolist() == [0x07, 0xE2, 0x49]
    payload, _ = encode(np.array([448, 1.0625, 1.1875, -1.0625, 2.0 ** -10], np.float32), 6, "fp8")
    assert payload.tolist() == [0x7E, 0x38, 0x3A, 0xB8, 0x00]  # ties to even mantissa; 2^-10 halfway to 2^-9: 0


def test_fp8_clips_before_the_cast_instead_of_making_nan():
    from ml_dtypes import float8_e4m3fn
    assert np.isnan(np.float32(480).astype(float8_e4m3fn).astype(np.float32))  # why the clip is needed
    rng = np.random.default_rng(0)
    x = rng.uniform(-3.4e38, 3.4e38, 4096).astype(np.float32)  # quotients at the edge of fp32 rounding
    payload, scales = encode(x, 128, "fp8")
    assert not np.any((payload & 0x7F) == 0x7F)  # no NaN pattern
    assert np.all(np.isfinite(decode(payload, scales, x.size, 128, "fp8")))


def test_decode_refuses_a_message_of_the_wrong_size():
    payload, scales = encode(np.ones(10, np.float32), 4, "int4")
    with pytest.raises(ValueError, match="do not hold 11 elements"):
        decode(payload, scales, 11, 4, "int4")


@pytest.mark.parametrize("setting, says", [
    (["parallel.zero=2", "parallel.zero_gather_dtype=fp8"], "needs parallel.zero = 3"),
    (["parallel.zero_grad_reduce=int4"], "needs parallel.zero >= 1"),
    (["parallel.zero=3", "parallel.zero_grad_reduce=int8", "precision.grad_reduce=bfloat16"], "one wire format"),
    (["parallel.zero=3", "parallel.zero_gather_dtype=int8", "parallel.zero_quant_block=7"], "even number"),
    (["parallel.zero=3", "parallel.zero_gather_dtype=int4"], "parallel.zero_gather_dtype = 'int4' is not allowed"),
])
def test_bad_settings_are_refused_naming_the_key(setting, says):
    with pytest.raises(ConfigError, match=says):
        load_config("configs/tiny.toml", setting)


def test_step_bytes_formula_by_hand():
    """3 ranks, shards of 10 and 5 elements, blocks of 4: fp8 sends 10 + 3 scales and 5 + 2 scales per rank."""
    assert gather_bytes(10, 3, 2) == 2 * 20
    assert gather_bytes(10, 3, 2, "fp8", 4) == 2 * (10 + 12)
    assert reduce_scatter_bytes(5, 3, 4, "int4", 4) == 2 * (3 + 8)
    step = zero_step_bytes(3, [10, 5], 3, 2, 4, QuantizedComm("fp8", "int4", 4), micro_batches=2)
    assert step == {"all_gather": 2 * 2 * 2 * (10 + 12 + 5 + 8), "all_to_all": 2 * 2 * (5 + 12 + 3 + 8)}
    stage1 = zero_step_bytes(1, [10, 5], 3, 2, 4, QuantizedComm("same", "int8", 4), micro_batches=2)
    assert stage1 == {"all_gather": 2 * 2 * 15, "all_to_all": 2 * (10 + 12 + 5 + 8)}  # once a step


# ---- real ZeRO-3 runs: bytes from the counters, error against the exact run -----------------------------------------
JOB = """
import json
import numpy as np
from mpi4py import MPI
from mpitrain.comm.quantized import WORST_RELATIVE_ERROR, block_count
from mpitrain.config import load_config
from mpitrain.state.zero import gathered_views
from mpitrain.state.zero_quantized import QuantizedGradReducer, quantized_gather, zero_step_bytes
from mpitrain.train import Trainer

world = MPI.COMM_WORLD
BLOCK, STEPS = 64, 4
BASE = ["data.synthetic=true", "logging.peak_flops=1e9", "parallel.zero=3", "train.micro_batch=2",
        f"parallel.zero_quant_block={BLOCK}", "optim.warmup_steps=1"]


class RecordingReducer:
    # test stand-in around one of the state's gradient reducers: passes each reduce-scatter on and keeps the largest
    # magnitude it was sent, the scale of the codec's error on the sum
    def __init__(self, inner):
        self.inner, self.largest = inner, []

    def reduce_scatter(self, send):
        self.largest.append(float(np.max(np.abs(send))))
        return self.inner.reduce_scatter(send)


def run(comm, layout, modes, compute="float64", steps=STEPS, record=False):
    gather, grads = modes
    cfg = load_config("configs/tiny.toml", BASE + layout + [f"precision.compute={compute}", f"train.steps={steps}",
                      f"parallel.zero_gather_dtype={gather}", f"parallel.zero_grad_reduce={grads}"])
    trainer = Trainer(cfg, comm)
    state, losses, counted = trainer.state, [], []
    if record:
        state.reducers = {name: RecordingReducer(reducer) for name, reducer in state.reducers.items()}
    for step in range(steps):
        losses.append(trainer.train_step(step).loss)
        counted.append({k: float(v) for k, v in state.group.counters(exact=True).items() if v})
    e = np.dtype(state.backend.dtype).itemsize
    expected = zero_step_bytes(cfg.parallel.zero, state.shard_sizes, state.group.size, e, max(e, 4),
                               state.quantized, trainer.accumulation)
    params = np.concatenate([s.params for s in state.optimizer_segments()]).astype(np.float64)
    cp_traffic = sorted(k for k, v in trainer.mesh.cp.counters().items() if k != "control" and v)  # ring or Ulysses
    return {"losses": losses, "counted": counted, "expected": expected, "params": params, "state": state,
            "shards": state.shard_sizes, "micro_batches": trainer.accumulation, "cp_traffic": cp_traffic,
            "dp_cp": [trainer.mesh.dp.size, trainer.mesh.cp.size]}


def compare(got, reference, comm):
    diff, ref = got["params"] - reference["params"], reference["params"]
    return {"loss_error": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], reference["losses"])),
            "first_loss_equal": got["losses"][0] == reference["losses"][0],
            "param_error": (comm.allreduce(float(np.sum(diff ** 2))) / comm.allreduce(float(np.sum(ref ** 2)))) ** .5,
            "param_max_abs": comm.allreduce(float(np.max(np.abs(diff))), op=MPI.MAX)}


def within_codec_bound(error, contributions, codec):
    # |error| <= the sum over contributions of the codec's bound times its block's absmax (+ fp32 rounding)
    bound = 0
    for x in contributions:
        absmax = np.abs(np.pad(x, (0, -x.size % BLOCK)).reshape(-1, BLOCK)).max(axis=1)
        bound = bound + np.repeat(absmax, BLOCK)[:x.size] * (WORST_RELATIVE_ERROR[codec] + 1e-6)
    return bool(np.all(np.abs(error) <= bound))


def codec_checks(state, codec, grad_codec):
    # one gather and one reduce-scatter on the run's group, each against the exact collective
    group, shard, n = state.group, state.params.shard(0), state.group.size
    exact = np.empty(n * shard.size)
    group.all_gather(shard, exact)
    entry = quantized_gather(state.parts[0], shard, group, state, codec, BLOCK)
    gathered_views(entry)
    decoded = entry[0].data
    gather_ok = within_codec_bound(decoded - exact, [exact], codec)
    rng = np.random.default_rng(group.rank)
    send = rng.standard_normal(n * 300) * np.exp(rng.uniform(-5, 5, n * 300))
    summed = QuantizedGradReducer(group, np.float64, grad_codec, BLOCK).reduce_scatter(send).wait()
    reference, every = np.empty(300), np.empty(n * n * 300)
    group.reduce_scatter(send.copy(), reference)
    group.all_gather(send, every)
    mine = [every.reshape(n, n, 300)[r, group.rank] for r in range(n)]  # each rank's piece of this rank's block
    return gather_ok and within_codec_bound(summed - reference, mine, grad_codec)


SGD_LR = 0.5  # the first step's lr (warmup_steps = 1)
SGD = ["optim.name=sgd", "optim.momentum=0", "optim.clip=0", f"optim.lr={SGD_LR}"]


def summed_pieces(state, name, calls):
    # pieces in the sum of one element reduced by reducer `name`: its group's ranks, once per reduction of its part
    parts = sum(reduction == name for reduction in state.reductions)
    assert calls % parts == 0, (name, calls, parts)
    return state.groups[name].size * calls // parts


def sgd_step_check(layout, codec="int8"):
    # One plain SGD step, exact weight gathers, `codec` against exact gradient reduction: the forward passes are the
    # same, so the weights differ by lr times the gradients' difference, the reductions' error alone. A sum of p
    # pieces is off by at most p times the codec's relative error times the pieces' block absmax, itself at most the
    # largest magnitude sent. int8, the finest codec: a gradient path that loses or adds more than ~2% of the largest
    # piece anywhere fails (int4's bound is 18 times looser). Returns (max |weight difference|, that bound).
    exact = run(world, layout + SGD, ("same", "exact"), steps=1)
    got = run(world, layout + SGD, ("same", codec), steps=1, record=True)
    state = got["state"]
    pieces = max(summed_pieces(state, name, len(r.largest)) for name, r in state.reducers.items() if r.largest)
    largest = max(max(r.largest, default=0.0) for r in state.reducers.values())
    pieces, largest = world.allreduce(pieces, op=MPI.MAX), world.allreduce(largest, op=MPI.MAX)
    bound = SGD_LR * WORST_RELATIVE_ERROR[codec] * pieces * largest * (1 + 1e-6)
    return {"param_max_abs": compare(got, exact, world)["param_max_abs"], "bound": bound, "pieces": pieces}


out = {"modes": {}, "layouts": {}}
single = run(MPI.COMM_SELF, [], ("same", "exact")) if world.rank == 0 else None
MODES = [("same", "exact"), ("int8", "exact"), ("fp8", "exact"), ("same", "int8"), ("same", "int4"),
         ("fp8", "int8")]
exact = run(world, [], MODES[0])
dp4 = {}  # the runs of dp 4, by modes: what dp 2 x cp 2 must reproduce where no gradient is quantized
for modes in MODES:
    got = dp4[modes] = run(world, [], modes) if modes != MODES[0] else exact
    out["modes"]["/".join(modes)] = {**compare(got, exact, world), "counted": got["counted"], "losses": got["losses"],
                                     "expected": got["expected"], "shards": got["shards"],
                                     "micro_batches": got["micro_batches"]}
out["codec_checks"] = {codec: world.allreduce(codec_checks(exact["state"], codec, grads), op=MPI.LAND)
                       for codec, grads in (("int8", "int8"), ("fp8", "int4"))}
if world.rank == 0:
    out["single_losses"] = single["losses"]
bf16 = run(world, [], ("same", "exact"), compute="bfloat16", steps=1)
fp8 = run(world, [], ("fp8", "exact"), compute="bfloat16", steps=1)
out["bf16"] = {"same": bf16["counted"][0], "fp8": fp8["counted"][0], "shards": fp8["shards"]}
LAYOUTS = {"dp2xtp2 fp8/int8": (["parallel.tp=2"], ("fp8", "int8")),
           "pp2xdp2 fp8/int8": (["parallel.pp=2"], ("fp8", "int8")),
           "moe ep2 fp8/int4": (["model.moe={experts=4,top_k=2}", "parallel.ep=2"], ("fp8", "int4")),
           "zero1 same/int8": (["parallel.zero=1"], ("same", "int8")),
           "zero2 same/int4": (["parallel.zero=2"], ("same", "int4")),
           "dp2xcp2 ring fp8/int8": (["parallel.cp=2"], ("fp8", "int8")),
           "dp2xcp2 ulysses int8/int4": (["parallel.cp=2", "parallel.cp_kind=ulysses"], ("int8", "int4"))}


def same_as_dp4(layout, gather, exact_layout):
    # ZeRO over dp x cp = 4 ranks has dp 4's shards, so the exact run and the run quantizing only the weight gathers
    # (a function of the shards) must give dp 4's losses and master weights up to the sums' rounding
    gather_only = run(world, layout, (gather, "exact"))
    return {"group_size": exact_layout["state"].group.size, "dp_cp": exact_layout["dp_cp"],
            "cp_traffic": exact_layout["cp_traffic"], "exact": compare(exact_layout, exact, world),
            "gather": compare(gather_only, dp4[(gather, "exact")], world)}


for name, (layout, modes) in LAYOUTS.items():
    got, exact_layout = run(world, layout, modes), run(world, layout, ("same", "exact"))
    out["layouts"][name] = {**compare(got, exact_layout, world), "counted": got["counted"],
                            "expected": got["expected"], "sgd": sgd_step_check(layout)}
    if "parallel.cp=2" in layout:
        out["layouts"][name]["same_as_dp4"] = same_as_dp4(layout, modes[0], exact_layout)
if world.rank == 0:
    print("RESULTS " + json.dumps(out))
"""


def adam_step_bound(t: int, beta1: float = 0.9, beta2: float = 0.95) -> float:
    """max |m_hat / sqrt(v_hat)| at Adam's step t over all gradient histories (Cauchy-Schwarz over the two
    exponential averages): about 1 here; decoupled weight decay only shrinks a difference."""
    a_over_b = sum((beta1 ** 2 / beta2) ** i for i in range(t))
    return math.sqrt((1 - beta1) ** 2 * (1 - beta2 ** t) / ((1 - beta1 ** t) ** 2 * (1 - beta2)) * a_over_b)


def exchanged_bytes(shards, ranks, gathers, codec, block, exact_bytes_per_element):
    """What a quantized collective must send, from the exact one's element size: codes + fp32 scales."""
    codes = sum(k if codec != "int4" else -(-k // 2) for k in shards)
    scales = 4 * sum(-(-k // block) for k in shards)
    return (ranks - 1) * gathers * (codes + scales), codes / (exact_bytes_per_element * sum(shards))


def test_zero3_quantized_bytes_are_exact_and_errors_stay_inside_their_bounds():
    """4 ranks, ZeRO-3, float64, 4 steps of each wire format beside the exact run (and one step at bf16): the
    counted bytes equal the formulas; the exact formats match one process to 1e-10; the quantized ones stay inside
    bounds that follow from the codecs (one gather, one reduce-scatter) and from Adam (parameters: each step moves
    an element by at most about lr, so two runs differ by at most 2 lr per step); dp 2 x tp 2, pp 2 x dp 2, MoE
    experts over expert_dp (ep 2), ZeRO-1, ZeRO-2 and dp 2 x cp 2 (ring and Ulysses) too. ZeRO shards over dp x cp
    there: 4 ranks, dp 4's shards, so its exact run and its run quantizing only the weight gathers must give dp 4's
    losses and master weights to 1e-10 (the gathers decode the same shards). Those whole-run bounds hold for any
    gradients, so each
    layout also takes one plain SGD step with int8 against exact reduction: there the weights differ by exactly lr
    times the reductions' error, which must lie within the codec's bound for the pieces summed (leaving one rank's
    pieces out of the sums exceeds it 30-fold)."""
    out = run_python_mpi_results(4, JOB, timeout=300)
    cfg = load_config("configs/tiny.toml", ["optim.warmup_steps=1", "train.steps=4"])
    o = cfg.optim
    drift = sum(2 * adam_step_bound(t + 1) * lr_at(t, o.lr, o.min_lr, o.warmup_steps, 4, o.schedule)
                for t in range(4))
    exact = out["modes"]["same/exact"]
    assert out["single_losses"] == pytest.approx(exact["losses"], rel=1e-10, abs=0)
    print(f"\nmode (gather/grads)  loss rel. error  param rel. error  param max abs (bound {drift:.4f})")
    for mode, got in out["modes"].items():
        gather, grads = mode.split("/")
        for counted in got["counted"]:
            assert counted == {**got["expected"], "control": 8.0}, mode
        ranks, mb = 4, got["micro_batches"]
        if gather != "same":
            sent, fraction = exchanged_bytes(got["shards"], ranks, 2 * mb, gather, 64, 8)
            assert got["expected"]["all_gather"] == sent and fraction == 1 / 8
        if grads != "exact":
            assert got["expected"]["all_to_all"] == exchanged_bytes(got["shards"], ranks, mb, grads, 64, 8)[0]
        delta = max(WORST_RELATIVE_ERROR.get(gather, 0), WORST_RELATIVE_ERROR.get(grads, 0))
        assert got["loss_error"] <= max(delta, 1e-10), mode
        assert got["param_max_abs"] <= (drift if delta else 1e-10), mode
        assert got["first_loss_equal"] == (gather == "same"), mode  # quantized gradients act from step 2 on
        print(f"{mode:20s} {got['loss_error']:15.2e} {got['param_error']:17.2e} {got['param_max_abs']:14.2e}")
    assert out["codec_checks"] == {"int8": True, "fp8": True}
    bf16 = out["bf16"]
    scales = exchanged_bytes(bf16["shards"], 4, 2, "fp8", 64, 1)[0] - bf16["same"]["all_gather"] / 2
    assert bf16["fp8"]["all_gather"] == bf16["same"]["all_gather"] / 2 + scales
    assert scales == 3 * 2 * 4 * sum(-(-k // 64) for k in bf16["shards"])
    for name, got in out["layouts"].items():
        delta = max(WORST_RELATIVE_ERROR.get(codec, 0) for codec in name.split()[-1].split("/"))
        assert got["loss_error"] <= delta and got["param_max_abs"] <= drift, name
        if not name.startswith("moe"):  # one reduction group, the formula's (MoE's experts reduce over expert_dp)
            sent = [{k: v for k, v in counted.items() if k != "control"} for counted in got["counted"]]
            assert all(step == got["expected"] for step in sent), name
        errors = f"{got['loss_error']:15.2e} {got['param_error']:17.2e} {got['param_max_abs']:14.2e}"
        print(f"{name:20s} {errors}")
        sgd = got["sgd"]  # one SGD step: the weights' difference is lr times the reductions' error, within the codec's
        assert 0 < sgd["param_max_abs"] <= sgd["bound"], (name, sgd)
        print(f"{'':20s} one SGD step: max |weight diff| {sgd['param_max_abs']:.2e} <= {sgd['bound']:.2e} "
              f"({sgd['pieces']} pieces summed)")
        if "same_as_dp4" in got:  # ZeRO shards over dp x cp: 4 ranks, dp 4's shards
            dp4 = got["same_as_dp4"]
            assert dp4["group_size"] == 4 and dp4["dp_cp"] == [2, 2], name
            assert dp4["cp_traffic"] == ["all_to_all" if "ulysses" in name else "cp_ring"], name
            for run_of in ("exact", "gather"):
                assert dp4[run_of]["loss_error"] <= 1e-10 and dp4[run_of]["param_error"] <= 1e-10, (name, dp4)
            print(f"{'':20s} beside dp 4: exact {dp4['exact']['param_error']:.1e}, "
                  f"{name.split()[-1].split('/')[0]} gathers {dp4['gather']['param_error']:.1e} (masters, rel.)")
