"""A start's first part, before any communication: every check that needs none (the rank count, the batch splits,
the data and its samplers), the warning of a costly layout, and what removes a run directory again when such a
check refuses the start."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from mpitrain.comm.mesh import validate_degrees
from mpitrain.config import Config, resolve_layout
from mpitrain.data.dataset import TokenDataset, train_and_val_samplers
from mpitrain.data.documents import check_document_boundaries
from mpitrain.data.mix import mix_samplers
from mpitrain.data.synthetic import SyntheticSampler
from mpitrain.errors import ConfigError, DataError, shown_path
from mpitrain.optim.schedule import make_batch_ramp
from mpitrain.profile.wandb_sink import require_wandb
from mpitrain.run.lock import LOCK_NAME


def check_start(cfg: Config, world_size: int) -> tuple:
    """Every check of a start that needs no communication, in the order a user thinks (the rank count first, then
    the batch splits, then the data): (train.batch_rampup's BatchRamp or None, make_samplers(cfg, ramp))."""
    resolve_layout(cfg, world_size)
    p = cfg.parallel
    validate_degrees(world_size, dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp)
    ramp = make_batch_ramp(cfg.train.batch_rampup, cfg.train.global_batch)  # None: one batch size
    require_wandb(cfg.logging.wandb)  # the logging rank's sink: refused on every rank alike
    return ramp, make_samplers(cfg, ramp)


def make_samplers(cfg: Config, ramp=None) -> tuple:
    """(train sampler, validation sampler, tokenizer or None): synthetic tokens, or data.path's token file. ramp:
    train.batch_rampup's BatchRamp, which places each step's rows in the token file (synthetic rows are a pure
    function of (step, row) already)."""
    if cfg.data.synthetic:
        m, t = cfg.model, cfg.train
        return (SyntheticSampler(m.vocab_size, m.seq_len, t.global_batch, t.seed),
                SyntheticSampler(m.vocab_size, m.seq_len, t.global_batch, t.seed + 1), None)
    if cfg.data.mix:
        return make_mix_samplers(cfg, ramp)
    if not Path(cfg.data.path).is_file():
        raise DataError(f"data file {shown_path(cfg.data.path)} not found (config key data.path; create it with: "
                        f"mpitrain data prepare --source python-stdlib --out {cfg.data.path})")
    dataset = TokenDataset(cfg.data.path)
    if dataset.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the vocabulary of "
                          f"{cfg.data.path} ({dataset.vocab_size} tokens)")
    train_data, val_data = train_and_val_samplers(dataset, cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed,
                                                  ramp)
    if cfg.data.document_mask:
        check_document_boundaries(train_data, val_data)
    return train_data, val_data, dataset.tokenizer


def make_mix_samplers(cfg: Config, ramp=None) -> tuple:
    """make_samplers for data.mix: the files blended by weight (data/mix.py), validation on the same blend."""
    train_data, val_data, first = mix_samplers(cfg.data.mix_sources(), cfg.model.seq_len, cfg.train.global_batch,
                                               cfg.train.seed, ramp)
    if first.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the vocabulary of the files of "
                          f"data.mix ({first.vocab_size} tokens)")
    if cfg.data.document_mask:
        check_document_boundaries(train_data, val_data)
    return train_data, val_data, first.tokenizer


def warn_zero3_with_pipeline(pp: int, accumulation: int) -> None:
    print(f"warning: parallel.zero = 3 with parallel.pp = {pp} gathers every stage's parameters again for each of "
          f"the {accumulation} micro-batches' forward and backward; ZeRO-1 or 2 is the usual choice with a pipeline",
          file=sys.stderr, flush=True)


def forget_refused_start(run_dir: Path):
    """Rank 0, before any rank writes: what removes RUN_DIR again when this start is refused (a user error on every
    rank), so a mistake leaves no empty run behind; None when the directory is already there (an earlier run's).
    It removes only a directory that holds no metrics, no committed checkpoint and no run lock (this start's lock is
    released by then: one there is another job's, which started in it meanwhile): nothing trained or training."""
    run_dir = Path(run_dir)
    if run_dir.exists():
        return None
    created = run_dir  # the outermost folder this start will create (runs/ too, the first time)
    while not created.parent.exists() and created.parent != created:
        created = created.parent

    def remove() -> None:
        if run_dir.is_dir() and not (run_dir / "metrics.jsonl").exists() and not (run_dir / LOCK_NAME).exists() \
                and not any(created.rglob("COMMITTED")):
            shutil.rmtree(created, ignore_errors=True)
    return remove
