"""logging.tensorboard = true (mpitrain/profile/tensorboard_sink.py): the event files hold metrics.jsonl's scalars."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from tests.mpi_helpers import describe, run_mpi

pytest.importorskip("tensorboardX", reason="the TensorBoard sink needs tensorboardX: pip install -e '.[tensorboard]'")


def read_scalars(folder) -> dict:
    """{tag: {step: value}} from TFRecord event files: u64 length, u32 crc, an Event, u32 crc per record."""
    from tensorboardX.proto import event_pb2
    scalars: dict = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_event_files_hold_the_logged_scalars(tmp_path):
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path)]
    for setting in ("data.synthetic=true", "train.steps=3", "logging.tensorboard=true"):
        args += ["--set", setting]
    result = run_mpi(1, args, timeout=300)
    assert result.returncode == 0, describe(result)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scalars = read_scalars(tmp_path / "tensorboard")
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm")):
        assert scalars[tag] == {row["step"]: np.float32(row[key]) for row in metrics}, tag
    assert scalars["val/loss"] == {3: np.float32(metrics[-1]["val_loss"])}

