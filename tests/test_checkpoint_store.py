"""Checkpoint pieces and the on-disk store, without MPI: resharding arithmetic, commit, verification, cleaning."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from mpitrain.checkpoint.pieces import Piece
from mpitrain.checkpoint.store import Checkpoint, CheckpointError, clean, commit, committed_checkpoints, write_rank_file

SHAPE = (6, 10)


def coordinates(shape):
    """Each element encodes its own global position, so any misplaced element is caught."""
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape) * 1.0 + 0.25


def split_layout(row_parts, col_parts, flat_parts):
    """Pieces of a 2-D tensor as tp would cut it into blocks and ZeRO would cut each block's flattening."""
    full = coordinates(SHAPE)
    pieces = []
    rows = np.array_split(np.arange(SHAPE[0]), row_parts)
    cols = np.array_split(np.arange(SHAPE[1]), col_parts)
    for r, c in itertools.product(rows, cols):
        box_offset, box_shape = (int(r[0]), int(c[0])), (len(r), len(c))
        block = full[r[0]:r[-1] + 1, c[0]:c[-1] + 1].reshape(-1)
        bounds = np.linspace(0, block.size, flat_parts + 1).astype(int)
        for start, end in itertools.pairwise(bounds):
            pieces.append((Piece("param", "w", SHAPE, box_offset, box_shape, (int(start), int(end))),
                           block[start:end].copy()))
    return pieces


def save(tmp_path, pieces, files=3, step=7):
    partial = tmp_path / "step_00000007.partial"
    partial.mkdir(parents=True)
    records = [write_rank_file(partial / f"rank_{i:05d}.h5", pieces[i::files]) for i in range(files)]
    index = {"step": step, "tensors": {"w": {"global_shape": list(SHAPE)}}, "files": records}
    final = tmp_path / "step_00000007"
    commit(partial, final, index)
    return final


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 5, 1), (1, 1, 4), (3, 1, 2), (2, 2, 3), (6, 10, 1), (1, 3, 7)]


@pytest.mark.parametrize("saved_layout, loaded_layout",
                         [(a, b) for a, b in itertools.product(LAYOUTS, LAYOUTS) if a != b][::4])
def test_any_layout_loads_any_other_exactly(tmp_path, saved_layout, loaded_layout):
    checkpoint = Checkpoint.open(save(tmp_path, split_layout(*saved_layout)))
    for piece, expected in split_layout(*loaded_layout):
        box = checkpoint.read_box("param", "w", piece.box_offset, piece.box_shape, np.float64)
        np.testing.assert_array_equal(box.reshape(-1)[piece.flat[0]:piece.flat[1]], expected)


def test_padding_outside_the_tensor_reads_as_zero(tmp_path):
    checkpoint = Checkpoint.open(save(tmp_path, split_layout(2, 1, 1)))
    box = checkpoint.read_box("param", "w", (4, 0), (4, 10), np.float64)  # rows 6, 7: vocabulary padding
    np.testing.assert_array_equal(box[:2], coordinates(SHAPE)[4:])
    assert not box[2:].any()


def test_missing_piece_is_an_error_naming_the_tensor(tmp_path):
    pieces = split_layout(2, 2, 1)[:-1]
    checkpoint = Checkpoint.open(save(tmp_path, pieces))
    with pytest.raises(CheckpointError, match="do not cover all of param w"):
        checkpoint.read_box("param", "w", (0, 0), SHAPE, np.float64)


def test_commit_makes_it_visible_and_latest_points_to_it(tmp_path):
    final = save(tmp_path, split_layout(1, 1, 1))
    assert committed_checkpoints(tmp_path) == [final]
    assert (tmp_path / "latest").read_text().strip() == final.name
    assert not list(tmp_path.glob("*.partial"))
    assert json.loads((final / "index.json").read_text())["step"] == 7


def test_uncommitted_directories_are_ignored_and_cleaned(tmp_path):
    final = save(tmp_path, split_layout(1, 1, 1))
    (tmp_path / "step_00000009.partial").mkdir()
    deleting = tmp_path / "step_00000005.deleting"  # a pruning interrupted half-way: marker still inside
    deleting.mkdir()
    (deleting / "COMMITTED").write_text("step 5\n")
    (tmp_path / "step_00000010").mkdir()  # a step directory without its marker is not a checkpoint either
    assert committed_checkpoints(tmp_path) == [final]
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        Checkpoint.open(tmp_path / "step_00000010")
    removed = clean(tmp_path, keep=3)
    assert {p.name for p in removed} == {"step_00000009.partial", "step_00000010", "step_00000005.deleting"}


def test_clean_keeps_the_newest_committed(tmp_path):
    for step in (1, 2, 3):
        partial = tmp_path / f"step_{step:08d}.partial"
        partial.mkdir()
        commit(partial, tmp_path / f"step_{step:08d}", {"step": step, "files": []})
    clean(tmp_path, keep=2)
    assert [p.name for p in committed_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    clean(tmp_path, keep=0)  # keep = 0 means "no pruning", never "delete everything"
    assert len(committed_checkpoints(tmp_path)) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_damaged_shards_are_detected_naming_the_file(tmp_path, damage):
    final = save(tmp_path, split_layout(2, 2, 2))
    victim = final / "rank_00001.h5"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-100]))
    else:
        victim.unlink()
    with pytest.raises(CheckpointError, match="rank_00001.h5"):
        Checkpoint.open(final).verify_files()
