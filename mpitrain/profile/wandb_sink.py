"""Weights & Biases beside metrics.jsonl (`logging.wandb = true`): each logged step's scalars (loss, lr, grad norm,
tok/s, MFU, the step's global batch, val loss, the time breakdown's parts, bytes per collective kind) at its step,
from the logging rank only, with the resolved config, under `logging.wandb_project`, the run named after the run
directory. metrics.jsonl stays the record; this is a view of it (a resumed run starts a new W&B run, as TensorBoard
starts a new event file).

Without an API key (no WANDB_API_KEY, no `wandb login` entry in the netrc file) and no WANDB_MODE, the run logs
offline into RUN_DIR/wandb/ and says so in one line: a machine without a network or an account still runs, and
`wandb sync` uploads the run later. The package is the extra [wandb]."""
from __future__ import annotations

import importlib.util
import math
import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from mpitrain.errors import ConfigError
from mpitrain.profile.breakdown import max_over_ranks

SCALARS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "global_batch": "train/global_batch", "batch_tokens": "train/batch_tokens",
           "loss_scale": "train/loss_scale", "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
           "hardware_mfu": "perf/hardware_mfu", "step_time_s": "perf/step_time_s", "bubble": "perf/bubble"}


MISSING = "config key logging.wandb = true needs the 'wandb' package: pip install 'mpitrain[wandb]'"


def require_wandb(enabled: bool) -> None:
    """Before any collective, on every rank: refuse logging.wandb without the package (found, not imported: the
    import takes a second, and only the logging rank needs it)."""
    if enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError(MISSING)


def has_credentials(environ=os.environ) -> bool:
    """An API key in the environment, or one that `wandb login` left in the netrc file for the W&B host."""
    if environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_scalars(record: dict) -> dict:
    """The numeric, finite scalars of one metrics.jsonl record under their W&B names; the breakdown's parts as the
    slowest rank's seconds (time/PART), the bytes of each collective kind (comm/KIND_bytes)."""
    scalars = {tag: record[key] for key, tag in SCALARS.items() if key in record}
    if record.get("breakdown"):
        scalars.update({f"time/{part}": seconds for part, seconds in max_over_ranks(record["breakdown"]).items()})
    for kind, nbytes in (record.get("comm_bytes") or {}).items():
        scalars[f"comm/{kind}_bytes"] = nbytes
    return {tag: value for tag, value in scalars.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


class WandbSink:
    def __init__(self, project: str, run_dir: Path, config: dict, say=print):
        try:
            import wandb
        except ImportError:
            raise ConfigError(MISSING) from None
        mode = None  # WANDB_MODE, when set, is wandb's own to read
        if not os.environ.get("WANDB_MODE") and not has_credentials():
            mode = "offline"
            say(f"wandb: no API key (WANDB_API_KEY or `wandb login`): logging offline to {run_dir / 'wandb'}; "
                f"upload later with `wandb sync {run_dir / 'wandb'}/offline-run-*`")
        self.run = wandb.init(project=project, name=Path(run_dir).name, dir=str(run_dir), config=config, mode=mode)

    def write(self, record: dict) -> None:
        self.run.log(wandb_scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_wandb(enabled: bool, project: str, run_dir: Path, config: dict, say=print) -> WandbSink | None:
    return WandbSink(project, Path(run_dir), config, say) if enabled else None
