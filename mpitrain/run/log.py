"""The run log: what the logging rank writes as the run goes (RUN_DIR/config.toml, metrics.jsonl, TensorBoard,
Weights & Biases) and prints (the banner before the first step, one line per logged step)."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

from mpitrain.checkpoint.resume import trim_metrics
from mpitrain.config import Config, to_toml
from mpitrain.profile.tensorboard_sink import open_sink
from mpitrain.profile.wandb_sink import open_wandb


class RunLog:
    """A context manager: entering writes config.toml and opens metrics.jsonl (trimmed to the steps before `start`
    when resuming) and the TensorBoard and W&B sinks; leaving closes them. `echo` None (the ranks that do not log):
    every method does nothing."""

    def __init__(self, cfg: Config, run_dir: Path, start: int, echo=None):
        self.cfg, self.run_dir, self.start, self.echo = cfg, Path(run_dir), start, echo
        self.metrics_file = self.tensorboard = self.wandb = None

    def __enter__(self) -> RunLog:
        if self.echo is None:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_text = to_toml(self.cfg)
        (self.run_dir / "config.toml").write_text(config_text)
        metrics = self.run_dir / "metrics.jsonl"
        if self.start:
            trim_metrics(metrics, self.start)  # the rows of steps after `start` are logged again
        self.metrics_file = open(metrics, "a" if self.start else "w")  # closed in __exit__
        self.tensorboard = open_sink(self.cfg.logging.tensorboard, self.run_dir)  # None when off
        logging = self.cfg.logging  # W&B gets the config as config.toml has it
        self.wandb = open_wandb(logging.wandb, logging.wandb_project, self.run_dir, tomllib.loads(config_text),
                                self.echo)
        return self

    def __exit__(self, *exc) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()

    def banner(self, lines: list[str]) -> None:
        if self.echo is not None:
            for line in lines:
                self.echo(line)

    def write(self, record: dict) -> None:
        """One row of metrics.jsonl (and of TensorBoard and W&B), and its line on the console."""
        if self.echo is None:
            return
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        if self.tensorboard:
            self.tensorboard.write(record)
        if self.wandb:
            self.wandb.write(record)
        self.echo(format_log_line(record, self.cfg.train.steps))


def format_log_line(record: dict, total_steps: int) -> str:
    line = (f"step {record['step']:>5}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
            f"MFU {100 * record['mfu']:.1f}%")
    if "bubble" in record:
        line += f" | bubble {100 * record['bubble']:.1f}%"
    if "val_loss" in record:
        line += f" | val loss {record['val_loss']:.4f}"
    if record.get("expert_load"):  # model.moe: the busiest expert of the worst-balanced block, over uniform
        line += f" | experts {max(load['max_over_uniform'] for load in record['expert_load'].values()):.2f}x"
    if "eta_s" in record:
        minutes, seconds = divmod(round(record["eta_s"]), 60)
        line += f" | ETA {minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
    return line
