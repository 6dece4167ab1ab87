"""The flight recorder (mpitrain/comm/flight.py): the ring of a rank's last operations, their sequence numbers and
states, the file it writes, and when it writes it (the watchdog firing, SIGUSR2)."""
from __future__ import annotations

import json
import os
import signal

from mpitrain.comm.flight import FlightRecorder, flight_signals
from mpitrain.comm.operations import Handle, ProgressRecord
from mpitrain.comm.watchdog import Watchdog


class FakeRequest:
    def __init__(self):
        self.finished = False

    def Test(self):
        return self.finished

    def Wait(self):
        self.finished = True


def recorded(tmp_path, capacity=4, rank=3):
    record = ProgressRecord(rank)
    record.flight = FlightRecorder(capacity, tmp_path / "flight", rank, phase=lambda: "backward_input")
    return record


def test_each_operation_is_kept_with_its_group_sequence_and_state(tmp_path):
    record = recorded(tmp_path)
    record.step = 7
    record.wait_for(record.enter("all_reduce", "dp", (1, 3), "dp@1", (1,), 64), lambda: None)
    handle = Handle(FakeRequest(), (), record.enter("iall_gather", "tp", (2, 3), "tp@2", (2,), 32), record)
    second = record.enter("all_reduce", "dp", (1, 3), "dp@1", (1,), 64)  # entered, never waited on
    ops = record.flight.snapshot("test", record)["ops"]
    assert [(op["name"], op["channel"], op["seq"], op["state"]) for op in ops] == [
        ("all_reduce", "dp@1", 1, "completed"), ("iall_gather", "tp@2", 1, "started"),
        ("all_reduce", "dp@1", 2, "started")]
    assert ops[0]["step"] == 7 and ops[0]["nbytes"] == 64 and ops[0]["end"] >= ops[0]["start"]
    handle.wait()
    record.completed(second)
    assert [op["state"] for op in record.flight.snapshot("test", record)["ops"]] == ["completed"] * 3


def test_the_ring_keeps_the_last_n_and_forgets_evicted_open_operations(tmp_path):
    record = recorded(tmp_path, capacity=4)
    operations = [record.enter("isend", "pp", (0, 3), "pp@0:3>0", (0,), 8) for _ in range(100)]
    ops = record.flight.snapshot("test", record)["ops"]
    assert [op["seq"] for op in ops] == [97, 98, 99, 100]
    assert len(record.flight._open) <= 2 * 4  # those evicted, never completed, are not held forever
    record.completed(operations[0])  # long gone from the ring: nothing to stamp, no error
    record.completed(operations[-1])
    assert [op["state"] for op in record.flight.snapshot("test", record)["ops"]] == ["started"] * 3 + ["completed"]
    assert record.flight.snapshot("test", record)["entered"] == {"pp@0:3>0": 100}


def test_the_file_says_what_the_rank_waited_on_and_its_groups(tmp_path):
    record = recorded(tmp_path)
    operation = record.enter("all_reduce", "dp", (1, 3), "dp@1", (1,), 64)
    record.begin_wait(operation)
    path = record.flight.write("hang", record)
    written = json.loads(path.read_text())
    assert path.name == "rank_00003.json" and written["reason"] == "hang"
    assert written["waiting"]["channel"] == "dp@1" and written["waiting"]["seq"] == 1
    assert written["phase"] == "backward_input"
    assert written["channels"] == {"dp@1": {"group": "dp", "members": [1, 3]}}
    assert [op["state"] for op in written["ops"]] == ["started"]


def test_an_unwritable_directory_is_a_warning_not_an_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    record = ProgressRecord(0)
    record.flight = FlightRecorder(4, blocker / "flight", 0)
    assert record.flight.write("hang", record) is None
    assert "flight record not written" in capsys.readouterr().err


def test_the_watchdog_writes_the_record_when_it_fires(tmp_path):
    record = recorded(tmp_path)
    operation = record.enter("all_reduce", "world", (0, 3), "world@0", (0,), 8)
    record.begin_wait(operation)
    aborted = []
    watchdog = Watchdog(record, timeout_s=0.01, abort=aborted.append, world_size=4, interval_s=0.01)
    watchdog.fire(operation, 1.0)
    assert aborted == [124]
    written = json.loads((tmp_path / "flight" / "rank_00003.json").read_text())
    assert written["reason"] == "hang" and written["waiting"]["seq"] == 1


def test_sigusr2_writes_the_record_and_handlers_are_restored(tmp_path):
    record = recorded(tmp_path)
    record.enter("barrier", "world", (0, 3), "world@0", (0,), 0)
    before = signal.getsignal(signal.SIGTERM)
    with flight_signals(record):
        os.kill(os.getpid(), signal.SIGUSR2)  # Python runs the handler at the next bytecode
    assert json.loads((tmp_path / "flight" / "rank_00003.json").read_text())["reason"] == "SIGUSR2"
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_writes_then_runs_the_handler_it_replaced(tmp_path):
    record, seen = recorded(tmp_path), []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with flight_signals(record):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM]
    assert json.loads((tmp_path / "flight" / "rank_00003.json").read_text())["reason"] == "SIGTERM"


def test_off_means_no_recorder_and_no_cost(tmp_path):
    record = ProgressRecord(0)  # fault.flight_ops = 0: train.py sets none
    record.wait_for(record.enter("all_reduce", "dp", (0, 1), "dp@0", (1,), 8), lambda: None)
    with flight_signals(record):
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    assert not (tmp_path / "flight").exists()


def test_an_earlier_starts_record_is_set_aside_so_the_doctor_never_reads_it_as_this_ones(tmp_path):
    earlier = recorded(tmp_path)
    earlier.enter("barrier", "world", (0, 3), "world@0", (0,), 0)
    earlier.flight.write("hang", earlier)
    again = recorded(tmp_path)  # the run started again (a restart, a resume): rank 3 has written nothing yet
    assert not again.flight.path.exists()
    kept = json.loads((tmp_path / "flight" / "earlier" / "rank_00003.json").read_text())
    assert kept["reason"] == "hang" and kept["entered"] == {"world@0": 1}
