"""NCCL communicators end with the process: NcclGroup.close() destroys and abort() aborts every
communicator of a group (its main one and its point-to-point lanes), the watchdog aborts them all before MPI Abort,
and a group still open at exit is destroyed by the exit hook. Run through the host stand-in of cupy.cuda.nccl on 2
ranks, whose communicators record what ended them."""
from __future__ import annotations

import json

from tests.mpi_helpers import describe, run_python_mpi

LIFECYCLE = r"""
import atexit, json, os
import numpy as np
from mpi4py import MPI
from mpitrain.comm import failure, nccl_standin
from mpitrain.comm.nccl import HostRuntime, NcclGroup
from mpitrain.comm.nccl_group import destroy_all_communicators

ended = []  # (group name, how) for every communicator ended


Base = nccl_standin.NcclCommunicator


class Recording(Base):
    def destroy(self):
        ended.append("destroy")
        super().destroy()

    def abort(self):
        ended.append("abort")
        Base.destroy(self)  # the stand-in's abort is its destroy: not recorded twice


nccl_standin.NcclCommunicator = Recording
world = MPI.COMM_WORLD
rank = world.Get_rank()
# registered before any group: atexit runs it after the groups' exit hook
def record_exit():
    with open(os.path.join(os.environ["LIFECYCLE_DIR"], f"exit-{rank}.json"), "w") as out:
        json.dump(ended, out)


atexit.register(record_exit)
runtime = HostRuntime()
hung = NcclGroup(world.Dup(), "dp", runtime=runtime)
lanes = NcclGroup(world.Dup(), "pp", runtime=runtime, p2p_tags=(0,))  # 1 main + 4 lane communicators
left_open = NcclGroup(world.Dup(), "tp", runtime=runtime)
x = np.ones(4)
hung.all_reduce(x)
results = {"summed": x.tolist(), "lane_count": len(lanes.communicators())}
lanes.close()
lanes.close()  # idempotent
results["after_close"] = list(ended)
ended.clear()
world.Barrier()
results["aborted_groups"] = failure.abort_device_communicators()  # hung and left_open
results["after_abort"] = list(ended)
ended.clear()
try:
    hung.all_reduce(x)
    results["refused"] = ""
except RuntimeError as exc:
    results["refused"] = str(exc)
results["nothing_left"] = destroy_all_communicators()
left_open2 = NcclGroup(world.Dup(), "ep", runtime=runtime)  # stays open until the exit hook
world.Barrier()
if rank == 0:
    print("RESULTS " + json.dumps(results), flush=True)
"""


def test_communicators_are_destroyed_at_exit_and_aborted_by_the_watchdog(tmp_path):
    result = run_python_mpi(2, LIFECYCLE, timeout=120, env={"LIFECYCLE_DIR": str(tmp_path)})
    assert result.returncode == 0, describe(result)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    assert len(lines) == 1, describe(result)
    results = json.loads(lines[0][len("RESULTS "):])
    assert results["summed"] == [2.0] * 4
    assert results["lane_count"] == 5
    assert results["after_close"] == ["destroy"] * 5, "close() must destroy the main and every lane, once"
    assert results["aborted_groups"] == 2 and results["after_abort"] == ["abort"] * 2
    assert "dp.all_reduce" in results["refused"] and "closed or aborted" in results["refused"]
    assert results["nothing_left"] == 0
    for rank in (0, 1):  # the group left open was destroyed by the exit hook, before MPI finalised
        assert json.loads((tmp_path / f"exit-{rank}.json").read_text()) == ["destroy"], describe(result)


def test_a_failing_rank_aborts_its_nccl_communicators_before_mpi_abort(monkeypatch):
    """report_and_abort (any exception on a rank) aborts the NCCL groups first, as the watchdog does: a rank blocked
    on its stream in a collective could otherwise outlive MPI Abort."""
    from mpitrain.comm import failure, nccl_group

    events = []

    class World:  # the two calls report_and_abort makes on a 2-rank world, recorded
        def Get_rank(self):
            return 1

        def Get_size(self):
            return 2

        def Abort(self, code):
            events.append(("mpi_abort", code))

    monkeypatch.setattr(failure, "ABORT_GRACE_SECONDS", 0.0)
    monkeypatch.setattr(nccl_group, "abort_all_communicators", lambda: events.append(("nccl_abort",)) or 1)
    try:
        failure.report_and_abort(RuntimeError("boom"), World(), code=3)
    except SystemExit as exc:
        assert exc.code == 3
    assert events == [("nccl_abort",), ("mpi_abort", 3)]
