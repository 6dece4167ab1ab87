"""One heartbeat writer per node (resilience/heartbeat.py): the node's shared slots, the node file its first rank
writes for all its ranks, reads from the slots (same node) or the file (other nodes), the writer's wait for its
ranks' last records, read_heartbeats over node and per-rank files; then a 3-rank run leaves one file."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mpitrain.resilience.heartbeat import (
    SLOT_BYTES,
    HeartbeatFiles,
    NodeHeartbeats,
    NodeSlots,
    read_heartbeats,
)
from tests.mpi_helpers import describe, run_mpi
from tests.test_watchdog import tiny_settings


def beat(rank: int, number: int, state: str = "running", when: float = 100.0) -> dict:
    return {"rank": rank, "host": f"node{rank // 2}", "pid": 1000 + rank, "time": when + number, "beat": number,
            "state": state, "step": number, "operation": None, "entered": {"world@0": number}}


def test_slots_hold_each_ranks_last_record_and_guard_a_read_against_a_write():
    memory = np.zeros((2, SLOT_BYTES), dtype=np.uint8)  # what the node's ranks map
    first, second = NodeSlots(memory, 0), NodeSlots(memory, 1)
    assert first.get(1) is None  # nothing written yet
    second.put(json.dumps(beat(1, 1)).encode())
    second.put(json.dumps(beat(1, 2)).encode())
    first.put(json.dumps(beat(0, 7)).encode())
    assert second.get(0) == beat(0, 7) and first.get(1) == beat(1, 2)
    memory[1, :8].view(np.uint64)[0] += 1  # rank 1 half-way through a write: no torn record is returned
    assert first.get(1) is None
    with pytest.raises(ValueError, match="does not fit"):
        first.put(b"x" * SLOT_BYTES)


def two_nodes(tmp_path, final_wait_s: float = 0.0) -> dict[int, NodeHeartbeats]:
    """World ranks 0-3, two per node, each node's slots in its own memory."""
    memories = [np.zeros((2, SLOT_BYTES), dtype=np.uint8) for _ in range(2)]
    return {rank: NodeHeartbeats(tmp_path, rank, [0, 0, 1, 1], NodeSlots(memories[rank // 2], rank % 2),
                                 final_wait_s) for rank in range(4)}


def test_the_first_rank_of_a_node_writes_one_file_for_its_ranks_read_by_the_other_nodes(tmp_path):
    ranks = two_nodes(tmp_path)
    ranks[1].write(beat(1, 3))
    ranks[3].write(beat(3, 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # only the nodes' first ranks write files
    ranks[0].write(beat(0, 5))
    ranks[2].write(beat(2, 6))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node_00000.json", "node_00001.json"]
    node = json.loads((tmp_path / "node_00000.json").read_text())
    assert (node["node"], node["writer"], sorted(node["ranks"])) == (0, 0, ["0", "1"])
    assert ranks[2].read(1) == beat(1, 3) and ranks[3].read(0) == beat(0, 5)  # another node: its file
    ranks[1].write(beat(1, 8))
    assert ranks[0].read(1) == beat(1, 8)  # the same node: the slot, fresher than the file
    assert ranks[2].read(1) == beat(1, 3)  # until rank 0 writes the file again
    ranks[0].write(beat(0, 9))
    assert ranks[2].read(1) == beat(1, 8)
    assert {rank: record["beat"] for rank, record in read_heartbeats(tmp_path).items()} == {0: 9, 1: 8, 2: 6, 3: 4}
    assert ranks[0].read(3) == beat(3, 4) and ranks[0].read(2) == beat(2, 6)


def test_a_node_file_rewritten_within_the_same_mtime_is_read_again(tmp_path):
    """Where mtime is coarse (1 s on some NFS), two writes a beat apart can share it: the file's inode tells them
    apart (each write is a new file, renamed over the old one)."""
    ranks = two_nodes(tmp_path)
    path = tmp_path / "node_00000.json"
    ranks[0].write(beat(0, 1))
    os.utime(path, ns=(10**18, 10**18))
    assert ranks[2].read(0) == beat(0, 1)
    ranks[0].write(beat(0, 2))
    os.utime(path, ns=(10**18, 10**18))  # the same mtime as the write before
    assert ranks[2].read(0) == beat(0, 2)


def test_a_finishing_writer_waits_for_its_ranks_last_records_but_not_for_ever(tmp_path):
    ranks = two_nodes(tmp_path, final_wait_s=0.05)
    ranks[1].write(beat(1, 3))
    ranks[0].write(beat(0, 4, "finished"))  # rank 1 still running: written after the (short) wait all the same
    assert read_heartbeats(tmp_path)[1]["state"] == "running"
    ranks[1].write(beat(1, 5, "finished"))
    ranks[0].write(beat(0, 6, "finished"))
    assert {rank: r["state"] for rank, r in read_heartbeats(tmp_path).items()} == {0: "finished", 1: "finished"}


def test_read_heartbeats_keeps_each_ranks_newest_record_from_node_and_rank_files(tmp_path):
    HeartbeatFiles(tmp_path, 1).write(beat(1, 1, when=500.0))  # e.g. a run without a shared window
    HeartbeatFiles(tmp_path, 2).write(beat(2, 1, when=100.0))
    (tmp_path / "node_00000.json").write_text(json.dumps({"node": 0, "ranks": {"1": beat(1, 2), "2": beat(2, 2)}}))
    (tmp_path / "node_00001.json").write_text('{"node": 1, "ran')  # torn by a crash: skipped
    beats = read_heartbeats(tmp_path)
    assert {rank: record["beat"] for rank, record in beats.items()} == {1: 1, 2: 2}


def test_a_three_rank_run_leaves_one_heartbeat_file_for_its_node(tmp_path):
    run_dir = tmp_path / "run"
    result = run_mpi(3, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir),
                         *tiny_settings("train.steps=6", "parallel.dp=3", "train.global_batch=12")], timeout=240)
    assert result.returncode == 0, describe(result)
    assert sorted(p.name for p in (run_dir / "heartbeat").iterdir()) == ["node_00000.json"]
    beats = read_heartbeats(run_dir / "heartbeat")
    assert {rank: (r["state"], r["step"]) for rank, r in beats.items()} == dict.fromkeys(range(3), ("finished", 6))
