"""TensorBoard event files beside metrics.jsonl (`logging.tensorboard = true`): each logged step's scalars in
RUN_DIR/tensorboard/, for the tools people watch runs with. metrics.jsonl stays the record; this is a view of it
(a resumed run writes a new event file, so steps it redoes appear twice there, as after any restart in TensorBoard).
The writer is tensorboardX (extra [tensorboard]): small, no TensorFlow or PyTorch needed."""
from __future__ import annotations

import math
from pathlib import Path

from mpitrain.errors import ConfigError

SCALARS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "bubble": "perf/bubble",
           "loss_scale": "train/loss_scale"}


class TensorBoardSink:
    def __init__(self, directory: Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("config key logging.tensorboard = true needs the 'tensorboardX' package: "
                              "pip install 'mpitrain[tensorboard]'") from None
        self.writer = SummaryWriter(str(directory))

    def write(self, record: dict) -> None:
        """The numeric, finite scalars of one metrics.jsonl record, at its step."""
        for key, tag in SCALARS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()  # a watched run shows each step as it is logged

    def close(self) -> None:
        self.writer.close()


def open_sink(enabled: bool, run_dir: Path) -> TensorBoardSink | None:
    return TensorBoardSink(Path(run_dir) / "tensorboard") if enabled else None
