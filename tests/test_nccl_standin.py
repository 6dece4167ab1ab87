"""The NCCL group's code (pointers, offsets, counts, dtype codes, group calls, lanes, staging) run in CI against the
host stand-in of `cupy.cuda.nccl` (mpitrain/comm/nccl_standin.py): every operation equals the MPI group's result
and byte counters; a wrong count or offset fails; sends hold their stream as NCCL's do; and the dp, ZeRO-1/2/3, tp,
pp (1F1B and interleaved) and cp float64 parity runs go through the NCCL groups (MPITRAIN_NCCL_STANDIN=1,
train.collectives = "nccl") at 1e-10 against one process; bf16 gradient reduction gives the MPI run's numbers.
"""
from __future__ import annotations

import json

import pytest

from mpitrain.comm.nccl import STANDIN_ENV, make_group_factory
from mpitrain.errors import ConfigError
from tests.mpi_helpers import describe, run_mpi, run_python_mpi_results
from tests.test_train_parity import assert_same_run, final_params, train_run

GROUP_OPERATIONS = r"""
import json, sys, time
import ml_dtypes
import numpy as np
from mpi4py import MPI
from mpitrain.comm import nccl_standin
from mpitrain.comm.group import Group
from mpitrain.comm.nccl import HostRuntime, HostStagedGroup, NcclGroup

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
runtime = HostRuntime()
groups = {"mpi": Group(world.Dup(), "pp"), "nccl": NcclGroup(world.Dup(), "pp", runtime=runtime, p2p_tags=(0, 1)),
          "staged": HostStagedGroup(world.Dup(), "pp", runtime=HostRuntime(shared_gpu=True))}
rng = np.random.default_rng(100 + rank)

def data(n, dtype=np.float64):
    return rng.standard_normal(n).astype(dtype)

def run(group, case):
    '''One operation on copies of this rank's inputs; returns every array it wrote.'''
    x64, x32 = CASE_DATA["x64"].copy(), CASE_DATA["x32"].copy()
    if case == "all_reduce":
        group.all_reduce(x64); group.all_reduce(x32, op="max"); return [x64, x32]
    if case == "iall_reduce":
        h = group.iall_reduce(x64); h.wait(); return [x64]
    if case == "reduce_scatter":
        out = np.zeros(len(x64) // size); group.reduce_scatter(x64, out); return [out]
    if case == "ireduce_scatter":
        out = np.zeros(len(x32) // size, np.float32); h = group.ireduce_scatter(x32, out); h.wait(); return [out]
    if case == "all_gather":
        out = np.zeros(len(x64) * size); group.all_gather(x64, out); return [out]
    if case == "iall_gather_bf16_wire":
        bf = x32.astype(ml_dtypes.bfloat16); out = np.zeros(len(bf) * size, ml_dtypes.bfloat16)
        h = group.iall_gather(bf.view(np.uint16), out.view(np.uint16)); h.wait(); return [out.astype(np.float64)]
    if case == "broadcast":
        group.broadcast(x64, root=size - 1); h = group.ibroadcast(x32, root=1); h.wait(); return [x64, x32]
    if case == "all_to_all":
        out = np.zeros_like(x64); group.all_to_all(x64, out); return [out]
    if case == "all_to_allv":
        counts = [(rank + peer) % 3 for peer in range(size)]
        recv_counts = [(peer + rank) % 3 for peer in range(size)]
        out = np.full(len(x64), -1.0); group.all_to_allv(x64, counts, out, recv_counts); return [out]
    if case.startswith("ring"):  # each rank sends to the next and receives from the previous, both lanes + MPI tag 5
        tag = int(case[-1])
        out = np.zeros_like(x64)
        h = group.irecv(out, (rank - 1) % size, tag=tag)
        s = group.isend(x64, (rank + 1) % size, tag=tag)
        back = np.zeros_like(x32)
        r2 = group.irecv(back, (rank + 1) % size, tag=tag)
        group.send(x32, (rank - 1) % size, tag=tag)
        h.wait(); s.wait(); r2.wait(); return [out, back]
    raise ValueError(case)

CASE_DATA = {"x64": data(12 * size), "x32": data(6 * size, np.float32)}
cases = ["all_reduce", "iall_reduce", "reduce_scatter", "ireduce_scatter", "all_gather", "iall_gather_bf16_wire",
         "broadcast", "all_to_all", "all_to_allv", "ring0", "ring1", "ring5"]
worst = {}
for case in cases:
    ref = run(groups["mpi"], case)
    for kind in ("nccl", "staged"):
        got = run(groups[kind], case)
        worst[f"{kind} {case}"] = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)),
                                                   initial=0.0)) for a, b in zip(ref, got))
counters = {kind: groups[kind].counters() for kind in groups}

# A wrong element count or offset must not pass: a reduce-scatter one element short leaves a wrong last element;
# a pointer past the buffer's end is refused by the stand-in.
nccl = groups["nccl"]
communicator, stream = nccl._main
x = CASE_DATA["x64"].copy(); out = np.zeros(len(x) // size); expected = np.zeros_like(out)
groups["mpi"].reduce_scatter(x.copy(), expected)
nccl_standin.groupStart()
communicator.reduceScatter(runtime.pointer(x), runtime.pointer(out), len(out) - 1, 8, 0, stream.ptr)
nccl_standin.groupEnd()
stream.synchronize()
short_count_caught = bool(not np.allclose(out, expected))
try:
    communicator.allReduce(runtime.pointer(x) + 8, runtime.pointer(x) + 8, len(x), 8, 0, stream.ptr)
    offset_caught = False
except ValueError as exc:
    offset_caught = "not inside any buffer" in str(exc)

# NCCL's send holds its stream until the peer posts the receive: ranks 0 and 1 each send, then receive, on one
# stream without a group call, which deadlocks on a GPU; the stand-in must stay stuck too (2 s of polling), and the
# same exchange inside groupStart/groupEnd must complete.
stuck = None
pair = world.Split(int(rank >= 2), rank)  # collective over the world: ranks 0 and 1 together
if rank < 2:
    api = nccl_standin.HostNccl(pair)
    comm = api.NcclCommunicator(2, pair.bcast(nccl_standin.get_unique_id() if rank == 0 else None), rank)
    lane, mine, theirs = nccl_standin.HostStream(), np.full(64, float(rank)), np.zeros(64)
    comm.send(runtime.pointer(mine), 64, 8, 1 - rank, lane.ptr)
    comm.recv(runtime.pointer(theirs), 64, 8, 1 - rank, lane.ptr)
    event, deadline = lane.record(), time.monotonic() + 2.0
    while time.monotonic() < deadline and not event.done:
        time.sleep(0.01)
    stuck = not event.done
    pair.Barrier()  # both have looked before either frees anything
    if stuck:  # free it by hand: a raw receive matches the peer's send, then a raw send feeds the queued receive
        comm._comm.Recv(np.zeros(64), source=1 - rank, tag=0)
        comm._comm.Send(mine, dest=1 - rank, tag=0)
        lane.synchronize()
    theirs[:] = 0
    nccl_standin.groupStart()
    comm.send(runtime.pointer(mine), 64, 8, 1 - rank, lane.ptr)
    comm.recv(runtime.pointer(theirs), 64, 8, 1 - rank, lane.ptr)
    nccl_standin.groupEnd()
    lane.synchronize()
    stuck = stuck and bool(theirs[0] == 1 - rank)
world.Barrier()
if rank == 0:
    print("RESULTS " + json.dumps({"worst": worst, "counters": counters, "short_count_caught": short_count_caught,
                                   "offset_caught": offset_caught, "ungrouped_exchange_stuck": stuck}))
"""


def test_every_operation_matches_the_mpi_group_with_the_same_byte_counters():
    results = run_python_mpi_results(3, GROUP_OPERATIONS, timeout=180)
    for case, error in results["worst"].items():
        assert error < 1e-12, f"{case}: differs from the MPI group by {error}"
    assert results["counters"]["nccl"] == results["counters"]["mpi"]
    assert results["counters"]["staged"] == results["counters"]["mpi"]
    assert results["counters"]["mpi"]["all_reduce"] > 0 and results["counters"]["mpi"]["send"] > 0
    assert results["short_count_caught"], "a reduce-scatter one element short went unnoticed"
    assert results["offset_caught"], "a pointer past the buffer's end was not refused"
    assert results["ungrouped_exchange_stuck"], "the stand-in's sends no longer hold their stream like NCCL's"


def test_nccl_needs_a_gpu_or_the_stand_in(monkeypatch):
    monkeypatch.delenv(STANDIN_ENV, raising=False)
    with pytest.raises(ConfigError, match="train.collectives = 'nccl' needs train.device = 'cuda'"):
        make_group_factory("nccl", "cpu")
    with pytest.raises(ConfigError, match="allowed: 'mpi', 'nccl'"):
        make_group_factory("gloo", "cpu")


# ---- float64 training parity through the NCCL groups ------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from mpitrain.data.prepare import prepare_dataset
    path = tmp_path_factory.mktemp("data") / "stdlib.h5"
    prepare_dataset("python-stdlib", path, max_bytes=400_000)
    return path


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, dataset):
    return train_run(1, tmp_path_factory.mktemp("single"), dataset, "train.steps=5")


def nccl_train_run(n_ranks, run_dir, dataset, standin, *overrides):
    """test_train_parity.train_run through the NCCL groups on the stand-in; checks the run says so."""
    settings = [f"data.path={dataset}", "precision.compute=float64", "train.steps=5", "train.collectives=nccl",
                *overrides]
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir)]
    for setting in settings:
        args += ["--set", setting]
    result = run_mpi(n_ranks, args, timeout=240, env={STANDIN_ENV: standin})
    assert result.returncode == 0, describe(result)
    assert "collectives: nccl host stand-in" in result.stdout, describe(result)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return metrics, final_params(run_dir)


@pytest.mark.parametrize("layout, standin", [
    (["parallel.dp=2"], "1"),
    (["parallel.dp=2", "parallel.zero=1"], "1"),
    (["parallel.dp=2", "parallel.zero=2"], "1"),
    (["parallel.dp=2", "parallel.zero=3"], "1"),
    (["parallel.tp=2"], "1"),
    (["parallel.pp=2", "train.micro_batch=1"], "1"),
    (["parallel.cp=2"], "1"),
    (["parallel.dp=2", "parallel.zero=1"], "shared-gpu"),
], ids=["dp2", "zero1-dp2", "zero2-dp2", "zero3-dp2", "tp2", "pp2", "cp2-ring-lanes", "host-staged-zero1-dp2"])
def test_training_through_nccl_groups_matches_one_process(tmp_path, dataset, single_process, layout, standin):
    assert_same_run(single_process, nccl_train_run(2, tmp_path / "run", dataset, standin, *layout))


@pytest.mark.parametrize("zero", [0, 2], ids=["all-reduce", "zero2-reduce-scatter"])
def test_bf16_gradient_reduction_through_nccl_groups_is_the_mpi_run(tmp_path, dataset, zero):
    """precision.grad_reduce = bfloat16: bf16 blocks exchanged all-to-all and summed in fp32 in rank order, through
    the NCCL groups' grouped send/recv the same sums as through MPI's all-to-all: the same run to the bit."""
    settings = ["precision.compute=float32", "precision.grad_reduce=bfloat16", "parallel.dp=2",
                f"parallel.zero={zero}"]
    over_mpi = train_run(2, tmp_path / "mpi", dataset, "train.steps=5", *settings)
    assert_same_run(over_mpi, nccl_train_run(2, tmp_path / "nccl", dataset, "1", *settings))


def test_interleaved_pipeline_through_nccl_lanes_matches_one_process(tmp_path, dataset):
    """Interleaved 1F1B at pp 2: both directions between the two ranks carry activations and gradients (chunk
    boundaries wrap around); with the stand-in's synchronous sends a lane layout that could deadlock on NCCL hangs."""
    deeper = ["model.n_layer=4", "train.micro_batch=1"]
    single = train_run(1, tmp_path / "single", dataset, "train.steps=5", *deeper)
    layout = ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2", *deeper]
    assert_same_run(single, nccl_train_run(2, tmp_path / "run", dataset, "1", *layout))
