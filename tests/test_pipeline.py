"""Pipeline parallelism is exact, holds the activations its schedule says, and runs its schedule's order.

Parity runs the real `mpitrain train` under mpiexec (float64, 6 steps) at pp = 2 and 4 with every schedule, and at
pp = 2 x tp = 2 x dp = 2 with ZeRO-1, for gpt2 (tied head: the last stage holds a copy of the embedding) and llama,
and compares every step's loss and gradient norm, the validation loss and the final weights (read from the final
checkpoint) with the single process. Activation memory is measured in-process under MPI from the executor's own
accounting. The bubble is checked from the ORDER of the events each rank's executor recorded, replayed with unit
costs (F 1, B 2): nothing here reads a clock, so the tests pass on a busy machine; the wall-clock bubble is measured
by benchmarks/bench_pipeline.py. The layer split, the split backward (zb1p's B and W) and the config errors are
tested without MPI.
"""
from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from mpitrain.backend import make_backend
from mpitrain.checkpoint.store import Checkpoint, committed_checkpoints
from mpitrain.config import load_config, resolve_layout
from mpitrain.errors import ConfigError
from mpitrain.model.gpt import GPT
from mpitrain.parallel.pipeline import rank_stages, stage_layer_counts
from mpitrain.parallel.schedule import ScheduleError, make_schedule, theoretical_bubble
from mpitrain.parallel.schedule_analysis import bubble_fraction, format_schedule
from mpitrain.parallel.timeline import recorded_program, replay
from mpitrain.state.replicated import ReplicatedState
from tests.mpi_helpers import REPO_ROOT, describe, run_mpi, run_python_mpi_results
from tests.test_checkpoint import PREEMPTED, losses, saved_state, train
from tests.test_tensor_parallel import assert_exact
from tests.test_train_parity import dataset, train_run  # noqa: F401  (dataset: the module-scoped token file)

FAST = ["logging.peak_flops=1e9"]
BASE = ["model.n_layer=8", "train.micro_batch=2"]  # 8 layers: pp 4 x 2 chunks; m = 4 micro-batches at dp = 1
FLAVOURS = {
    "gpt2": ["model.vocab_size=258"],  # tied head; tp 2: 129 vocabulary rows each
    "llama": ["model.arch=llama", "model.n_kv_head=2", "model.vocab_size=257"],
}
LAYOUTS = {  # name: (ranks, overrides)
    **{f"pp{p}-{kind}": (p, [f"parallel.pp={p}", f"parallel.schedule={kind}"]
                         + (["parallel.virtual_stages=2"] if kind == "interleaved" else []))
       for p in (2, 4) for kind in ("gpipe", "1f1b", "interleaved", "zb1p")},
    "pp2-tp2-dp2-zero1": (8, ["parallel.pp=2", "parallel.tp=2", "parallel.zero=1"]),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory, dataset):
    root = tmp_path_factory.mktemp("pp-reference")
    return {name: train_run(1, root / name, dataset, *FAST, *BASE, *extra) for name, extra in FLAVOURS.items()}


def activation_bytes(micro_batch=2, seq_len=32, d_model=32, itemsize=8) -> int:
    return micro_batch * seq_len * d_model * itemsize


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_pipeline_matches_single_process(tmp_path, dataset, references, flavour, layout):
    ranks, overrides = LAYOUTS[layout]
    metrics, _params = run = train_run(ranks, tmp_path / "run", dataset, *FAST, *BASE, *FLAVOURS[flavour], *overrides)
    assert_exact(references[flavour], run, f"{flavour} {layout}")
    assert all(0 < record["bubble"] < 1 for record in metrics), "every logged step measures its bubble"
    # rank 0 sends each micro-batch's activation forward from each of its chunks (and, interleaved, the input
    # gradient backward from its chunk 1, a middle stage), and (gpt2) swaps the tied embedding's gradient with the
    # last stage: the whole embedding unit, its vocabulary rows under tp, its shard under ZeRO
    p = int(overrides[0].split("=")[1])
    dp, tp, v = (2, 2, 1) if "tp2" in layout else (1, 1, 2 if "interleaved" in layout else 1)
    stages = [chunk * p for chunk in range(v)]  # rank 0's virtual stages
    messages = (8 // (dp * 2)) * sum((stage < p * v - 1) + (stage > 0) for stage in stages)
    embedding = (-(-258 // tp) * 32 + 32 * 32) // dp * 8 if flavour == "gpt2" else 0
    for record in metrics:
        assert record["comm_bytes"]["send"] == messages * activation_bytes() + embedding, record["comm_bytes"]


COMPOSITIONS = {  # ZeRO-2 and 3 with split backwards and interleaving; replicated K/V heads reduced in W
    "pp2-zero2-zb1p": (4, ["parallel.pp=2", "parallel.zero=2", "parallel.schedule=zb1p"], "gpt2"),
    "pp2-zero3-interleaved": (4, ["parallel.pp=2", "parallel.zero=3", "parallel.schedule=interleaved",
                                  "parallel.virtual_stages=2"], "gpt2"),
    "pp2-tp4-sp-zb1p-mqa": (8, ["parallel.pp=2", "parallel.tp=4", "parallel.sequence_parallel=true",
                                "parallel.schedule=zb1p"], "llama"),
}


@pytest.mark.parametrize("name", COMPOSITIONS)
def test_pipeline_composes_with_zero_and_tensor_parallelism(tmp_path, dataset, references, name):
    ranks, overrides, flavour = COMPOSITIONS[name]
    run = train_run(ranks, tmp_path / "run", dataset, *FAST, *BASE, *FLAVOURS[flavour], *overrides)
    assert_exact(references[flavour], run, name)


def test_zero3_with_a_pipeline_warns_once(tmp_path, dataset):
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path)]
    for setting in [f"data.path={dataset}", *FAST, "train.steps=1", "parallel.pp=2", "parallel.zero=3"]:
        args += ["--set", setting]
    result = run_mpi(4, args, timeout=600)  # deadlines only catch hangs: generous for a busy machine
    assert result.returncode == 0, describe(result)
    assert result.stderr.count("warning: parallel.zero = 3 with parallel.pp = 2") == 1, describe(result)


# ---- checkpoints -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_stop_and_resume_under_a_pipeline_is_bitwise_the_same_run(tmp_path, dataset, asynchronous):
    settings = ["checkpoint.every=2", "model.n_layer=4", "train.micro_batch=2", "parallel.pp=2",
                "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                f"checkpoint.async={str(asynchronous).lower()}"]
    train(2, tmp_path / "straight", dataset, *settings)
    train(2, tmp_path / "resumed", dataset, *settings, "train.stop_at=4", expect=PREEMPTED)
    out = train(2, tmp_path / "resumed", dataset, *settings, resume="auto")
    assert "checkpoint: resumed from" in out.stdout
    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")
    a, b = saved_state(tmp_path / "straight"), saved_state(tmp_path / "resumed")
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))
    # the last stage's copy of the tied embedding is never written: every tensor is saved exactly once
    Checkpoint.open(committed_checkpoints(tmp_path / "resumed" / "checkpoints")[-1]).verify_coverage()


def test_a_pipelined_run_continues_under_another_layout(tmp_path, dataset):
    settings = ["precision.compute=float64", "model.n_layer=4", "train.micro_batch=2"]
    train(1, tmp_path / "straight", dataset, *settings)
    train(4, tmp_path / "moved", dataset, *settings, "parallel.pp=4", "parallel.schedule=zb1p", "train.stop_at=4",
          expect=PREEMPTED)
    train(4, tmp_path / "moved", dataset, *settings, "parallel.pp=2", "parallel.tp=2", resume="auto")
    straight, moved = losses(tmp_path / "straight"), losses(tmp_path / "moved")
    assert straight.keys() == moved.keys()
    for step, loss in straight.items():
        assert abs(moved[step] - loss) <= 1e-10 * abs(loss), step


# ---- activation memory -------------------------------------------------------------------------------------------
MEMORY_JOB = """
import json
from mpi4py import MPI
from mpitrain.config import load_config
from mpitrain.parallel.schedule import make_schedule
from mpitrain.parallel.schedule_analysis import peak_activations
from mpitrain.train import Trainer

world = MPI.COMM_WORLD
results = {}
for kind in ("gpipe", "1f1b", "zb1p", "interleaved"):
    cfg = load_config("configs/tiny.toml", ["data.synthetic=true", "logging.peak_flops=1e9", "model.n_layer=8",
                                            "precision.compute=float64", "train.micro_batch=1", "train.global_batch=8",
                                            f"parallel.pp={world.size}", f"parallel.schedule={kind}",
                                            f"parallel.virtual_stages={2 if kind == 'interleaved' else 1}"])
    trainer = Trainer(cfg, world)
    trainer.train_step(0)
    pipeline = trainer.pipeline
    gathered = world.gather([pipeline.activation_peak_bytes, pipeline.saved_bytes_per_micro_batch,
                             pipeline.timeline.to_dicts()], root=0)
    if world.rank == 0:
        results[kind] = {"peak": [g[0] for g in gathered], "per_chunk": [g[1] for g in gathered],
                         "events": [g[2] for g in gathered], "v": pipeline.v,
                         "schedule": peak_activations(make_schedule(kind, world.size, 8, pipeline.v))}
if world.rank == 0:
    print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def memory():
    return run_python_mpi_results(4, MEMORY_JOB, timeout=600)


def test_1f1b_holds_p_micro_batches_on_the_first_stage_where_gpipe_holds_m(memory):
    p, m = 4, 8
    for rank in range(p):
        gpipe, one_f_one_b = memory["gpipe"], memory["1f1b"]
        micro_batch = gpipe["per_chunk"][rank][0]  # one micro-batch's saved state on this stage
        assert gpipe["peak"][rank] == m * micro_batch, (rank, gpipe)
        assert one_f_one_b["peak"][rank] == (p - rank) * micro_batch, (rank, one_f_one_b)
    first = memory["1f1b"]["per_chunk"][0][0]
    assert memory["1f1b"]["peak"][0] / first == p and memory["gpipe"]["peak"][0] / first == m


def test_zb1p_holds_what_1f1b_does_counting_the_deferred_weight_gradients(memory):
    """W keeps its matmuls' inputs and output gradients until it runs: counted. On the first stage B and W run
    back to back (peak p micro-batches, as 1F1B); the last stage, whose W's lag p-1 steps, stays below p."""
    p, zb1p = 4, memory["zb1p"]
    for rank in range(p):
        micro_batch = zb1p["per_chunk"][rank][0]
        assert zb1p["peak"][rank] <= p * micro_batch, (rank, zb1p)
    assert zb1p["peak"][0] == memory["1f1b"]["peak"][0]
    assert zb1p["peak"][p - 1] > memory["1f1b"]["peak"][p - 1]  # the deferred W's really are counted


def test_interleaved_holds_what_its_schedule_says(memory):
    """(micro-batch, chunk) pairs in flight, each half a stage's worth: the schedule's count, measured."""
    interleaved = memory["interleaved"]
    for rank in (1, 2):  # middle ranks: both chunks hold blocks only, so every pair weighs the same
        per_pair = interleaved["per_chunk"][rank][0]
        assert interleaved["per_chunk"][rank][1] == per_pair
        assert interleaved["peak"][rank] == interleaved["schedule"][rank] * per_pair, (rank, interleaved)


# ---- the bubble, from the recorded event order -------------------------------------------------------------------
ORDER_JOB = """
import json
import time
from mpi4py import MPI
from mpitrain.config import load_config
from mpitrain.train import Trainer

world = MPI.COMM_WORLD
results = []
for kind, m, slow in (("gpipe", 2, 0), ("gpipe", 4, 0), ("1f1b", 1, 0), ("1f1b", 2, 0), ("1f1b", 4, 0),
                      ("1f1b", 8, 0), ("1f1b", 4, 1), ("zb1p", 1, 0), ("zb1p", 4, 1), ("interleaved", 2, 0),
                      ("interleaved", 4, 0), ("interleaved", 4, 1)):
    v = 2 if kind == "interleaved" else 1
    cfg = load_config("configs/tiny.toml", [
        "data.synthetic=true", "logging.peak_flops=1e9", "precision.compute=float64", "model.n_layer=4",
        "train.micro_batch=1", f"train.global_batch={m}", f"parallel.pp={world.size}", f"parallel.schedule={kind}",
        f"parallel.virtual_stages={v}"])
    trainer = Trainer(cfg, world)
    if slow and world.rank == slow:  # this rank's forwards are slow, as on a core that another job keeps busy
        forward = trainer.model.forward
        trainer.model.forward = lambda *args, **kwargs: (time.sleep(0.02), forward(*args, **kwargs))[1]
    trainer.train_step(0)
    trainer.train_step(1)  # the timeline holds the last step's events
    gathered = world.gather(trainer.pipeline.timeline.to_dicts(), root=0)
    if world.rank == 0:
        results.append({"kind": kind, "m": m, "slow": slow, "v": v, "events": gathered})
if world.rank == 0:
    print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def recorded():
    """(kind, m, slowed rank or 0) -> (v, the events every rank of a pp = 2 run recorded in its last step)."""
    runs = run_python_mpi_results(2, ORDER_JOB, timeout=600)
    return {(r["kind"], r["m"], r["slow"]): (r["v"], r["events"]) for r in runs}


def check_recorded_order(kind, p, m, v, events):
    """The executor ran exactly its schedule's instructions in its order; replayed with unit costs, that order
    gives the formula's bubble (gpipe, 1f1b) or less (interleaved, zb1p)."""
    program = recorded_program(events, p)
    assert program == make_schedule(kind, p, m, v), format_schedule(program)
    bubble = bubble_fraction(replay(events, p, t_forward=1.0, t_backward=2.0, t_backward_input=1.0,
                                    t_backward_weight=1.0))
    formula = (p - 1) / (m + p - 1)
    if kind in ("gpipe", "1f1b"):
        assert bubble == pytest.approx(formula, abs=1e-12), (kind, p, m, bubble)
    else:
        assert bubble == pytest.approx(theoretical_bubble(kind, p, m, v), abs=1e-12), (kind, p, m, bubble)
        assert bubble < formula, (kind, p, m, bubble, formula)


@pytest.mark.parametrize("kind, m", [("gpipe", 2), ("gpipe", 4), ("1f1b", 1), ("1f1b", 2), ("1f1b", 4), ("1f1b", 8),
                                     ("zb1p", 1), ("interleaved", 2), ("interleaved", 4)])
def test_recorded_order_at_two_stages_gives_the_formula_bubble(recorded, kind, m):
    v, events = recorded[kind, m, 0]
    check_recorded_order(kind, 2, m, v, events)


@pytest.mark.parametrize("kind", ["1f1b", "zb1p", "interleaved"])
def test_a_slow_stage_changes_the_timing_but_not_the_order(recorded, kind):
    """Rank 1's forwards made slow (a busy core): the measured times change, the recorded order and the bubble it
    implies do not. This is why the check holds on a loaded machine."""
    v, events = recorded[kind, 4, 1]
    check_recorded_order(kind, 2, 4, v, events)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb1p", "interleaved"])
def test_recorded_order_at_four_stages_gives_the_formula_bubble(memory, kind):
    check_recorded_order(kind, 4, 8, memory[kind]["v"], memory[kind]["events"])


def test_a_reordered_or_missing_event_changes_the_replay():
    """The check above can fail: an executor that ran 1F1B's backwards late (GPipe's order) or skipped an event no
    longer matches its schedule; a skipped receive does not even replay; and the replay times what it is given."""
    p, m = 2, 4

    def as_events(schedule):
        return [[{"rank": rank, "kind": ins.op, "micro": ins.micro, "chunk": ins.chunk}
                 for ins in program if ins.op != "optimizer_step"] for rank, program in enumerate(schedule)]

    gpipe_order = as_events(make_schedule("gpipe", p, m))
    assert recorded_program(gpipe_order, p) != make_schedule("1f1b", p, m)
    assert recorded_program(as_events(make_schedule("1f1b", p, m)), p) == make_schedule("1f1b", p, m)
    dropped = as_events(make_schedule("1f1b", p, m))
    del dropped[1][0]  # rank 1's first receive
    assert recorded_program(dropped, p) != make_schedule("1f1b", p, m)
    with pytest.raises(ScheduleError, match="deadlock|out of order"):
        replay(dropped, p)
    stretched = bubble_fraction(replay(as_events(make_schedule("1f1b", p, m)), p, t_comm=1.0))
    assert stretched > (p - 1) / (m + p - 1)  # the replay does time what it is given


# ---- without MPI: the layer split, the split backward, the model's units, the errors ------------------------------
def test_every_unit_lands_on_exactly_one_stage():
    for n_layer, p, v, override in [(8, 2, 1, ()), (7, 2, 1, ()), (8, 4, 2, ()), (5, 1, 3, ()), (6, 2, 1, (1, 5))]:
        seen = []
        for rank in range(p):
            chunks = rank_stages(n_layer, p, v, rank, override)
            assert len(chunks) == v
            seen += [(chunk * p + rank, first, end) for chunk, (first, end) in enumerate(chunks)]
        seen.sort()
        assert seen[0][1] == 0 and seen[-1][2] == n_layer + 2  # embedding first, head last
        assert all(a[2] == b[1] for a, b in itertools.pairwise(seen)), seen  # contiguous, no gaps, no overlap
        layers = [end - first - (s == 0) - (s == p * v - 1) for s, first, end in seen]
        assert layers == stage_layer_counts(n_layer, p * v, override)
    assert stage_layer_counts(7, 2) == [4, 3]  # the remainder on the first stages (the last holds the head)


def test_stage_models_hold_their_units_and_the_tied_copy():
    backend = make_backend("cpu", "float64")
    for arch in ("gpt2", "llama"):
        cfg = load_config(REPO_ROOT / "configs/tiny.toml", ["model.n_layer=4", f"model.arch={arch}"]).model
        whole = GPT(cfg, backend)
        names = []
        for rank in range(2):
            stage = GPT(cfg, backend, stages=rank_stages(4, 2, 1, rank))
            assert stage.n_params == whole.n_params
            names += [layout.name for layout in stage.layouts]
            if arch == "gpt2" and rank == 1:
                assert stage.layouts[-1].name == "embed" and stage.tied_copies == ("embed.wte", "embed.wpe")
            else:
                assert stage.tied_copies == ()
        copies = 1 if arch == "gpt2" else 0
        assert sorted(names) == sorted([layout.name for layout in whole.layouts] + ["embed"] * copies)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_split_backward_gives_the_full_backward(arch):
    """B then W (zb1p) computes the same input and weight gradients as one backward; B alone leaves the matmuls."""
    backend = make_backend("cpu", "float64")
    extra = ["model.n_kv_head=2"] if arch == "llama" else []
    cfg = load_config(REPO_ROOT / "configs/tiny.toml", [f"model.arch={arch}", *extra]).model
    model = GPT(cfg, backend)
    rng = np.random.default_rng(0)
    tokens, targets = rng.integers(0, 256, (2, 32)), rng.integers(0, 256, (2, 32))
    grads = []
    for split in (False, True):
        state = ReplicatedState(model.layouts, backend, seed=3)
        _, saved = model.forward(state, tokens.copy(), targets)
        deferred = {} if split else None
        model.backward(state, saved, 1.0 / tokens.size, deferred=deferred)
        if split:
            # per layer: gpt2 Q/K/V as one product (their gradients side by side), o, fc, proj; llama (RoPE) q, k,
            # v, o, gate, up, down; and the head
            assert sum(len(work) for work in deferred.values()) == cfg.n_layer * (4 if arch == "gpt2" else 7) + 1
            assert not np.any(state.grads.views[1]["wq"])  # not computed yet
            model.backward_weight(state, deferred)
        grads.append(state.grads.data.copy())
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-12, atol=1e-15)


def one_line_error(overrides, world_size=1):
    with pytest.raises(ConfigError) as info:
        resolve_layout(load_config(REPO_ROOT / "configs/tiny.toml", overrides), world_size)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.pp=4"], 4, "model.n_layer = 2 is fewer than the 4 pipeline stages"),
    (["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"], 2,
     "model.n_layer = 2 is fewer than the 4 pipeline stages (parallel.pp * parallel.virtual_stages = 2 * 2)"),
    (["model.n_layer=8", "parallel.pp=4", "parallel.schedule=interleaved", "parallel.virtual_stages=2"], 4,
     ("the interleaved schedule needs the micro-batches per step (2 = train.global_batch / (parallel.dp * "
     "train.micro_batch)) to be a multiple of parallel.pp = 4")),
    (["model.n_layer=4", "parallel.pp=2", "parallel.virtual_stages=2"], 2,
     "parallel.virtual_stages = 2 needs parallel.schedule = 'interleaved'"),
    (["model.n_layer=4", "parallel.pp=2", "parallel.stage_layers=[1, 2]"], 2,
     "parallel.stage_layers = [1, 2] sums to 3"),
    (["model.n_layer=4", "parallel.pp=2", "parallel.stage_layers=[4]"], 2, "parallel.stage_layers has 1 entries"),
    (["model.n_layer=4", "parallel.pp=2", "parallel.stage_layers=[4, 0]"], 2,
     "parallel.stage_layers = [4, 0] leaves a stage without layers"),
    (["parallel.stage_layers=[1.5, 0.5]"], 1, "config key parallel.stage_layers must be a list of integers"),
    (["parallel.pp=2", "parallel.microbatches=3"], 2, "parallel.microbatches = 3 does not match"),
    (["parallel.schedule=pipedream"], 1, "config key parallel.schedule = 'pipedream' is not allowed"),
])
def test_pipeline_errors_are_one_clear_line(overrides, world, message):
    assert one_line_error(overrides, world).startswith(message)


def test_agreeing_microbatches_and_uneven_stages_are_accepted():
    cfg = load_config(REPO_ROOT / "configs/tiny.toml", ["model.n_layer=4", "parallel.pp=2", "parallel.microbatches=2",
                                                         "parallel.stage_layers=[1, 3]"])
    resolve_layout(cfg, 2)
    assert rank_stages(4, 2, 1, 1, cfg.parallel.stage_layers) == [(2, 6)]


def test_a_bad_pipeline_fails_fast_on_every_rank(tmp_path):
    result = run_mpi(2, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path), "--set",
                         "parallel.pp=2", "--set", "model.n_layer=1"], timeout=600)
    assert result.returncode != 0, describe(result)
    assert "model.n_layer = 1 is fewer than the 2 pipeline stages" in result.stderr, describe(result)
    assert "Traceback" not in result.stderr, describe(result)


# ---- where messages live: device buffers through NCCL, host buffers through MPI ----------------------------------
MESSAGES_JOB = r"""
import json
import numpy as np
from mpi4py import MPI
from mpitrain.backend import make_backend
from mpitrain.comm.group import Group
from mpitrain.comm.nccl import P2P_TAGS, HostRuntime, NcclGroup
from mpitrain.parallel.pipeline import PipelineExecutor
from mpitrain.parallel.schedule import make_schedule

world = MPI.COMM_WORLD
rank, p, v, m, SHAPE = world.Get_rank(), world.Get_size(), 2, 4, (2, 3, 4)


class CountingBackend:
    '''The float64 numpy backend, counting the host <-> device moves and the buffers the executor asks for.'''

    def __init__(self):
        self.inner = make_backend("cpu", "float64")
        self.xp, self.dtype = self.inner.xp, self.inner.dtype
        self.moves = dict.fromkeys(("to_host", "from_host", "host_buffers", "device_buffers"), 0)

    def empty(self, shape, dtype=None, host=True):
        self.moves["host_buffers" if host else "device_buffers"] += 1
        return self.inner.empty(shape, dtype, host)

    def to_host(self, array):
        self.moves["to_host"] += 1
        return self.inner.to_host(array)

    def from_host(self, array, dtype=None):
        self.moves["from_host"] += 1
        return self.inner.from_host(array, dtype)


class Chunks:
    '''This rank's v chunks of y = tanh(x * w): stage 0 starts from the token ids, the last ends in a loss sum.'''
    layouts, tied_unit = [], None

    def __init__(self):
        self.chunks = list(range(v))
        self.w = [np.linspace(0.5, 1.5, SHAPE[-1]) * (1 + c * p + rank) / 4 for c in range(v)]
        self.grads = [np.zeros(SHAPE[-1]) for _ in range(v)]

    def forward(self, gradients, x, targets, chunk, loss_scale=None):
        x = x[..., None].astype(np.float64) if x.ndim == 2 else x
        y = np.tanh(x * self.w[chunk])
        if targets is None:
            return y, (x, y)
        return float(np.sum(y * targets[..., None])), (x, y, targets[..., None])

    def backward(self, gradients, saved, dy, chunk, deferred=None):
        x, y = saved[:2]
        dy = dy * saved[2] if len(saved) == 3 else dy
        dz = dy * (1 - y * y)
        self.grads[chunk] += np.sum(dz * x, axis=(0, 1))
        return dz * self.w[chunk]


class State:
    reduces_every_micro_batch = False

    def begin_micro_batch(self, last):
        pass

    def finish(self):
        pass


def batch(micro):
    rng = np.random.default_rng(micro)
    return rng.integers(0, 5, SHAPE[:2]), rng.standard_normal(SHAPE[:2])


groups = {"mpi": Group(world.Dup(), "pp"),
          "nccl": NcclGroup(world.Dup(), "pp", runtime=HostRuntime(), p2p_tags=P2P_TAGS["pp"])}
program = make_schedule("interleaved", p, m, v)[rank]
out = {}
for kind, group in groups.items():
    model, backend = Chunks(), CountingBackend()
    executor = PipelineExecutor(model, State(), group, program, m, SHAPE, backend)
    loss = executor.run_step(batch, 0.5)
    out[kind] = {"moves": backend.moves, "loss": loss, "grads": [g.tolist() for g in model.grads]}
out["lanes"] = {str(key): list(communicator.issued) for key, (communicator, _) in groups["nccl"]._lanes.items()}
communicator, _ = next(iter(groups["nccl"]._lanes.values()))
try:  # a lane's communicator on the main stream
    communicator.send(HostRuntime().pointer(np.zeros(1)), 1, 8, 1 - rank, groups["nccl"]._main[1].ptr)
    out["second_stream"] = ""
except ValueError as exc:
    out["second_stream"] = str(exc)
everyone = world.gather(out)
if rank == 0:
    print("RESULTS " + json.dumps(everyone))
"""


@pytest.fixture(scope="module")
def messages():
    """Rank by rank, one interleaved step (pp 2, 2 chunks: both directions carry activations and gradients) of a
    small stand-in model through the MPI group and through the NCCL group on the host stand-in."""
    return run_python_mpi_results(2, MESSAGES_JOB, timeout=300)


def test_nccl_pipeline_messages_stay_on_the_device_with_the_same_numbers(messages):
    m = 4
    for rank, out in enumerate(messages):
        mpi, nccl = out["mpi"]["moves"], out["nccl"]["moves"]
        # 4 virtual stages on 2 ranks: each rank sends 3m messages and receives 3m (stage 0 receives no activation,
        # the last no gradient). MPI: every message sent is copied to host, every one received arrives in a host
        # buffer and is copied to the device
        assert mpi["to_host"] == 3 * m and mpi["host_buffers"] == 3 * m and mpi["device_buffers"] == 0, (rank, mpi)
        # NCCL: none (from_host brings only the micro-batch's token ids, or its targets, onto the device)
        assert nccl["to_host"] == 0 and nccl["host_buffers"] == 0 and nccl["device_buffers"] == 3 * m, (rank, nccl)
        assert nccl["from_host"] == m and mpi["from_host"] == 4 * m, (rank, mpi, nccl)
        assert out["nccl"]["grads"] == out["mpi"]["grads"] and out["nccl"]["loss"] == out["mpi"]["loss"]
    assert messages[1]["mpi"]["loss"] != 0.0


def test_nccl_lanes_keep_one_order_per_communicator(messages):
    """nccl.py's ordering rule: a lane is one stream, on which each rank only sends or only receives, so its
    messages pair in issue order (the same count and type, send by send); each pair that uses a lane exchanged one
    byte on it at creation, before any message; the stand-in refuses a second stream."""
    used = 0
    for lane in messages[0]["lanes"]:
        issued = [messages[rank]["lanes"][lane] for rank in (0, 1)]
        sends = [[(count, code) for op, peer, count, code in ops if op == "send"] for ops in issued]
        receives = [[(count, code) for op, peer, count, code in ops if op == "recv"] for ops in issued]
        for rank in (0, 1):
            assert not (sends[rank] and receives[rank]), f"rank {rank} both sends and receives on lane {lane}"
            assert sends[rank] == receives[1 - rank], lane
            assert all(peer == 1 - rank for _, peer, _, _ in issued[rank]), lane
            if issued[rank]:
                assert issued[rank][0][2:] == [1, 1], f"lane {lane} was not connected at creation: {issued[rank]}"
        used += len(sends[0] + sends[1]) > 1
    assert used == 4, "interleaved at pp 2: forward and backward, each way"
    for out in messages:
        assert "used on stream" in out["second_stream"], out["second_stream"]


def single_stream_groups(program):
    """A rank's messages as NCCL's own pipeline pattern would issue them on ONE communicator and stream: each send
    held back and issued with the next receive in one group call (alone when a send comes first)."""
    transfers = [ins for ins in program if ins.op.startswith(("send", "recv"))]
    groups, pending = [], []
    for i, ins in enumerate(transfers):
        pending.append(ins)
        if ins.op.startswith("recv") or i + 1 == len(transfers) or transfers[i + 1].op.startswith("send"):
            groups.append(pending)
            pending = []
    return groups


def completes_on_one_stream(schedule) -> bool:
    """Rendezvous semantics: a message moves once both its ends' groups are running; a rank's groups run one after
    the other. The k-th message from a to b is the k-th send of a to b and the k-th receive of b from a."""
    numbered, seen = [], Counter()
    for rank, program in enumerate(schedule):
        groups = []
        for group in single_stream_groups(program):
            ends = []
            for ins in group:
                pair = (rank, ins.peer) if ins.op.startswith("send") else (ins.peer, rank)
                seen[pair, ins.op[:4]] += 1
                ends.append((pair, seen[pair, ins.op[:4]]))
            groups.append(ends)
        numbered.append(groups)
    position, moved = [0] * len(schedule), set()
    while True:
        running = Counter(end for rank, groups in enumerate(numbered) if position[rank] < len(groups)
                          for end in groups[position[rank]])
        moved |= {end for end, ends in running.items() if ends == 2}
        advanced = [rank for rank, groups in enumerate(numbered)
                    if position[rank] < len(groups) and set(groups[position[rank]]) <= moved]
        for rank in advanced:
            position[rank] += 1
        if not advanced:
            return all(position[rank] == len(groups) for rank, groups in enumerate(numbered))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb1p", "interleaved"])
def test_why_nccl_lanes_and_not_one_stream(kind):
    """nccl.py, "Ordering": one communicator on one stream, sends paired with the next receive, completes every
    gpipe, 1f1b and zb1p program but no interleaved one of more than one round (m >= 2p), whose sends must finish
    before their receivers' single stream reaches them."""
    shapes = [(p, m) for p in (2, 3, 4, 8) for m in range(2 * p, 17, p)]
    outcomes = {completes_on_one_stream(make_schedule(kind, p, m, 2 if kind == "interleaved" else 1))
                for p, m in shapes}
    assert outcomes == {kind != "interleaved"}
