"""The planner's terms for parallel.tp_overlap and precision.fp8 (plan/cost_precision.py): the exposed tp time is
layers/tp_overlap.py's exposed_seconds per collective, the chunked GEMMs cost gemm_shape_factor at rows / tp, the FP8
GEMM FLOPs are profile/flops.py's matmul weights; the FP8 quantization calls, amax all-reduces, elements cast and
delayed amaxes are those a one-process run makes (counted through stand-in groups), and each moves exactly its own
part of the step. The fp8 memory row and gathers are checked against a tp 2 run in tests/test_fp8.py."""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from mpi4py import MPI

from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.layers.fp8 import Fp8Gemms, end_delayed_step, fp8_extra_bytes, operand_dtype
from mpitrain.layers.tp_overlap import exposed_seconds
from mpitrain.plan.clusters import load_cluster
from mpitrain.plan.command import plan_command
from mpitrain.plan.cost import Layout, estimate, gemm_shape_factor, layout_config, ring, step_lower_bound
from mpitrain.plan.cost_precision import (
    AMAX_BYTES,
    amax_all_reduces,
    delayed_amaxes,
    fp8_flops_per_token,
    quantized_bytes,
)
from mpitrain.plan.presets import model_config
from mpitrain.plan.search import precision_variants
from mpitrain.profile.flops import block_matmul_weights

H100 = load_cluster("h100")
MESH = {"dp": 2, "tp": 4, "pp": 2, "zero": 1, "micro_batch": 1, "etp": 4}


def llama(moe_every: int = 0):
    cfg, _ = model_config("llama3-8b")
    cfg.train.global_batch = 16
    if moe_every:
        cfg.model.moe = {"experts": 8, "top_k": 2, "every": moe_every}
    return cfg


def run(cfg, cluster=H100, **settings):
    return estimate(cfg, Layout(**{**MESH, **settings}), cluster)


def speed_at(rows, tp, cluster=H100):
    return cluster.peak_flops * cluster.matmul_efficiency * \
        gemm_shape_factor(rows, 4096 / tp, cluster.gemm_rows_half, cluster.gemm_cols_half)


LINEARS = {"qkv": (4096, 4096 + 2 * 1024), "out": (4096, 4096), "up": (4096, 2 * 14336), "down": (14336, 4096)}


@pytest.mark.parametrize("moe_every", [0, 2])
def test_overlapped_tp_is_exposed_seconds_of_each_collective_under_its_own_gemm(moe_every):
    """Per block and micro-batch: the attention's and the MLP's gather and reduce-scatter, forward and backward,
    each under its linear's GEMM; a MoE block's MLP collectives stay plain. Without the overlap: cost.py's ring."""
    cfg = llama(moe_every)
    plain, overlapped = run(cfg), run(cfg, tp_overlap=True)
    t, rows, m, blocks = 4, 8192, plain["micro_batches"], 16  # 32 layers over pp 2
    link = H100.intra
    nbytes, bandwidth = rows * 4096 * 2, link.bandwidth * link.efficiency
    assert plain["parts"]["tp"] == pytest.approx(m * ring(link, "all_gather", nbytes, t, 8 * blocks), rel=1e-12)
    per_block = {}
    for moe_block in (False, True):
        seconds = 0.0
        for name, (k, n) in LINEARS.items():
            hidden = not (moe_block and name in ("up", "down"))
            gemm_s = 2 * rows * k * n / t / speed_at(rows, t)
            seconds += 2 * exposed_seconds(nbytes, t, bandwidth, gemm_s, hidden, link.latency)  # forward, backward
        per_block[moe_block] = seconds
    moe_blocks = blocks // 2 if moe_every else 0
    expected = m * ((blocks - moe_blocks) * per_block[False] + moe_blocks * per_block[True])
    assert overlapped["parts"]["tp"] == pytest.approx(expected, rel=1e-12)
    assert overlapped["parts"]["tp"] < plain["parts"]["tp"]
    # the chunked GEMMs (forward and input gradient of each overlapped linear) run at rows / tp
    chunked = sum(2 * 2 * rows * k * n / t for name, (k, n) in LINEARS.items()) * (blocks - moe_blocks) + \
        sum(2 * 2 * rows * k * n / t for name, (k, n) in LINEARS.items() if name in ("qkv", "out")) * moe_blocks
    slower = speed_at(rows, t) / speed_at(rows / t, t) - 1
    assert overlapped["parts"]["matmul"] - plain["parts"]["matmul"] == pytest.approx(
        m * chunked / speed_at(rows, t) * slower, rel=1e-9)
    assert sum(overlapped["parts"].values()) == pytest.approx(overlapped["step_s"], rel=1e-12)


def test_fp8_gemm_flops_are_the_blocks_matmul_weights():
    cfg = llama()
    dense, expert = fp8_flops_per_token(cfg)
    assert expert == 0 and dense == 6 * 32 * block_matmul_weights(cfg.model)
    assert fp8_flops_per_token(cfg, "full")[0] == 8 * 32 * block_matmul_weights(cfg.model)
    moe = llama(moe_every=2)
    dense, expert = fp8_flops_per_token(moe)
    assert expert == 6 * 16 * 2 * 3 * 4096 * 14336  # 16 MoE blocks, top 2 of the experts per token
    assert dense == 6 * 32 * block_matmul_weights(cfg.model) - 6 * 16 * 3 * 4096 * 14336


@pytest.mark.parametrize("recipe", ["tensor", "delayed", "block", "mxfp8"])
def test_fp8_memory_row_is_fp8_extra_bytes_and_its_gemms_run_at_the_fp8_peak(recipe):
    cfg = llama()
    plain, fp8 = run(cfg), run(cfg, fp8=recipe)
    extra = sum(fp8_extra_bytes(layout_config(cfg, Layout(**MESH, fp8=recipe), "bfloat16")).values())
    assert fp8["memory"]["rows"].get("fp8", 0) == extra and (extra > 0) == (recipe in ("tensor", "delayed"))
    wider = fp8["memory"]["rows"]["activations"] - plain["memory"]["rows"]["activations"]
    assert wider > 0  # qkv's and up's saved inputs in float32 (tests/test_fp8.py: equal to a run's saved bytes)
    assert fp8["memory"]["total"] - plain["memory"]["total"] == pytest.approx(extra + wider, rel=1e-12)
    # the FP8 GEMMs' FLOPs on a rank, at the bf16 speed and at twice it (H100: 1979 / 989 TFLOP/s)
    rows, world, tokens = 8192, 16, 16 * 8192
    gemm_s = 6 * 32 * block_matmul_weights(cfg.model) * tokens / world / speed_at(rows, 4)
    assert plain["parts"]["matmul"] - fp8["parts"]["matmul"] == pytest.approx(gemm_s * (1 - 989 / 1979), rel=1e-9)
    assert sum(fp8["parts"].values()) == pytest.approx(fp8["step_s"], rel=1e-12)
    bound = step_lower_bound(cfg, Layout(**MESH, fp8=recipe), H100)
    assert bound <= fp8["step_s"]


class CountingGroup:
    """A tp or cp group of 2 inside one process: counts Fp8Gemms' amax all-reduces and the amaxes they carry (the max
    over two equal copies: the values stay)."""
    size = 2

    def __init__(self):
        self.calls = self.amaxes = 0

    def all_reduce(self, amaxes, op):
        self.calls, self.amaxes = self.calls + 1, self.amaxes + amaxes.size


class CountingGemms(Fp8Gemms):
    """Fp8Gemms that also counts the elements it quantizes."""
    elements = 0

    def _operands(self, keys, arrays, fmt, weight, amaxes=None):
        self.elements += sum(a.size for a in arrays)
        return super()._operands(keys, arrays, fmt, weight, amaxes)


MOE = "model.moe={experts = 4, top_k = 2}"


@pytest.mark.parametrize("settings", [[], ["memory.recompute=full"], ["model.arch=llama"],
                                      ["model.arch=llama", MOE], [MOE, "memory.recompute=full"],
                                      ["model.arch=llama", "memory.recompute=selective"]])
def test_amax_all_reduces_casts_and_delayed_amaxes_are_what_a_run_calls(settings):
    """One delayed step of the tiny model in float64 with stand-in tp and cp groups of 2: the amax all-reduces per
    micro-batch (tp: every quantization call, 18 per Llama block, 26 under full recomputation; cp: the inputs' and
    output gradients'), the amaxes they carry, the elements cast and the amaxes delayed scaling reduces over dp at the
    step's end are the planner's counts."""
    cfg = load_config("configs/tiny.toml", ["data.synthetic=true", "precision.compute=float64", "train.steps=1",
                                            "logging.peak_flops=1e9", "precision.fp8=delayed", *settings])
    from mpitrain.train import Trainer
    trainer, tp, cp, dp = Trainer(cfg, MPI.COMM_SELF), CountingGroup(), CountingGroup(), CountingGroup()
    for gemms in trainer.fp8_gemms:
        gemms.group, gemms.token_group, gemms.__class__ = tp, cp, CountingGemms
    trainer.train_step(0)
    end_delayed_step(trainer.fp8_gemms, {"dp_cp": dp, "expert_dp": dp})
    m, layers = cfg.train.global_batch // cfg.train.micro_batch, cfg.model.n_layer
    assert amax_all_reduces(cfg, layers) == {"tp": (tp.calls / m, tp.amaxes / m), "cp": (cp.calls / m, cp.amaxes / m)}
    assert delayed_amaxes(cfg, layers) == dp.amaxes == sum(len(g.delayed) for g in trainer.fp8_gemms)
    elements = sum(g.elements for g in trainer.fp8_gemms)  # each read twice (amax, cast), written dequantized
    tokens = cfg.train.global_batch * cfg.model.seq_len
    assert quantized_bytes(cfg, 8, tokens, layers, m) == elements * (2 * 8 + 8)
    if settings in (["model.arch=llama"], ["model.arch=llama", "memory.recompute=selective"]):  # no more reductions
        assert (tp.calls / m / layers, cp.calls / m / layers) == (18, 10)


def test_the_estimate_moves_by_the_counted_casts_gathers_and_all_reduces():
    """Each recipe's extra traffic in the estimate is the counted term: casts over HBM, the amax all-reduces over tp
    (and delayed's over dp), and the sequence-parallel gathers of dequantized float32 operands (4 bytes, not 2)."""
    cfg = llama()
    plain, block, tensor, delayed = (run(cfg, fp8=r) for r in ("none", "block", "tensor", "delayed"))
    m, blocks, t, tokens = plain["micro_batches"], 16, 4, 16 * 8192 // 2  # tokens through one dp rank
    for result, recipe in ((block, "block"), (tensor, "tensor")):
        moved = quantized_bytes(layout_config(cfg, Layout(**MESH, fp8=recipe), "bfloat16"), 2, tokens, blocks, m)
        assert result["parts"]["elementwise"] - plain["parts"]["elementwise"] == pytest.approx(
            moved / H100.hbm_bandwidth, rel=1e-9)
    # the 4 gathers per block (attention's and MLP's input, out's and down's output gradient): dequantized operands
    wide = np.dtype(operand_dtype(np.zeros(1, ml_dtypes.bfloat16))).itemsize
    gathered = 4 * blocks * m * (t - 1) / t * 8192 * 4096 * (wide - 2) / (H100.intra.bandwidth * H100.intra.efficiency)
    assert block["parts"]["tp"] - plain["parts"]["tp"] == pytest.approx(gathered, rel=1e-9)
    layout_cfg = layout_config(cfg, Layout(**MESH, fp8="tensor"), "bfloat16")
    calls, amaxes = amax_all_reduces(layout_cfg, blocks)["tp"]
    assert calls == 18 * blocks  # the test above counts 18 in a run's Llama block
    amax = ring(H100.intra, "all_reduce", AMAX_BYTES * amaxes / calls, t, calls * m)
    assert tensor["parts"]["tp"] - block["parts"]["tp"] == pytest.approx(amax, rel=1e-9)
    history = ring(H100.intra, "all_reduce", AMAX_BYTES * delayed_amaxes(layout_cfg, blocks), 2)
    assert delayed_amaxes(layout_cfg, blocks) == 18 * blocks
    assert delayed["parts"]["dp_reduce"] - tensor["parts"]["dp_reduce"] == pytest.approx(history, rel=1e-9)


def test_fp8_is_refused_on_a_cluster_without_fp8_and_searched_only_when_asked():
    cfg = llama()
    with pytest.raises(ConfigError, match="A100"):
        run(cfg, load_cluster("a100"), fp8="tensor")
    result = CliRunner().invoke(plan_command, ["llama3-8b", "a100", "--gpus", "8", "--fp8", "any"])
    assert result.exit_code == 1 and "A100" in result.output and "Traceback" not in result.output
    group = [Layout(**{**MESH, "recompute": mode}) for mode in ("none", "full")]
    assert {(layout.tp_overlap, layout.fp8) for variant in precision_variants(cfg, group, "none", "bfloat16")
            for layout in variant} == {(True, "none")}
    assert precision_variants(cfg, group, "any", "bfloat16")[0][0].fp8 == "block"
    cfg.model.d_ff = 14336 + 64 * 4  # d_ff / tp = 3648: whole 32-element MX blocks, not 128-element ones
    assert precision_variants(cfg, group, "any", "bfloat16")[0][0].fp8 == "mxfp8"
    single = [dataclasses.replace(layout, tp=1, dp=8, etp=1) for layout in group]
    assert precision_variants(cfg, single, "tensor", "bfloat16")[0][0].tp_overlap is False


def test_the_search_lower_bound_stays_below_the_estimate_with_overlap_and_fp8():
    """The search prunes by step_lower_bound, which takes the FP8 GEMMs' saving without recomputation: it must stay
    below the estimate of every layout the search now tries."""
    from mpitrain.plan.search import candidate_layouts
    cfg, _ = model_config("llama3-8b")
    checked = 0
    for group in list(candidate_layouts(cfg, 16, H100))[::41]:
        for variant in precision_variants(cfg, group, "any", "bfloat16") + \
                precision_variants(cfg, group, "tensor", "bfloat16"):
            for layout in variant:
                try:
                    step = estimate(cfg, layout, H100)["step_s"]
                except ConfigError:
                    continue
                assert step_lower_bound(cfg, layout, H100) <= step * (1 + 1e-9), layout
                checked += layout.fp8 != "none"
    assert checked > 8
