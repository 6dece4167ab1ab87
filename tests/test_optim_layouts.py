"""The lean optimizers in every layout: each against one process in float64, step by step (mpitrain/optim/exchange.py,
optim/blocks.py). Adafactor's factored statistics and update clipping are per tensor, and so are the quantization
blocks of its int4 moment and of 8-bit Adam: a ZeRO shard (a flat slice that may start mid-row), a tensor-parallel
box and an expert-parallel rank's experts each hold a piece of the tensor, and the pieces' partial sums (maxima) are
combined over the ranks holding them. Offloaded state (memory.offload) is bitwise the in-memory run, and ZeRO-3
shards LoRA's frozen base like the trainable parameters."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.optim.adafactor import Adafactor
from mpitrain.optim.adam8bit import Adam8bit
from mpitrain.optim.adamw import AdamWHyper
from mpitrain.optim.blocks import BlockExchange, segment_runs
from mpitrain.optim.sgd import SGD
from mpitrain.state.offload import Offloaded
from mpitrain.state.params import FlatBuffer, ParamSpec, UnitLayout, intersect
from mpitrain.state.strategy import Segment, ShardLayout
from tests.mpi_helpers import describe, run_mpi
from tests.test_train_parity import assert_same_run, run_training

FLOAT64 = ["data.synthetic=true", "precision.compute=float64", "train.steps=4"]
MOE = ["model.moe={experts = 4, top_k = 2}"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process runs the layouts are held to, made once: (optimizer settings, extra model keys) -> run."""
    runs = {}

    def run(settings: tuple, model: tuple = ()):
        if (settings, model) not in runs:
            runs[settings, model] = run_training(1, tmp_path_factory.mktemp("one"), [*FLOAT64, *settings, *model])
        return runs[settings, model]
    return run


ADAFACTOR = ("optim.name=adafactor",)  # its default first moment: int4 (quantization blocks too)


@pytest.mark.parametrize("layout, model", [(["parallel.zero=1"], ()), (["parallel.zero=2"], ()),
                                           (["parallel.zero=3"], ()), (["parallel.tp=2"], ()),
                                           (["parallel.tp=2"], ("model.vocab_size=259",)),
                                           (["parallel.ep=2"], tuple(MOE))],
                         ids=["zero1", "zero2", "zero3", "tp2", "tp2-vocab-padding", "ep2-moe"])
def test_adafactor_on_two_ranks_is_the_one_process_run(tmp_path, one_process, layout, model):
    assert_same_run(one_process(ADAFACTOR, model), run_training(2, tmp_path, [*FLOAT64, *ADAFACTOR, *model, *layout]))


def test_adafactor_experts_under_zero3_over_expert_dp_and_ep_are_the_one_process_run(tmp_path, one_process):
    """4 ranks, dp 4, ep 2, ZeRO-3: an expert tensor's pieces are split over ep (its experts) and over expert_dp
    (the ZeRO shards of those), so its clipping sums travel over both groups in turn."""
    settings, model = (*ADAFACTOR, "train.micro_batch=2"), tuple(MOE)
    assert_same_run(one_process(settings, model), run_training(4, tmp_path, [*FLOAT64, *settings, *model,
                                                                           "parallel.ep=2", "parallel.zero=3"]))


class ThreadGroup:
    """The ranks of one process group as threads: all_reduce (sum in rank order, or max) over their buffers."""

    def __init__(self, shared, rank: int):
        self.shared, self.rank, self.size = shared, rank, shared.size

    def all_reduce(self, buf, op: str = "sum") -> None:
        self.shared.buffers[self.rank] = buf.copy()
        self.shared.barrier.wait()
        result = np.max(self.shared.buffers, axis=0) if op == "max" else sum(self.shared.buffers[1:],
                                                                               self.shared.buffers[0])
        self.shared.barrier.wait()  # every rank has read every buffer
        buf[...] = result


# matrices a little over and under a 128-block, rows of 64 and 1000, a bias and a gain: shards cut rows and blocks
ZERO_LAYOUTS = [UnitLayout("a", [ParamSpec("w", (70, 64), "normal"), ParamSpec("b", (100,), "zeros"),
                                 ParamSpec("w2", (30, 50), "normal")]),
                UnitLayout("b", [ParamSpec("w", (3, 1000), "normal"), ParamSpec("g", (7,), "ones")])]


def _zero_adafactor(n_ranks: int, gradients, momentum: str):
    """The parameters after Adafactor's steps, each of n_ranks (threads) updating its ZeRO shard of every unit."""
    geometry = FlatBuffer.geometry(ZERO_LAYOUTS, align=n_ranks)
    params, grads = np.zeros(geometry.size), np.zeros(geometry.size)
    for unit, layout in enumerate(ZERO_LAYOUTS):  # the same start in every layout (padding apart)
        params[geometry.offsets[unit]:geometry.offsets[unit] + layout.size] = np.linspace(1, 2, layout.size)
    decayed = geometry.ranges(lambda spec: spec.decay)
    shared = SimpleNamespace(size=n_ranks, buffers=[None] * n_ranks, barrier=threading.Barrier(n_ranks))

    def rank(r: int):
        windows = [(a + r * (b - a) // n_ranks, a + (r + 1) * (b - a) // n_ranks)
                   for a, b in (geometry.unit_range(u) for u in range(len(ZERO_LAYOUTS)))]
        groups = [ThreadGroup(shared, r)] * len(ZERO_LAYOUTS) if n_ranks > 1 else None
        segments = [Segment(params[a:b], grads[a:b], intersect(decayed, a, b)) for a, b in windows]
        optimizer = Adafactor(segments, ShardLayout(geometry, windows, segment_groups=groups), weight_decay=0.1,
                              momentum=momentum)
        for step, g in enumerate(gradients):
            shared.barrier.wait()
            if r == 0:
                for unit, layout in enumerate(ZERO_LAYOUTS):
                    grads[geometry.offsets[unit]:geometry.offsets[unit] + layout.size] = g[unit] * (1 + step)
            shared.barrier.wait()
            optimizer.step(1e-2 * (1 + step), grad_scale=0.7)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n_ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return [params[geometry.offsets[u]:geometry.offsets[u] + layout.size] for u, layout in enumerate(ZERO_LAYOUTS)]


@pytest.mark.parametrize("momentum", ["full", "int4"])
@pytest.mark.parametrize("n_ranks", [3, 5])
def test_adafactor_over_shards_that_cut_rows_and_blocks_is_the_one_process_run(n_ranks, momentum):
    """ZeRO shards over 3 and 5 ranks (threads): shard boundaries fall mid-row and inside int4 blocks, and at 5
    ranks the (3 x 1000) matrix's rows span three shards; 4 steps give the one process's parameters."""
    rng = np.random.default_rng(3)
    gradients = [[rng.normal(size=layout.size) for layout in ZERO_LAYOUTS] for _ in range(4)]
    one = _zero_adafactor(1, gradients, momentum)
    for unit_one, unit_sharded in zip(one, _zero_adafactor(n_ranks, gradients, momentum)):
        np.testing.assert_allclose(unit_sharded, unit_one, rtol=1e-12, atol=1e-14)
    assert not np.allclose(one[0], np.linspace(1, 2, ZERO_LAYOUTS[0].size))  # the steps moved them


def test_adafactor_with_its_moment_in_full_under_zero_and_tp(tmp_path, one_process):
    """optim.adafactor_momentum = full: the factored statistics and clipping alone (no int4 blocks)."""
    settings = (*ADAFACTOR, "optim.adafactor_momentum=full")
    reference = one_process(settings)
    for layout in ("parallel.zero=1", "parallel.tp=2"):
        assert_same_run(reference, run_training(2, tmp_path / layout, [*FLOAT64, *settings, layout]))


def test_adam8bit_under_tensor_parallelism_is_the_one_process_run(tmp_path, one_process):
    """tp 2 holds column blocks of every matrix: each row of a block is a run of the tensor's quantization blocks,
    and a block spanning both ranks' columns takes its absmax over both."""
    settings = ("optim.name=adam8bit",)
    assert_same_run(one_process(settings), run_training(2, tmp_path, [*FLOAT64, *settings, "parallel.tp=2"]))


@pytest.mark.parametrize("name", ["adafactor", "adam8bit", "sgd"])
def test_disk_offload_is_bitwise_the_in_memory_run(tmp_path, name):
    """ZeRO-1 on 2 ranks, state in memory-mapped files streamed in chunks of 0.001 MB: the losses, gradient norms
    and final parameters equal to the bit, and the state really in the files."""
    common = [*FLOAT64, f"optim.name={name}", "parallel.zero=1"]
    plain = run_training(2, tmp_path / "plain", common)
    disk = run_training(2, tmp_path / "disk", [*common, "memory.offload=disk", "memory.offload_chunk_mb=0.001"])
    assert [(m["loss"], m["grad_norm"]) for m in plain[0]] == [(m["loss"], m["grad_norm"]) for m in disk[0]]
    for tensor, value in plain[1].items():
        assert np.array_equal(value, disk[1][tensor]), tensor
    files = {path.name for path in (tmp_path / "disk" / "offload").iterdir()}
    expected = {"adafactor": "adafactor_m4_code", "adam8bit": "adam8bit_m_code", "sgd": "momentum"}[name]
    assert {f"rank_0000{r}_{expected}.npy" for r in (0, 1)} <= files, files


class DeviceArray(np.ndarray):
    """A stand-in for a GPU array: what the pinned-host placement copies chunks into."""


LAYOUTS = [UnitLayout("a", [ParamSpec("w", (70, 64), "normal"), ParamSpec("b", (100,), "zeros")]),
           UnitLayout("b", [ParamSpec("w", (3, 1000), "normal"), ParamSpec("g", (7,), "ones")])]


def _lean(name: str, segments, layout, placement):
    if name == "adafactor":
        return Adafactor(segments, layout, weight_decay=0.1, momentum="int4", placement=placement)
    if name == "adam8bit":
        return Adam8bit(segments, AdamWHyper(weight_decay=0.1), runs=segment_runs(layout),
                        exchange=BlockExchange(layout, 2048), placement=placement)
    return SGD(segments, weight_decay=0.1, placement=placement)


@pytest.mark.parametrize("name", ["adafactor", "adam8bit", "sgd"])
def test_pinned_host_offload_is_bitwise_the_in_memory_run(name):
    """GPU memory.offload = host on CPU stand-ins: the state in plain numpy arrays off the 'device', every read a
    copy onto it and every write a copy back; three steps over two segments that cut tensors mid-row."""
    geometry = FlatBuffer.geometry(LAYOUTS)
    windows = [(0, 2500), (2500, geometry.size)]
    layout, decayed = ShardLayout(geometry, windows), geometry.ranges(lambda spec: spec.decay)
    written = []

    def write_back(target, chunk):
        assert not isinstance(target, DeviceArray)
        written.append(chunk.size)
        target[...] = np.asarray(chunk)

    placement = Offloaded("host", lambda name, size, dtype: np.zeros(size, dtype), "pinned host memory", 7,
                          to_device=lambda a: np.array(a).view(DeviceArray),
                          off_device=lambda a: type(a) is np.ndarray, write_back=write_back)
    rng = np.random.default_rng(0)
    gradients = [rng.normal(size=geometry.size) for _ in range(3)]
    results = []
    for where in (None, placement):
        params, grads = np.linspace(1, 2, geometry.size).view(DeviceArray), np.zeros(geometry.size).view(DeviceArray)
        segments = [Segment(params[a:b], grads[a:b], intersect(decayed, a, b)) for a, b in windows]
        optimizer = _lean(name, segments, layout, where)
        for step, g in enumerate(gradients):
            grads[...] = g
            optimizer.step(1e-2 * (1 + step), grad_scale=0.7)
        results.append((np.asarray(params), {k: np.array(v) for k, v in optimizer.checkpoint_arrays().items()}))
    assert written and np.array_equal(results[0][0], results[1][0])
    for kind, array in results[0][1].items():
        assert np.array_equal(array, results[1][1][kind]), kind


LORA = ["lora.rank=4", "lora.alpha=8.0", 'lora.targets=["wq", "wv", "w_fc"]']

LORA_MEMORY_JOB = """
import json
from mpi4py import MPI
from mpitrain.backend import make_backend
from mpitrain.comm.mesh import Mesh
from mpitrain.config import load_config, resolve_layout
from mpitrain.model.gpt import GPT
from mpitrain.state.factory import make_state
from mpitrain.state.frozen import split_frozen
world = MPI.COMM_WORLD
out = {}
for zero in (1, 3):
    cfg = load_config("configs/tiny.toml", [f"parallel.zero={zero}", "precision.compute=float64", *LORA])
    resolve_layout(cfg, world.size)
    backend = make_backend("cpu", "float64")
    model = GPT(cfg.model, backend, lora=cfg.lora)
    state = make_state(cfg, model, backend, Mesh(world, dp=world.size))
    trainable, frozen = split_frozen(model.layouts)
    out[zero] = {"params": state.memory()["params"], "trainable": [u.size for u in trainable],
                 "frozen": [u.size for u in frozen]}
if world.rank == 1:
    print("RESULTS " + json.dumps(out))
"""


def test_zero3_shards_the_lora_base_and_is_the_one_process_run(tmp_path, one_process):
    """The frozen base costs 1/dp per rank at ZeRO-3 (each unit's base padded to a multiple of dp, as the
    parameters), against whole at ZeRO-1; the run is the one-process run."""
    script = tmp_path / "job.py"
    script.write_text(LORA_MEMORY_JOB.replace("*LORA", ", ".join(repr(key) for key in LORA)))
    result = run_mpi(2, [str(script)], timeout=120)
    assert result.returncode == 0, describe(result)
    held = {int(k): v for k, v in json.loads(result.stdout.split("RESULTS ", 1)[1].splitlines()[0]).items()}
    trainable, frozen = held[1]["trainable"], held[1]["frozen"]
    whole = 8 * sum(-(-size // 2) * 2 for size in trainable) + 8 * sum(frozen)  # float64; units padded to 2
    assert held[1]["params"] == whole  # ZeRO-1: whole parameters and base on every rank
    assert held[3]["params"] == 8 * sum(-(-size // 2) for size in trainable + frozen)  # ZeRO-3: each unit's shard
    assert sum(frozen) > 10 * sum(trainable) and held[3]["params"] < 0.51 * whole
    (ref_metrics, ref_params), (metrics, params) = one_process(tuple(LORA)), run_training(
        2, tmp_path / "z3", [*FLOAT64, *LORA, "parallel.zero=3"])
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in ref_metrics], rel=1e-10, abs=0)
    for tensor, value in ref_params.items():  # the base, saved from the shards, included (zero biases: exactly)
        assert np.linalg.norm(params[tensor] - value) <= 1e-10 * np.linalg.norm(value), tensor
