"""Block-quantized optimizer state does not depend on the parallel layout: the blocks are each tensor's own
(mpitrain/optim/blocks.py). 8-bit Adam: a block cut by a ZeRO shard boundary takes its absmax from every rank holding
part of it; before, the blocks followed the ZeRO shards, and adam8bit under ZeRO-1 on 2 ranks ended some parameters
7% off the one-process run (float64). Adafactor's 4-bit first moment: blocks and stochastic-rounding draws per tensor
(before: per segment, so a pipeline stage drew other numbers than one process; float64 pp 2 differed at step 2)."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.optim import blocks
from mpitrain.optim.adam8bit import BLOCK, Adam8bit
from mpitrain.optim.adamw import AdamWHyper
from mpitrain.optim.factory import make_optimizer
from mpitrain.state.params import FlatBuffer, ParamSpec, UnitLayout, intersect
from mpitrain.state.strategy import Segment, ShardLayout
from tests.test_train_parity import assert_same_run, run_training

# tensors a little over and under a block, and small ones, so that shard boundaries fall inside blocks
LAYOUTS = [UnitLayout("a", [ParamSpec("w", (70, 64), "normal"), ParamSpec("b", (100,), "zeros"),
                            ParamSpec("w2", (30, 50), "normal")]),
           UnitLayout("b", [ParamSpec("w", (3, 1000), "normal"), ParamSpec("g", (7,), "ones")])]
STEPS = 4


class ThreadGroup:
    """The ranks of one process group as threads: all_reduce (max) over their buffers."""

    def __init__(self, shared, rank: int):
        self.shared, self.rank, self.size = shared, rank, shared.size

    def all_reduce(self, buf, op: str = "sum") -> None:
        assert op == "max"
        self.shared.buffers[self.rank] = buf.copy()
        self.shared.barrier.wait()
        result = np.max(self.shared.buffers, axis=0)
        self.shared.barrier.wait()  # every rank has read every buffer
        buf[...] = result


def _run(n_ranks: int, gradients):
    """After STEPS steps of 8-bit Adam, each of n_ranks holding its ZeRO shard of every unit (1: one process, the
    whole buffer one segment): per unit, its parameters and its state as checkpoints save it (element-wise codes and
    block scales); and the optimizers."""
    geometry = FlatBuffer.geometry(LAYOUTS, align=n_ranks)
    params = np.zeros(geometry.size)
    grads = np.zeros(geometry.size)
    decayed = geometry.ranges(lambda spec: spec.decay)
    for unit, layout in enumerate(LAYOUTS):
        params[geometry.offsets[unit]:geometry.offsets[unit] + layout.size] = 1.0 + np.arange(layout.size) / 1e4
    shared = SimpleNamespace(size=n_ranks, buffers=[None] * n_ranks, barrier=threading.Barrier(n_ranks))
    optimizers = []

    def rank(r: int):
        if n_ranks == 1:
            windows, groups = [(0, geometry.size)], None
        else:
            windows = [(a + r * (b - a) // n_ranks, a + (r + 1) * (b - a) // n_ranks)
                       for a, b in (geometry.unit_range(u) for u in range(len(LAYOUTS)))]
            groups = [ThreadGroup(shared, r)] * len(LAYOUTS)
        layout = ShardLayout(geometry, windows, segment_groups=groups)
        segments = [Segment(params[a:b], grads[a:b], intersect(decayed, a, b)) for a, b in windows]
        optimizer = Adam8bit(segments, AdamWHyper(weight_decay=0.1), runs=blocks.segment_runs(layout),
                             exchange=blocks.BlockExchange(layout, BLOCK))
        optimizers.append((optimizer, windows))
        for step, g in enumerate(gradients):
            shared.barrier.wait()
            if r == 0:
                for unit, layout_ in enumerate(LAYOUTS):
                    grads[geometry.offsets[unit]:geometry.offsets[unit] + layout_.size] = g[unit]
            shared.barrier.wait()
            optimizer.step(1e-2 * (1 + step), grad_scale=0.5)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n_ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    saved = {}
    for optimizer, windows in optimizers:
        for kind, array in optimizer.checkpoint_arrays().items():
            for (a, b), (start, end) in zip(windows, optimizer.bounds):
                saved.setdefault(kind, np.zeros(geometry.size, dtype=array.dtype))[a:b] = array[start:end]
    held = {"params": params, **saved}  # in the flat geometry, padding included
    return [{kind: array[geometry.offsets[u]:geometry.offsets[u] + layout.size] for kind, array in held.items()}
            for u, layout in enumerate(LAYOUTS)], [o for o, _ in optimizers]


@pytest.mark.parametrize("n_ranks", [2, 3, 5])
def test_every_zero_layout_steps_and_stores_as_one_process(n_ranks):
    """Shards of ~4500 (2 ranks), ~3000 and ~1200 elements (5 ranks: one block spans three shards): after 4 steps
    the parameters, every element's codes and its block's scale bitwise those of one process (so a checkpoint of
    either layout restores into the other unchanged)."""
    rng = np.random.default_rng(0)
    gradients = [[rng.normal(size=layout.size) * np.exp(rng.normal(size=layout.size) * 2) for layout in LAYOUTS]
                 for _ in range(STEPS)]
    one, _ = _run(1, gradients)
    sharded, optimizers = _run(n_ranks, gradients)
    assert sum(len(list(o._partial_blocks())) for o in optimizers) >= n_ranks - 1  # blocks were cut
    for unit_one, unit_sharded in zip(one, sharded):
        assert set(unit_one) == {"params", "adam8bit_m_code", "adam8bit_v_code", "adam8bit_m_absmax",
                                 "adam8bit_v_absmax"}
        for kind, array in unit_one.items():
            np.testing.assert_array_equal(unit_sharded[kind], array, err_msg=kind)


def test_a_single_process_quantizes_each_tensor_on_its_own():
    """Block k of a tensor is its elements [k B, (k + 1) B): the 4480-element matrix has 3 blocks, the 100-element
    bias 1, even where they share one segment."""
    geometry = FlatBuffer.geometry(LAYOUTS)
    runs = blocks.segment_runs(ShardLayout(geometry, [(0, geometry.size)]))
    assert [len(run.block_range(BLOCK)) for run in runs[0]] == [3, 1, 1, 2, 1]
    assert [(run.start, run.end, run.first) for run in runs[0][:2]] == [(0, 4480, 0), (4480, 5980, 0)]


def _state_with(spec):
    layout = UnitLayout("u", [spec])
    geometry = FlatBuffer.geometry([layout])
    grads = np.zeros(geometry.size)
    return SimpleNamespace(optimizer_segments=lambda: [Segment(np.zeros(geometry.size), grads, [])], sharded=False,
                           checkpoint_layout=lambda: ShardLayout(geometry, [(0, geometry.size)]))


def test_tensor_and_expert_parallel_pieces_are_runs_in_their_tensors_blocks():
    """A tp column block is one run per row, each at its elements' place in the whole tensor; a rank's experts
    (axis 0 of a stacked tensor) one run, wherever it starts (its first block is then shared with another rank)."""
    optim = SimpleNamespace(name="adam8bit", beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            adafactor_beta1=0.9, adafactor_momentum="int4")
    tp_piece = ParamSpec("w", (64, 32), "normal", 0.02, (64, 64), (0, 32), tp_replicated=False, tp_axis=1)
    tp, ep = SimpleNamespace(size=2), SimpleNamespace(size=2)  # the groups holding the other pieces
    with pytest.raises(ValueError, match="w is a piece of a tensor split over tp"):
        make_optimizer(optim, _state_with(tp_piece))  # without the group its blocks would be the piece's
    runs = make_optimizer(optim, _state_with(tp_piece), tp=tp).runs[0]
    assert [(run.start, run.end, run.first) for run in runs[:2]] == [(0, 32, 32), (32, 64, 96)] and len(runs) == 64
    assert runs[0].partial_blocks(BLOCK) == [0] and runs[0].total == 64 * 64
    unaligned_experts = ParamSpec("expert_w_fc", (1, 30, 40), "normal", 0.02, (2, 30, 40), (1, 0, 0),
                                  reduce_over="expert_dp")
    (run,) = make_optimizer(optim, _state_with(unaligned_experts), ep=ep).runs[0]
    assert (run.first, run.size, run.partial_blocks(BLOCK)) == (1200, 1200, [0])


def test_adafactor_int4_momentum_is_the_same_on_a_pipeline_stage():
    """Both units in one segment (one process) or each in its own (a pipeline stage each, as pp = 2 cuts them):
    the same parameters, bitwise, after 4 steps (the blocks and the draws are each tensor's)."""
    from mpitrain.optim.adafactor import Adafactor
    rng = np.random.default_rng(1)
    geometry = FlatBuffer.geometry(LAYOUTS)
    gradients = [rng.normal(size=geometry.size) for _ in range(STEPS)]
    results = []
    for windows in ([(0, geometry.size)], [geometry.unit_range(0), geometry.unit_range(1)]):
        params, grads = np.linspace(1, 2, geometry.size), np.zeros(geometry.size)
        layout = ShardLayout(geometry, windows)
        optimizer = Adafactor([Segment(params[a:b], grads[a:b], []) for a, b in windows], layout, momentum="int4")
        for step, g in enumerate(gradients):
            grads[:] = g
            optimizer.step(1e-2 * (1 + step))
        results.append(params)
    np.testing.assert_array_equal(*results)


FLOAT64 = ["data.synthetic=true", "precision.compute=float64", "train.steps=3"]


def test_adam8bit_under_zero_and_pipeline_is_the_one_process_run(tmp_path):
    """float64, 3 steps of the tiny model on 2 ranks: ZeRO-1, 2, 3 and pp 2, every step's loss and the final
    parameters within 1e-10 of one process (before: ZeRO-1's step-3 loss 2.6e-6 off, some parameters 7%)."""
    settings = [*FLOAT64, "optim.name=adam8bit"]
    single = run_training(1, tmp_path / "one", settings)
    for layout in ("parallel.zero=1", "parallel.zero=2", "parallel.zero=3", "parallel.pp=2"):
        assert_same_run(single, run_training(2, tmp_path / layout, [*settings, layout]))


def test_adafactor_with_int4_momentum_on_two_pipeline_stages_is_the_one_process_run(tmp_path):
    settings = [*FLOAT64, "optim.name=adafactor", "optim.adafactor_momentum=int4"]
    assert_same_run(run_training(1, tmp_path / "one", settings),
                    run_training(2, tmp_path / "pp2", [*settings, "parallel.pp=2"]))
