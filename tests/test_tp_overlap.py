"""parallel.tp_overlap (mpitrain/layers/tp_overlap.py): the chunked, pipelined gathers and reduce-scatters give the
unchunked operators' results, train at parity with one process, and hide communication behind the matmuls.

One 4-rank job checks the operators against the plain ones on a tp group of 2 (rank pairs) and of 4 (the world):
  - gathers move bits: bitwise at every t, in float64 and bfloat16;
  - the ring's sums: bitwise at t = 2 (a + b in either order), 1e-12 relative at t = 4 (another fixed order);
  - the linears' forward and backward (column and row parallel, LoRA adapter included): 1e-12 relative, the chunked
    matmuls being row-wise equal to the unchunked ones up to BLAS's row kernels (the module docstring);
  - bytes sent: the ring moves what ring_bytes_sent says.
Training runs compare with one process at 1e-10 in float64, and bfloat16 runs with and without the overlap bit for
bit. That the overlap hides tp time is checked without a clock: one rank's recorded order of transfers posted,
chunk matmuls and waits (a recording stand-in for the tp group) is replayed with unit costs and a fixed latency per
transfer, and its exposed time must be below the plain order's and equal exposed_seconds. The wall-clock measurement
is benchmarks/bench_tp_overlap.py's (MPITRAIN_COMM_LATENCY).
"""
from __future__ import annotations

import numpy as np
import pytest

from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.layers.tensor_parallel import TensorParallel
from mpitrain.layers.tp_overlap import exposed_seconds, ring_bytes_sent
from tests.mpi_helpers import REPO_ROOT, run_python_mpi_results
from tests.test_tensor_parallel import assert_exact
from tests.test_train_parity import dataset, run_training, train_run  # noqa: F401  (dataset: the module-scoped token file)

OPERATORS_JOB = """
import json
import numpy as np
import ml_dtypes
from mpi4py import MPI
from mpitrain.comm.group import Group
from mpitrain.layers.linear import ColumnParallelLinear, RowParallelLinear
from mpitrain.layers.lora import Adapter
from mpitrain.layers.tensor_parallel import TensorParallel

world = MPI.COMM_WORLD
B, TL, C, F = 3, 5, 8, 12  # odd sizes: rows that do not line up with BLAS's row kernels


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check(group):
    t, r = group.size, group.rank
    plain, over = TensorParallel(group, True), TensorParallel(group, True, overlap=True)
    rng = np.random.default_rng(100 + world.Get_rank())
    out = {"t": t}
    # gathers: bits, in float64 and bfloat16
    for name, dtype in (("f64", np.float64), ("bf16", ml_dtypes.bfloat16)):
        x = rng.standard_normal((B, TL, C)).astype(dtype)
        h, (y,) = over.enter_and_apply(x, lambda chunk: [chunk * 3])
        out["gather_" + name] = bool(np.array_equal(h, plain.enter(x)) and np.array_equal(y, plain.enter(x) * 3))
        full = rng.standard_normal((B, TL * t, C)).astype(dtype)  # a partial sum of every position
        want = plain.exit(full.copy())
        got = over.exit_of(lambda positions: full[:, positions].copy(), TL * t)
        out["ring_bitwise_" + name] = bool(np.array_equal(got, want) and got.dtype == want.dtype)
        out["ring_rel_" + name] = rel(got, want)
    # the linears, float64, with a LoRA adapter on both
    params = {"w_up": rng.standard_normal((C, F)), "b_up": rng.standard_normal(F),
              "w_down": rng.standard_normal((F, C)),
              "w_up_lora_a": rng.standard_normal((C, 2)), "w_up_lora_b": rng.standard_normal((2, F)),
              "w_down_lora_a": rng.standard_normal((F, 2)), "w_down_lora_b": rng.standard_normal((2, C))}
    x, dy = rng.standard_normal((B, TL, C)), rng.standard_normal((B, TL, C))
    results = []
    for tp in (plain, over):
        up = ColumnParallelLinear(tp, C, ["w_up"], ["b_up"])
        down = RowParallelLinear(tp, F, "w_down")
        up.adapters["w_up"] = Adapter("w_up", "column", (C, F), 2, 1.0, tp)
        down.adapters["w_down"] = Adapter("w_down", "row", (F, C), 2, 1.0, tp)
        grads = {k: np.zeros_like(v) for k, v in params.items()}
        before = group.counters(exact=True)["send"]
        (hidden,), saved_up = up.forward(params, x)
        forward_bytes = float(group.counters(exact=True)["send"] - before)
        y, saved_down = down.forward(params, np.tanh(hidden))
        d_hidden = down.backward(params, grads, saved_down, dy) * (1 - np.tanh(hidden) ** 2)
        dx = up.backward(params, grads, saved_up, [d_hidden])
        results.append([y, dx] + [grads[k] for k in sorted(grads)])
    out["linear_rel"] = max(rel(a, b) for a, b in zip(results[1], results[0]))
    out["forward_bytes"], out["gathered_bytes"] = forward_bytes, x.nbytes * t
    return out


pair = Group(world.Split(world.Get_rank() // 2, world.Get_rank()), "tp")
every = Group(world, "tp")
results = world.gather([check(pair), check(every)])
if world.Get_rank() == 0:
    print("RESULTS " + json.dumps([row for rank in results for row in rank]))
"""


@pytest.fixture(scope="module")
def operator_results():
    return run_python_mpi_results(4, OPERATORS_JOB, timeout=120)


def test_gathers_move_bits_at_every_tp(operator_results):
    for row in operator_results:
        assert row["gather_f64"] and row["gather_bf16"], row


def test_ring_sums_are_bitwise_at_two_ranks_and_within_1e_12_beyond(operator_results):
    for row in operator_results:
        if row["t"] == 2:  # a + b in either order: the plain reduce-scatter's numbers, float32 accumulation for bf16
            assert row["ring_bitwise_f64"] and row["ring_bitwise_bf16"], row
        else:  # the ring's own summation order
            assert row["ring_rel_f64"] < 1e-12, row


def test_overlapped_linears_match_the_plain_ones(operator_results):
    for row in operator_results:
        assert row["linear_rel"] < 1e-12, row


def test_ring_sends_the_bytes_the_formula_says(operator_results):
    for row in operator_results:
        assert row["forward_bytes"] == ring_bytes_sent(row["gathered_bytes"], row["t"]), row


def test_exposed_seconds_formula():
    assert exposed_seconds(8e6, 2, 1e9, 0.0, overlap=False) == pytest.approx(4e-3)
    assert exposed_seconds(8e6, 2, 1e9, 0.006, overlap=True) == pytest.approx(1e-3)
    assert exposed_seconds(8e6, 2, 1e9, 0.1, overlap=True) == 0.0
    assert exposed_seconds(8e6, 4, 1e9, 0.004, overlap=True) == pytest.approx(3 * (2e-3 - 1e-3))
    assert exposed_seconds(8e6, 1, 1e9, 0.0, overlap=False) == 0.0


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp_overlap=true"], "parallel.tp_overlap"),
    (["parallel.tp_overlap=true", "parallel.tp=2"], "parallel.sequence_parallel = true"),
])
def test_tp_overlap_without_sequence_parallelism_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(REPO_ROOT / "configs/tiny.toml", overrides)
    assert "\n" not in str(info.value)


# ---- training at parity --------------------------------------------------------------------------------------------
FAST = ["logging.peak_flops=1e9"]
OVERLAP = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=true"]


def test_tp_overlap_trains_at_parity_with_one_process(tmp_path, dataset):
    """float64, every step's loss and gradient norm and the final weights at 1e-10: tp 2 x pp 2 with selective
    recompute (llama: K/V split, a gated MLP block and an MoE block with experts split over tp, whose gathers stay
    the plain ones), and tp 2 x dp 2 under ZeRO-1 with gpt2 (biases, tied head)."""
    llama = ["model.arch=llama", "model.n_kv_head=2", "model.vocab_size=257", "model.n_layer=2",
             "model.moe={experts = 4, top_k = 2, every = 2}"]
    reference = train_run(1, tmp_path / "ref-llama", dataset, *FAST, *llama)
    run = train_run(4, tmp_path / "tp2-pp2", dataset, *FAST, *llama, *OVERLAP, "parallel.pp=2",
                    "memory.recompute=selective", "parallel.etp=2")
    assert_exact(reference, run, "tp_overlap tp2 x pp2 selective recompute")
    gpt2 = ["model.vocab_size=258"]
    reference = train_run(1, tmp_path / "ref-gpt2", dataset, *FAST, *gpt2)
    run = train_run(4, tmp_path / "tp2-dp2", dataset, *FAST, *gpt2, *OVERLAP, "parallel.zero=1")
    assert_exact(reference, run, "tp_overlap tp2 x dp2 zero1")


def test_tp_overlap_in_bfloat16_is_bitwise_the_plain_run(tmp_path, dataset):
    """bfloat16 compute, tp 2 with sequence parallelism: with and without tp_overlap every loss and every final weight
    are the same bits. The ring's sums are (t = 2, float32 accumulation as the plain path), and the tiny model's chunk
    matmuls (64 of 128 rows) line up with BLAS's row kernels, so the order is kept everywhere."""
    settings = [f"data.path={dataset}", "precision.compute=bfloat16", "train.steps=4", *FAST, *OVERLAP[:2]]
    plain_metrics, plain_params = run_training(2, tmp_path / "plain", settings)
    metrics, params = run_training(2, tmp_path / "overlap", [*settings, "parallel.tp_overlap=true"])
    assert [m["loss"] for m in metrics] == [m["loss"] for m in plain_metrics]
    assert [m["grad_norm"] for m in metrics] == [m["grad_norm"] for m in plain_metrics]
    assert params.keys() == plain_params.keys()
    for name, value in plain_params.items():
        assert np.array_equal(params[name], value), name


# ---- exposed communication, from the recorded order of one rank's events replayed with unit costs ------------------
class RecordingGroup:
    """A tp group of `size` on one process that records, in order, every transfer posted (a ring step's send or
    receive, or a whole plain collective of size - 1 ring steps) and every wait on one. The neighbours are taken to
    run the same order at the same times (the ring is symmetric), so a receive completes when this rank's own post
    of the step would: its latency after the post. Received buffers are zeroed: only the order is under test."""

    def __init__(self, size: int, rank: int = 0):
        self.size, self.rank, self.events = size, rank, []

    def _post(self, steps: int):
        transfer = len(self.events)
        self.events.append(("post", transfer, steps))
        group = self

        class Transfer:
            done = False

            def wait(self):
                group.events.append(("wait", transfer, 0))

            def test(self):
                return False
        return Transfer()

    def isend(self, buf, peer, tag):
        return self._post(1)

    def irecv(self, buf, peer, tag):
        buf[...] = 0
        return self._post(1)

    def all_gather(self, send, recv):  # the plain gather: blocking, t - 1 ring steps
        recv[...] = 0
        self._post(self.size - 1).wait()

    def ireduce_scatter(self, send, recv):
        recv[...] = 0
        return self._post(self.size - 1)


def exposed_units(events, latency: float) -> float:
    """Replay: a matmul over c chunks costs c, a transfer of s ring steps completes s * latency after its post, a
    wait blocks until then. Returns the time spent blocked in waits."""
    clock, done, exposed = 0.0, {}, 0.0
    for kind, key, cost in events:
        if kind == "matmul":
            clock += cost
        elif kind == "post":
            done[key] = clock + cost * latency
        else:
            exposed += max(0.0, done[key] - clock)
            clock = max(clock, done[key])
    return exposed


def recorded_orders(t: int, overlap: bool, chunk: int = 3):
    """The event orders of a tp linear's four sequence-parallel operators on one rank of a tp group of t: forward
    (gather + column matmul; row matmul + reduce-scatter) and backward (row input gradient under the gather;
    column input gradient + reduce-scatter, its wait right after the last partial)."""
    group = RecordingGroup(t)
    tp = TensorParallel(group, True, overlap=overlap)
    x = np.ones((2, chunk, 4))

    def apply(rows):  # a matmul over rows.shape[1] positions: chunk positions cost 1
        group.events.append(("matmul", None, rows.shape[1] / chunk))
        return [rows * 2]

    def partial(positions):
        length = t * chunk if positions is None else positions.stop - positions.start
        group.events.append(("matmul", None, length / chunk))
        return np.ones((2, length, 4))

    orders = {}
    for name, run in (("column forward", lambda: tp.enter_and_apply(x, apply)),
                      ("row forward", lambda: tp.exit_of(partial, t * chunk)),
                      ("row backward", lambda: tp.exit_backward_and_apply(x, apply)),
                      ("column backward", lambda: tp.start_enter_backward_of(partial, t * chunk).wait())):
        group.events = []
        run()
        orders[name] = group.events
    return orders


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("latency", [0.5, 1.0, 2.5])
def test_overlap_hides_tp_transfers_in_the_recorded_order(t, latency):
    """With a deterministic latency on every tp transfer, the chunked order leaves strictly less communication
    exposed than the plain one (which waits on every transfer in full), and exactly what exposed_seconds says:
    (t-1) max(0, latency - one chunk's matmul), against (t-1) latency."""
    chunked, plain = recorded_orders(t, overlap=True), recorded_orders(t, overlap=False)
    for name in chunked:
        matmuls = [cost for kind, _, cost in chunked[name] if kind == "matmul"]
        assert matmuls == [1.0] * t, name  # the matmul cut into the t chunks
        assert [kind for kind, _, _ in plain[name]].count("post") == 1, name
        exposed, unchunked = exposed_units(chunked[name], latency), exposed_units(plain[name], latency)
        assert unchunked == (t - 1) * latency == exposed_seconds(0.0, t, 1.0, t, overlap=False, latency_s=latency)
        assert exposed < unchunked, name
        assert exposed == pytest.approx(exposed_seconds(0.0, t, 1.0, t, overlap=True, latency_s=latency)), name
