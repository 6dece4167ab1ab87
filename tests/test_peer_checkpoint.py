"""In-memory peer checkpoints (checkpoint/peer.py): the bytes of a copy, who is whose partner, which copies a restart
takes; then runs on 2 fake nodes x 2 ranks (MPITRAIN_PEER_FAKE_NODES) that lose a node after a peer copy and continue
bitwise as the uninterrupted run, from the partners' memory or, when a rank's every copy is gone, from the files."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mpitrain.checkpoint.peer import (
    FAKE_NODES_ENV,
    PEER_DIR_ENV,
    check_copy,
    decode,
    encode,
    load_piece,
    partner_of,
    peer_nodes,
    plan_restore,
)
from mpitrain.checkpoint.pieces import HeldPiece, Piece
from mpitrain.comm.nodes import NodeLayout
from mpitrain.resilience.restart import PEER_RECORD, PendingRestart, SavedPoint, peer_copy_point, resumed_step
from tests.mpi_helpers import describe, run_mpi
from tests.test_restart import run_launch

LAYOUT = {"world_size": 4, "dp": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "zero": 0}
NODE_OF_RANK = (0, 0, 1, 1)


def held_pieces() -> list[HeldPiece]:
    weights = np.arange(12, dtype=np.float64) / 7
    moments = np.arange(6, dtype=np.float32) * 3
    return [HeldPiece(Piece("param", "w", (3, 4), (0, 0), (3, 4), (0, 12)), weights, 0, True),
            HeldPiece(Piece("exp_avg", "b", (6,), (0,), (6,), (2, 6)), moments, 2, False)]


def test_a_copy_is_its_pieces_bitwise_and_a_changed_byte_is_refused():
    held = held_pieces()
    blob = encode([(item.piece.to_dict(), item.view()) for item in held], {"step": 6, "layout": LAYOUT})
    problem, header, pieces = check_copy(blob, held, 6)
    assert problem is None and header["meta"]["layout"] == LAYOUT
    targets = [HeldPiece(item.piece, np.zeros_like(item.array), item.start, item.writer) for item in held]
    for item, (_, raw) in zip(targets, pieces):
        load_piece(item, raw)
    for item, target in zip(held, targets):
        assert target.view().tobytes() == item.view().tobytes()
    broken = bytearray(blob)
    broken[-3] ^= 1
    assert "CRC-32" in check_copy(bytes(broken), held, 6)[0]
    assert "unreadable" in check_copy(blob[:-1], held, 6)[0]
    assert check_copy(blob, held, 7)[0] == "its copy is of step 6, not 7"
    assert check_copy(blob, held[:1], 6)[0] == "its copy holds other pieces than this rank holds now"
    with pytest.raises(ValueError):
        decode(b"not a copy at all")


def test_partners_sit_on_the_next_node():
    two_by_two = NodeLayout.from_leaders(0, [0, 0, 2, 2], ["a", "a", "b", "b"])
    assert [partner_of(rank, two_by_two) for rank in range(4)] == [2, 3, 0, 1]
    three_nodes = NodeLayout.from_leaders(0, [0, 0, 2, 2, 4, 4], ["a", "a", "b", "b", "c", "c"])
    assert [partner_of(rank, three_nodes) for rank in range(6)] == [2, 3, 4, 5, 0, 1]
    uneven = NodeLayout.from_leaders(0, [0, 0, 0, 3], ["a", "a", "a", "b"])  # 3 ranks on a, 1 on b
    assert [partner_of(rank, uneven) for rank in range(4)] == [3, 3, 3, 0]
    assert partner_of(0, NodeLayout.single(4)) is None
    fake = peer_nodes(NodeLayout.single(4, rank=3), {FAKE_NODES_ENV: "2"})
    assert fake.node_of_rank == (0, 0, 1, 1) and fake.node_name == "fakenode1"
    assert peer_nodes(NodeLayout.single(4), {}) == NodeLayout.single(4)


def copy(rank: int, step: int, reporter: int, layout=LAYOUT, folder: str = "own") -> tuple:
    return rank, step, layout, f"node{NODE_OF_RANK[reporter]}/{folder}/{rank}.{step}", reporter


def test_a_restart_takes_the_newest_step_of_which_every_rank_has_a_copy():
    # node 1 lost: node 0 (reported by rank 0) holds its own ranks' copies and the partner copies of ranks 2, 3
    holdings = [copy(0, 6, 0), copy(1, 6, 0), copy(2, 6, 0, folder="peer"), copy(3, 6, 0, folder="peer"),
                copy(0, 3, 0), copy(1, 3, 0)]
    step, plan = plan_restore(holdings, LAYOUT, NODE_OF_RANK, file_step=4)
    assert step == 6
    assert plan == {0: (0, "node0/own/0.6"), 1: (1, "node0/own/1.6"), 2: (0, "node0/peer/2.6"),
                    3: (0, "node0/peer/3.6")}  # ranks 0 and 1 read their own; rank 0 sends 2's and 3's
    assert plan_restore(holdings, LAYOUT, NODE_OF_RANK, file_step=8) == \
        (None, "its newest whole step, 6, is older than the file checkpoint's, 8")
    assert plan_restore(holdings[:2] + holdings[3:], LAYOUT, NODE_OF_RANK, 4) == \
        (None, "no copy of rank(s) 2 of step 6 survives (own or partner)")
    other = {**LAYOUT, "dp": 4, "tp": 1}
    moved = [copy(rank, 6, 0, layout=other) for rank in range(4)]
    assert plan_restore(moved, LAYOUT, NODE_OF_RANK, None) == \
        (None, ("the copies of step 6 were saved under world_size=4 dp=4 tp=1 pp=1 cp=1 ep=1 zero=0, now "
                "world_size=4 dp=2 tp=2 pp=1 cp=1 ep=1 zero=0"))
    assert plan_restore([], LAYOUT, NODE_OF_RANK, None) == (None, "no copies in node memory")


def test_launch_counts_the_time_lost_from_the_peer_copy_only_when_the_restart_took_it(tmp_path):
    (tmp_path / PEER_RECORD).write_text('{"step": 6, "created": 1006.0}')
    assert peer_copy_point(tmp_path) == SavedPoint(6, 1006.0)
    assert peer_copy_point(tmp_path / "elsewhere") is None
    rows = [{"step": 7, "time": 990.0}, {"step": 7, "time": 1012.0, "step_time_s": 1.0}, {"step": 8, "time": 1013.0}]
    assert resumed_step(rows, since=1000.0) == 6 and resumed_step(rows, since=2000.0) is None
    for resumed, saved_step, redone in ((6, 6, 1), (4, 4, 3)):
        pending = PendingRestart(1, 137, 1010.0, 1010.0, SavedPoint(4, 1004.0), 3, SavedPoint(6, 1006.0), 1)
        pending.resumed_at(resumed)
        assert (pending.saved.step, pending.steps_redone) == (saved_step, redone)
        line = pending.line(1011.0)
        assert f"time lost {1011.0 - (1000 + saved_step):.1f} s, from the " in line
        assert (f"from the peer copy in memory of step {saved_step}" in line) == (resumed == 6), line


# ----------------------------------------------------------------------------- 2 fake nodes x 2 ranks
STEPS = 10
SETTINGS = ["data.synthetic=true", "precision.compute=float64", f"train.steps={STEPS}", "checkpoint.every=4",
            "logging.peak_flops=1e9", "train.log_every=1", "parallel.dp=2", "parallel.tp=2"]
PEER = ["checkpoint.peer_every=3"]  # copies after steps 3, 6, 9; files after 4, 8
KILL = "kill:rank=1:step=8"  # after the copy of step 6 and the file of step 4


def train(run_dir: Path, settings: list[str], env: dict, resume: bool = False):
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir)]
    args += ["--resume", "auto"] if resume else []
    return run_mpi(4, args + [arg for setting in settings for arg in ("--set", setting)], timeout=240, env=env)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = train(run_dir, SETTINGS, {})
    assert result.returncode == 0, describe(result)
    return losses(run_dir)


def killed_after_a_peer_copy(tmp_path: Path) -> tuple[Path, dict, Path]:
    """The run killed at the start of step 8; returns its run dir, its env and its folder in (fake) node memory."""
    shm = tmp_path / "shm"
    env = {PEER_DIR_ENV: str(shm), FAKE_NODES_ENV: "2"}
    run_dir = tmp_path / "run"
    result = train(run_dir, SETTINGS + PEER, {**env, "MPITRAIN_FAULT": KILL})
    assert result.returncode != 0, describe(result)
    assert "peer copy: 0.4" in result.stdout and "MB per rank in" in result.stdout, describe(result)
    assert json.loads((run_dir / "checkpoints" / PEER_RECORD).read_text())["step"] == 6
    (root,) = shm.iterdir()
    names = sorted(str(path.relative_to(root)) for path in root.rglob("*.bin"))
    assert names == [f"fakenode0/own/rank_0000{r}.step_00000006.bin" for r in (0, 1)] + \
        [f"fakenode0/peer/rank_0000{r}.step_00000006.bin" for r in (2, 3)] + \
        [f"fakenode1/own/rank_0000{r}.step_00000006.bin" for r in (2, 3)] + \
        [f"fakenode1/peer/rank_0000{r}.step_00000006.bin" for r in (0, 1)], names  # step 3's deleted
    return run_dir, env, root


def test_a_lost_node_is_restored_from_its_partners_memory(tmp_path, reference):
    run_dir, env, root = killed_after_a_peer_copy(tmp_path)
    shutil.rmtree(root / "fakenode1")  # the lost node: ranks 2 and 3's own copies and the copies of 0 and 1 it held
    result = train(run_dir, SETTINGS + PEER, env, resume=True)
    assert result.returncode == 0, describe(result)
    assert "checkpoint: restored step 6 from peer memory in " in result.stdout, describe(result)
    assert "(file checkpoint step_00000004: " in result.stdout, describe(result)
    assert losses(run_dir) == reference  # bitwise, steps 7..10 after the restore included
    assert not root.exists()  # a finished run frees the nodes' memory
    assert not (run_dir / "checkpoints" / PEER_RECORD).exists()


def test_launch_restarts_from_the_peer_copies_and_counts_the_time_lost_from_them(tmp_path, reference):
    run_dir = tmp_path / "run"
    env = {PEER_DIR_ENV: str(tmp_path / "shm"), FAKE_NODES_ENV: "2", "MPITRAIN_FAULT": KILL}
    settings = [arg for setting in SETTINGS + PEER for arg in ("--set", setting)]
    result = run_launch(["-n", "4", "--max-restarts", "1", "configs/tiny.toml", "--out", str(run_dir), *settings],
                        env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, describe(result)
    assert ("restart 1 of 1 from the checkpoint of step 4 or the peer copy of step 6 in memory, if every rank's "
            "survived") in output, output
    assert "checkpoint: restored step 6 from peer memory in " in output, output
    assert "from the peer copy in memory of step 6 at " in output and "1 logged steps redone" in output, output
    assert losses(run_dir) == reference


def test_a_rank_without_any_copy_falls_back_to_the_files(tmp_path, reference):
    run_dir, env, root = killed_after_a_peer_copy(tmp_path)
    shutil.rmtree(root / "fakenode1")
    (root / "fakenode0" / "peer" / "rank_00002.step_00000006.bin").unlink()  # rank 2's partner copy too
    result = train(run_dir, SETTINGS + PEER, env, resume=True)
    assert result.returncode == 0, describe(result)
    assert ("checkpoint: not restoring from peer memory: no copy of rank(s) 2 of step 6 survives (own or partner); "
            "using the file checkpoint step_00000004") in result.stdout, describe(result)
    assert "step_00000004 at step 4" in result.stdout, describe(result)
    assert losses(run_dir) == reference


def test_a_copy_that_cannot_be_written_is_reported_and_training_goes_on(tmp_path):
    blocked = tmp_path / "not_a_directory"
    blocked.write_text("")  # the copies' folder cannot be made under a file
    settings = [s for s in SETTINGS if not s.startswith("train.steps")] + ["train.steps=4", "checkpoint.peer_every=2"]
    result = train(tmp_path / "run", settings, {PEER_DIR_ENV: str(blocked), FAKE_NODES_ENV: "2"})
    assert result.returncode == 0, describe(result)
    assert "peer copy of step 2 failed (rank 0: " in result.stdout, describe(result)
    assert "kept the previous copies; training goes on" in result.stdout, describe(result)
    assert len(losses(tmp_path / "run")) == 4
