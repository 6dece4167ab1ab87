"""mpitrain.comm: mesh layout as pure functions; every collective and its byte counter on 4 ranks; abort on error."""

from fractions import Fraction

import pytest

from mpitrain.comm import (
    GROUP_KINDS,
    Degrees,
    abort_on_error,
    group_members,
    merge_counters,
    mesh_coordinates,
    pipeline_neighbours,
    ring_bytes,
    validate_degrees,
)
from mpitrain.comm.failure import format_failure
from mpitrain.comm.mesh import expert_coordinates
from mpitrain.errors import LayoutError

try:
    from mpi_helpers import describe, run_python_mpi
except ImportError:  # tests/ imported as a package
    from tests.mpi_helpers import describe, run_python_mpi


# ---- mesh layout, no MPI ---------------------------------------------------------------------------------------------
LAYOUTS = [
    Degrees(),
    Degrees(dp=4),
    Degrees(dp=2, tp=2),
    Degrees(dp=2, tp=2, pp=2),
    Degrees(dp=4, tp=2, ep=2),
    Degrees(dp=2, cp=2, tp=2),
    Degrees(dp=3, tp=2, pp=2, cp=2, ep=3),
]


@pytest.mark.parametrize("degrees", LAYOUTS, ids=str)
def test_groups_partition_the_world_with_the_right_sizes(degrees):
    expected_size = {
        "world": degrees.world_size, "dp": degrees.dp, "tp": degrees.tp, "pp": degrees.pp, "cp": degrees.cp,
        "ep": degrees.ep, "expert_dp": degrees.expert_dp, "dp_cp": degrees.dp * degrees.cp,
    }
    for kind in GROUP_KINDS:
        groups = {tuple(group_members(kind, rank, degrees)) for rank in range(degrees.world_size)}
        assert sorted(rank for group in groups for rank in group) == list(range(degrees.world_size)), kind
        assert {len(group) for group in groups} == {expected_size[kind]}, kind


@pytest.mark.parametrize("degrees", LAYOUTS, ids=str)
def test_coordinates_follow_pp_dp_cp_tp_order(degrees):
    d = degrees
    for rank in range(d.world_size):
        c = mesh_coordinates(rank, d.dp, d.tp, d.pp, d.cp)
        assert ((c.pp * d.dp + c.dp) * d.cp + c.cp) * d.tp + c.tp == rank
        # A rank's position in each single-axis group is its coordinate on that axis.
        for axis in ("dp", "tp", "pp", "cp"):
            assert group_members(axis, rank, d).index(rank) == getattr(c, axis)
        e = expert_coordinates(rank, d)  # the experts' mesh: ep drawn from dp x cp (here etp = tp)
        assert e.etp == c.tp and e.edp * d.ep + e.ep == c.dp * d.cp + c.cp
        assert group_members("ep", rank, d).index(rank) == e.ep
        assert group_members("expert_dp", rank, d).index(rank) == e.edp


def test_tp_is_innermost_and_contiguous():
    d = Degrees(dp=2, tp=4, pp=2)
    assert group_members("tp", 5, d) == [4, 5, 6, 7]
    assert group_members("dp", 5, d) == [1, 5]
    assert group_members("pp", 5, d) == [5, 13]
    assert mesh_coordinates(13, dp=2, tp=4, pp=2) == (1, 1, 0, 1)  # (pp, dp, cp, tp)


def test_explicit_groups():
    d = Degrees(dp=2, cp=2, tp=2)
    assert group_members("cp", 0, d) == [0, 2]
    assert group_members("dp", 0, d) == [0, 4]
    assert group_members("dp_cp", 0, d) == [0, 2, 4, 6]
    e = Degrees(dp=4, tp=2, ep=2)
    assert group_members("ep", 5, e) == [5, 7]  # dp ranks 2, 3: one block of consecutive dp ranks
    assert group_members("expert_dp", 5, e) == [1, 5]  # dp ranks 0, 2: hold the same experts
    assert pipeline_neighbours(0, Degrees(pp=3)) == (None, 1)
    assert pipeline_neighbours(1, Degrees(pp=3)) == (0, 2)
    assert pipeline_neighbours(5, {"dp": 2, "tp": 2, "pp": 2}) == (1, None)


def test_layout_errors_name_the_degrees():
    with pytest.raises(LayoutError) as info:
        validate_degrees(2, dp=2, tp=2)
    message = str(info.value)
    assert "dp=2 x tp=2 x pp=1 x cp=1 = 4" in message and "2 MPI ranks" in message and "-n 4" in message
    assert "\n" not in message
    with pytest.raises(LayoutError, match=r"parallel\.ep=3 does not divide parallel\.dp=4 x cp=1 x tp/etp=1 = 4.*2, 4"):
        validate_degrees(4, dp=4, ep=3)
    with pytest.raises(LayoutError, match=r"parallel\.tp must be a positive integer, got 0"):
        validate_degrees(4, dp=4, tp=0)
    assert validate_degrees(8, dp=4, tp=2, ep=2) == Degrees(dp=4, tp=2, ep=2)


# ---- counters, no MPI ------------------------------------------------------------------------------------------------
def test_ring_bytes_formulas_are_exact():
    assert ring_bytes("all_reduce", 10, 3) == Fraction(40, 3)
    assert ring_bytes("reduce_scatter", 96, 4) == 72
    assert ring_bytes("all_gather", 96, 4) == 72
    assert ring_bytes("broadcast", 96, 4, is_root=True) == 96 and ring_bytes("broadcast", 96, 4) == 0
    assert ring_bytes("send", 96, 2) == 96 and ring_bytes("control", 8, 2) == 8
    assert ring_bytes("all_reduce", 96, 1) == 0  # a group of one sends nothing
    with pytest.raises(ValueError, match="unknown communication kind"):
        ring_bytes("gossip", 1, 2)


def test_merge_counters_sums_exactly_then_rounds():
    class Counted:
        def __init__(self, all_reduce):
            self.all_reduce = all_reduce

        def counters(self, exact=False):
            return {"all_reduce": self.all_reduce}

    thirds = [Counted(Fraction(40, 3)), Counted(Fraction(40, 3)), Counted(Fraction(40, 3))]
    merged = merge_counters(thirds)
    assert merged["all_reduce"] == 40 and merged["send"] == 0


# ---- failure reporting, no MPI ---------------------------------------------------------------------------------------
class FakeComm:
    def __init__(self, rank, size):
        self.rank, self.size, self.aborted_with = rank, size, None

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Abort(self, code):
        self.aborted_with = code


def test_user_errors_are_one_line_and_others_keep_the_traceback():
    assert format_failure(LayoutError("bad layout"), 1, 4) == "[rank 1/4] ERROR: bad layout"
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        text = format_failure(exc, 2, 4)
    lines = text.split("\n")
    assert lines[0] == "[rank 2/4] ERROR: RuntimeError: boom"
    assert len(lines) > 2 and all(line.startswith("[rank 2/4] ") for line in lines)
    assert any("Traceback" in line for line in lines)


def test_single_process_failure_exits_1_without_abort(capsys):
    comm = FakeComm(0, 1)
    with pytest.raises(SystemExit) as info, abort_on_error(comm):
        raise LayoutError("dp does not fit")
    assert info.value.code == 1 and comm.aborted_with is None
    assert capsys.readouterr().err == "[rank 0/1] ERROR: dp does not fit\n"


def test_multi_process_failure_aborts(capsys):
    comm = FakeComm(3, 4)
    with pytest.raises(SystemExit), abort_on_error(comm):  # a real Abort never returns; the fake one does
        raise ValueError("bad")
    assert comm.aborted_with == 1
    assert capsys.readouterr().err.startswith("[rank 3/4] ERROR: ValueError: bad\n")


# ---- on 4 MPI ranks --------------------------------------------------------------------------------------------------
COLLECTIVES = """
import numpy as np
from mpi4py import MPI
from mpitrain.comm import Group, abort_on_error, progress

def data(rank, count):  # distinct per rank, increasing with rank, exact in float64
    return np.arange(count, dtype=np.float64) * (rank + 1) + rank

with abort_on_error(MPI.COMM_WORLD):
    g = Group(MPI.COMM_WORLD, "world")
    r, n = g.rank, g.size
    assert (n, g.name, g.world_ranks) == (4, "world", [0, 1, 2, 3])
    expected = {kind: 0 for kind in g.bytes_sent}
    total = sum(data(k, 12) for k in range(n))

    def check_counters(**added_bytes):
        for kind, nbytes in added_bytes.items():
            expected[kind] += nbytes
        assert g.bytes_sent == expected, (added_bytes, g.bytes_sent, expected)

    # blocking collectives; counters after each: 2(N-1)/N*B, (N-1)/N*B, ... with B in bytes
    buf = data(r, 12)
    g.all_reduce(buf)
    assert np.array_equal(buf, total)
    check_counters(all_reduce=2 * 3 * 96 // 4)
    buf = data(r, 12)
    g.all_reduce(buf, op="max")
    assert np.array_equal(buf, data(3, 12))
    check_counters(all_reduce=144)

    assert g.all_reduce_scalar(r + 1) == 10.0 and g.all_reduce_scalar(r + 1, "max") == 4.0
    check_counters(control=16)

    recv = np.empty(3)
    g.reduce_scatter(data(r, 12), recv)
    assert np.array_equal(recv, total[3 * r:3 * r + 3])
    check_counters(reduce_scatter=3 * 96 // 4)

    gathered = np.empty((4, 3))
    g.all_gather(data(r, 3), gathered)
    assert np.array_equal(gathered, np.stack([data(k, 3) for k in range(n)]))
    check_counters(all_gather=3 * 96 // 4)

    buf = data(r, 5)
    g.broadcast(buf, root=2)
    assert np.array_equal(buf, data(2, 5))
    check_counters(broadcast=40 if r == 2 else 0)

    partner = r ^ 1  # pairs (0, 1), (2, 3): even ranks send first so blocking calls cannot deadlock
    got = np.empty(6)
    if r % 2 == 0:
        g.send(data(r, 6), partner, tag=7)
        g.recv(got, partner, tag=7)
    else:
        g.recv(got, partner, tag=7)
        g.send(data(r, 6), partner, tag=7)
    assert np.array_equal(got, data(partner, 6))
    check_counters(send=48)

    recv = np.empty(8)
    g.all_to_all(data(r, 8), recv)
    assert np.array_equal(recv, np.concatenate([data(k, 8)[2 * r:2 * r + 2] for k in range(n)]))
    check_counters(all_to_all=3 * 64 // 4)

    send = np.concatenate([np.full(k + 1, 10.0 * r + k) for k in range(n)])  # k+1 elements for rank k
    recv = np.empty(n * (r + 1))
    g.all_to_allv(send, [k + 1 for k in range(n)], recv, [r + 1] * n)
    assert np.array_equal(recv, np.concatenate([np.full(r + 1, 10.0 * k + r) for k in range(n)]))
    check_counters(all_to_all=(10 - (r + 1)) * 8)  # exactly what leaves this rank
    g.barrier()

    # non-blocking: issue all, drive progress, then wait
    reduced, scattered, gathered, bcast = data(r, 12), np.empty(3), np.empty(12), data(r, 4)
    got = np.empty(6)
    handles = [
        g.iall_reduce(reduced), g.ireduce_scatter(data(r, 12), scattered), g.iall_gather(data(r, 3), gathered),
        g.ibroadcast(bcast, root=1), g.irecv(got, (r - 1) % n, tag=3), g.isend(data(r, 6), (r + 1) % n, tag=3),
    ]
    while progress(handles):
        pass
    for h in handles:
        h.wait()
        assert h.test() and h.done
    assert np.array_equal(reduced, total)
    assert np.array_equal(scattered, total[3 * r:3 * r + 3])
    assert np.array_equal(gathered, np.concatenate([data(k, 3) for k in range(n)]))
    assert np.array_equal(bcast, data(1, 4))
    assert np.array_equal(got, data((r - 1) % n, 6))
    check_counters(all_reduce=144, reduce_scatter=72, all_gather=72, broadcast=32 if r == 1 else 0, send=48)

    snapshot = g.counters()
    snapshot["all_reduce"] = -1  # a copy
    assert g.bytes_sent["all_reduce"] == 2 * 144 + 144
    g.reset_counters()
    assert set(g.bytes_sent.values()) == {0}

    # bad buffers are refused before any communication (every rank raises the same error)
    try:
        g.all_reduce(np.zeros((4, 4))[:, 1])
        raise AssertionError("non-contiguous buffer accepted")
    except ValueError as exc:
        assert "C-contiguous" in str(exc)

    class FakeCupyArray:
        __cuda_array_interface__ = {}

    try:
        g.all_reduce(FakeCupyArray())
        raise AssertionError("GPU array accepted")
    except TypeError as exc:
        assert "NCCL" in str(exc)
    try:
        g.reduce_scatter(np.zeros(10), np.zeros(3))
        raise AssertionError("wrong sizes accepted")
    except ValueError as exc:
        assert "reduce_scatter" in str(exc)

    # a group of one: local copies, no traffic
    alone = Group(MPI.COMM_SELF, "self")
    assert (alone.size, alone.world_ranks) == (1, [r])
    buf = data(r, 4)
    alone.all_reduce(buf)
    alone.iall_reduce(buf).wait()
    assert np.array_equal(buf, data(r, 4))
    out = np.empty(4)
    alone.all_gather(data(r, 4), out)
    assert np.array_equal(out, data(r, 4))
    alone.ireduce_scatter(data(r, 4), out).wait()
    assert alone.all_reduce_scalar(2.5) == 2.5
    assert set(alone.bytes_sent.values()) == {0}
    finished = MPI.COMM_WORLD.gather(r, root=0)
    if r == 0:
        print("OK", finished, flush=True)
"""


MESH = """
import numpy as np
from mpi4py import MPI
from mpitrain.comm import Mesh, abort_on_error, merge_counters
from mpitrain.errors import LayoutError

world = MPI.COMM_WORLD
with abort_on_error(world):
    r = world.rank
    try:
        Mesh(world, dp=2)
        raise AssertionError("dp=2 accepted on 4 ranks")
    except LayoutError as exc:
        assert "= 2 do not match the 4 MPI ranks" in str(exc)

    mesh = Mesh(world, dp=2, tp=2)
    members = {group.name: group.world_ranks for group in mesh.all_groups()}
    assert members == {
        "world": [0, 1, 2, 3], "dp": [r % 2, r % 2 + 2], "tp": [r - r % 2, r - r % 2 + 1], "pp": [r], "cp": [r],
        "ep": [r], "expert_dp": [r % 2, r % 2 + 2], "dp_cp": [r % 2, r % 2 + 2],
    }, members
    assert (mesh.dp_rank, mesh.tp_rank, mesh.pp_rank, mesh.cp_rank, mesh.ep_rank) == (r // 2, r % 2, 0, 0, 0)
    assert (mesh.pp_prev, mesh.pp_next) == (None, None)
    assert "dp=2 tp=2" in mesh.describe()

    buf = np.full(6, float(r))
    mesh.tp.all_reduce(buf)
    assert np.array_equal(buf, np.full(6, float(sum(members["tp"]))))
    mesh.dp.all_reduce(buf)
    assert np.array_equal(buf, np.full(6, 6.0))
    assert merge_counters(mesh.all_groups())["all_reduce"] == 48 + 48  # 2(2-1)/2 * 48 bytes, in each group

    pipe = Mesh(world, dp=2, pp=2)  # world rank = pp_rank * 2 + dp_rank
    assert (pipe.pp_prev, pipe.pp_next) == ((None, r + 2) if r < 2 else (r - 2, None))
    assert pipe.pp.world_ranks == [r % 2, r % 2 + 2]

    experts = Mesh(world, dp=4, ep=2)
    assert experts.ep.world_ranks == [r - r % 2, r - r % 2 + 1] and experts.ep_rank == r % 2
    assert experts.expert_dp.world_ranks == [r % 2, r % 2 + 2]
    finished = MPI.COMM_WORLD.gather(r, root=0)
    if r == 0:
        print("OK", finished, flush=True)
"""


FAILURE = """
import numpy as np
from mpi4py import MPI
from mpitrain.comm import Group, abort_on_error

with abort_on_error(MPI.COMM_WORLD):
    g = Group(MPI.COMM_WORLD, "world")
    g.barrier()
    if g.rank == 1:
        raise RuntimeError("deliberate failure on one rank")
    g.all_reduce(np.zeros(4))  # the other ranks wait here forever unless the job is aborted
"""


PROGRESS = """
import numpy as np
from mpi4py import MPI
from mpitrain.comm import Mesh, abort_on_error

with abort_on_error(MPI.COMM_WORLD):
    mesh = Mesh(MPI.COMM_WORLD, dp=2, tp=2)
    r, record = mesh.rank, mesh.progress
    assert all(group.progress is record for group in mesh.all_groups())
    mesh.tp.all_reduce(np.ones(4))
    mesh.tp.iall_reduce(np.ones(4)).wait()
    mesh.dp.all_gather(np.ones(2), np.empty(4))
    mesh.dp.broadcast_object("x")
    mesh.world.barrier()
    mesh.world.gather_object(r)
    right = (r + 1) % 4
    handles = [mesh.world.irecv(np.empty(3), (r - 1) % 4, tag=1), mesh.world.isend(np.ones(3), right, tag=1)]
    for handle in handles:
        handle.wait()
    assert record.waiting is None
    entered = MPI.COMM_WORLD.allgather(record.entered)  # raw mpi4py: enters nothing
    tp, dp = f"tp@{r - r % 2}", f"dp@{r % 2}"
    assert record.entered == {tp: 2, dp: 2, "world@0": 2, f"world@0:{(r - 1) % 4}>{r}": 1, f"world@0:{r}>{right}": 1}
    for other in range(4):  # the n-th operation of a group is the same on every member; a send matches its recv
        for channel, seq in entered[other].items():
            members = [m for m in range(4) if channel in entered[m]]
            assert all(entered[m][channel] == seq for m in members), channel
            assert len(members) == (2 if ">" in channel or not channel.startswith("world") else 4), channel
    if r == 0:
        print("OK", [0, 1, 2, 3], flush=True)
"""


def _assert_all_ok(result):
    assert result.returncode == 0, describe(result)
    assert "OK [0, 1, 2, 3]" in result.stdout, describe(result)


def test_collectives_and_counters_on_4_ranks():
    _assert_all_ok(run_python_mpi(4, COLLECTIVES, timeout=60))


def test_mesh_groups_on_4_ranks():
    _assert_all_ok(run_python_mpi(4, MESH, timeout=60))


def test_exception_on_one_rank_aborts_the_job():
    result = run_python_mpi(4, FAILURE, timeout=60)
    assert result.returncode != 0, describe(result)
    assert "[rank 1/4] ERROR: RuntimeError: deliberate failure on one rank" in result.stderr, describe(result)


def test_every_operation_is_entered_in_the_progress_record_on_4_ranks():
    """The watchdog's view: per-group sequence numbers agree across members, each send counts with its receive."""
    _assert_all_ok(run_python_mpi(4, PROGRESS, timeout=60))
