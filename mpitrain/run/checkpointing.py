"""Checkpointing in a run: where it starts (a checkpoint to resume, or fresh with train.init_from's weights), the
cadence of saves (synchronous or asynchronous), the save before stopping on request, the final save and the sample
from it."""
from __future__ import annotations

import os
import time
from contextlib import nullcontext
from pathlib import Path

from mpitrain.checkpoint.manager import PREEMPTED_EXIT_CODE, CheckpointManager
from mpitrain.checkpoint.peer import PeerCheckpoints
from mpitrain.checkpoint.resume import review_changes
from mpitrain.checkpoint.store import Checkpoint, step_dir_name
from mpitrain.checkpoint.weights import load_weights
from mpitrain.config import Config
from mpitrain.generate import load_checkpoint_model, sample
from mpitrain.resilience.restart import restart_banner


class Checkpointing:
    """The run's side of the CheckpointManager (collective methods, called by every rank in the same order).
    `breakdown`: the step breakdown, charged the time saves stall the next step; `logger`: this rank logs."""

    def __init__(self, manager: CheckpointManager, cfg: Config, breakdown, say, logger: bool):
        self.manager, self.cfg, self.breakdown, self.say, self.logger = manager, cfg, breakdown, say, logger
        c = cfg.checkpoint
        manager.check_writable("checkpoint.dir" if c.dir else "checkpoint.dir (default RUN_DIR/checkpoints)")
        # checkpoint.peer_every: the memory tier, copies in node memory (checkpoint/peer.py)
        self.peer = PeerCheckpoints(manager, c.peer_every, say) if c.peer_every else None

    @property
    def directory(self) -> Path:
        return self.manager.directory

    def start(self, resume: str | None, layout: str, allowed_changes=()) -> int:
        """The step this run starts from: a checkpoint's when `resume` finds one (its later ones set aside), else 0
        (with train.init_from's weights, and this directory's checkpoints set aside: they are not this run's past).
        `layout`: this run's, for the banner of a restart; allowed_changes: the --allow-changes keys (a change of
        the config since the checkpoint that alters the run's meaning is refused unless named there)."""
        started = time.perf_counter()
        path = self.manager.find_resume_point(resume) if resume else None
        if self.peer is not None and resume == "auto":  # the memory tier first: it may be newer than the files
            restored = self._start_from_peer_memory(path, time.perf_counter() - started, allowed_changes)
            if restored is not None:
                return restored
        start = self._start_from_files(path, resume, layout, allowed_changes)
        if self.peer is not None:
            self.peer.settle(start)
        return start

    def _start_from_peer_memory(self, path: Path | None, finding_s: float, allowed_changes) -> int | None:
        """The step restored from the copies in node memory, with the time it took against the file checkpoint's
        (`path`, found in `finding_s` seconds, then loaded into scratch buffers to time it), or None."""
        restored = self.peer.restore(path, allowed_changes)
        if restored is None:
            return None
        step, seconds = restored
        if path is None:
            files = "no file checkpoint to compare"
        else:
            file_s = finding_s + self.peer.time_file_load(path)
            files = f"file checkpoint {path.name}: {file_s:.3f} s, measured now by verifying and loading it too"
        self.say(f"checkpoint: restored step {step} from peer memory in {seconds:.3f} s ({files})")
        self.peer.settle(step)
        return step

    def _start_from_files(self, path: Path | None, resume: str | None, layout: str, allowed_changes) -> int:
        manager, say = self.manager, self.say
        if path is None:
            if resume:
                say("checkpoint: none to resume from; starting fresh")
            manager.set_aside_beyond(0)
            if self.cfg.train.init_from:  # fine-tuning: another run's weights, this run's optimizer and schedule
                say(f"checkpoint: weights from {load_weights(manager, self.cfg.train.init_from)} (train.init_from), "
                    f"step 0")
            return 0
        review_changes(Checkpoint.open(path), self.cfg, list(allowed_changes), say)  # the same verdict everywhere
        banner = restart_banner(path, layout, dict(os.environ), time.time())
        if banner:  # an attempt after a failure: what it left out, resumes from, runs on, has lost
            say(banner)
        start = manager.restore(path)  # also sets aside the directory's checkpoints beyond `start`
        say(f"checkpoint: resumed from {path} at step {start}")
        return start

    def rolled_back(self, step: int) -> None:
        """After a bad-step rollback to `step`: the memory copies of later steps are not where the run goes on."""
        if self.peer is not None:
            self.peer.settle(step)

    def poll(self) -> None:
        """Commit an asynchronous save whose writers are done; its stall is carried into the next step's breakdown."""
        with self.breakdown.part("checkpoint") if self.cfg.checkpoint.async_ else nullcontext():
            self.manager.poll()

    def due(self, done: int) -> bool:
        """Whether the state after step `done` is saved (stop_at, the last step, checkpoint.every)."""
        t, every = self.cfg.train, self.cfg.checkpoint.every
        return done in (t.stop_at, t.steps) or bool(every and done % every == 0)

    def save_and_stop(self, done: int, why: str) -> int:
        """Save the state after step `done` and return the exit status that asks for a resume."""
        self.manager.save(done)
        self.say(f"{why}: saved step {done}; exiting with status {PREEMPTED_EXIT_CODE} (continue with --resume auto)")
        return PREEMPTED_EXIT_CODE

    def save_on_cadence(self, done: int) -> None:
        c = self.cfg.checkpoint
        if c.every and done % c.every == 0 and done < self.cfg.train.steps:
            with self.breakdown.part("checkpoint"):
                (self.manager.save_async if c.async_ else self.manager.save)(done)
        if self.peer is not None and done % c.peer_every == 0 and done < self.cfg.train.steps:
            with self.breakdown.part("checkpoint"):
                self.peer.copy(done)

    def finish(self, tokenizer, run_dir: Path) -> None:
        """The final save; then, on the logging rank, a sample from it (a real tokenizer and train.sample_tokens)
        and where it is."""
        t = self.cfg.train
        self.manager.save(t.steps)
        if self.peer is not None:
            self.peer.discard()  # the run is over: its copies would only hold the nodes' memory
        if not self.logger:
            return
        final = self.directory / step_dir_name(t.steps)
        if tokenizer is not None and t.sample_tokens:
            model, state, tokenizer, _ = load_checkpoint_model(final)
            text = sample(model, state, tokenizer, t.sample_prompt, t.sample_tokens, seed=t.seed)
            self.say(f"--- sample ({t.sample_tokens} tokens after {t.sample_prompt!r}) ---\n{text}\n---")
        self.say(f"final checkpoint: {final}  (try: mpitrain generate {run_dir})")
