"""When and what the trainer saves and restores: the glue between the training state and the store.

Saved per rank: parameters (on CPU at float32/float64 they are the master weights) and both Adam moments, as pieces
in global coordinates. Saved once: the step to continue from, the optimizer's step count, the config, the layout and
the tokenizer. Nothing else is needed to continue the same run: the learning rate is a function of the step and the
data of step s is a function of (seed, s) (no dropout or other randomness in a step today).
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mpitrain.backend import to_host
from mpitrain.checkpoint.pieces import HeldPiece, held_pieces
from mpitrain.checkpoint.resume import (
    choose_checkpoint,
    model_mismatch,
    set_aside_newer,
    writable_problem,
)
from mpitrain.checkpoint.store import (
    FORMAT_VERSION,
    Checkpoint,
    CheckpointError,
    CheckpointWriteFailed,
    clean,
    commit,
    committed_checkpoints,
    describe_os_error,
    rank_file_name,
    step_dir_name,
    write_rank_file,
)
from mpitrain.config import Config, to_toml
from mpitrain.errors import ConfigError
from mpitrain.resilience.inject import storage_fault

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "stopped on request after saving; resume me"
STORAGE_FAILED_EXIT_CODE = 74  # EX_IOERR: a save could not be written (disk full, quota, read-only, I/O error)


def storage_failure(rank: int, exc: OSError, path: Path) -> dict:
    """What a rank tells rank 0 of a failed write: the file (the error's, else the one being written) and the error."""
    return {"rank": rank, "path": str(exc.filename or path), "error": describe_os_error(exc)}


class CheckpointManager:
    def __init__(self, directory: Path, keep: int, *, cfg: Config, mesh, state, optimizer, tied_copies=(),
                 tokenizer: dict | None = None, save_extra: Callable[[], dict] = dict,
                 load_extra: Callable[[dict], None] = lambda extra: None, echo=print, faults=None):
        """cfg: the run's config (saved in the index; its model keys checked on restore); mesh, state, optimizer:
        what is saved, by which ranks; tied_copies: tensors a rank holds as a copy of another stage's (read back,
        never written); tokenizer: its description, saved for `generate`; save_extra / load_extra: the rest of the
        training state beside the tensors (e.g. the data offset of bad-step rollbacks, resilience/guard.py);
        faults: the rank's FaultPlan (injected storage failures, resilience/inject.py), or None."""
        self.directory, self.keep, self.echo = Path(directory), keep, echo
        self.cfg, self.mesh, self.state, self.optimizer = cfg, mesh, state, optimizer
        self.tied_copies, self.tokenizer = tied_copies, tokenizer
        self.save_extra, self.load_extra, self.faults = save_extra, load_extra, faults
        self.world = mesh.world
        self._pending = None  # an asynchronous save in flight: (step, partial dir, thread, result holder)
        self.resumed_from: Path | None = None  # the checkpoint restored last: saving its step again is a no-op

    def check_writable(self, key: str = "checkpoint.dir") -> None:
        """Collective, at start-up: every rank writes its own shard, so every rank must be able to create files in
        the directory now, not after the steps before the first save. Raises the same ConfigError on every rank."""
        problem = writable_problem(self.directory)
        gathered = self.world.gather_object((problem, os.uname().nodename))
        verdict = None
        if self.world.rank == 0:
            bad = [f"rank {rank} on {host}: {why}" for rank, (why, host) in enumerate(gathered) if why]
            if bad:
                verdict = f"{key}: cannot write checkpoints to {self.directory} ({'; '.join(bad)})"
        verdict = self.world.broadcast_object(verdict)
        if verdict:
            raise ConfigError(verdict)

    # -- what this rank holds
    def held(self) -> list[HeldPiece]:
        layout, mesh = self.state.checkpoint_layout(), self.mesh
        dp, tp = (mesh.dp_cp.size, mesh.dp_cp.rank), (mesh.tp.size, mesh.tp.rank)  # replicas: dp x cp ranks
        # a tied copy (gpt2's embedding on the last pipeline stage) is read back from the first stage's tensors
        load_only = self.tied_copies
        experts = (mesh.expert_dp.size, mesh.expert_dp.rank)  # model.moe under parallel.ep > 1
        copies = layout.shard_copies  # parallel.zero_shard = 'node': each shard held once per node, written once
        sharded = copies[0] > 1, copies
        held = held_pieces("param", layout.geometry, layout.param_windows,
                           *((True, dp) if layout.params_dp_replicated else sharded), tp, load_only, experts)
        if layout.frozen is not None:  # trainable = False tensors, whole on every rank or sharded (ZeRO-3)
            whole = layout.frozen_windows is None
            windows = [(0, layout.frozen.size, layout.frozen.data, 0)] if whole else layout.frozen_windows
            held += held_pieces("param", layout.frozen, windows, *((True, dp) if whole else sharded), tp, load_only,
                                experts)
        optimizer = self.optimizer
        for kind, moments in optimizer.checkpoint_arrays().items():  # element-wise, e.g. exp_avg, exp_avg_sq
            windows = [(g0, g1, moments, bound[0]) for (g0, g1), bound in zip(layout.segment_windows,
                                                                              optimizer.bounds)]
            held += held_pieces(kind, layout.geometry, windows,
                                *((True, dp) if layout.moments_dp_replicated else sharded), tp, load_only, experts)
        return held

    def _index(self, step: int, records: list[dict]) -> dict:
        cfg = self.cfg
        tensors = {}
        for record in records:
            for piece in record["pieces"]:
                entry = tensors.setdefault(piece["tensor"], {"global_shape": piece["global_shape"],
                                                             "dtype": piece["dtype"]})
                if piece["kind"] == "param":  # a tensor's dtype is its parameters' (8-bit Adam's codes are uint8)
                    entry["dtype"] = piece["dtype"]
        p = cfg.parallel
        return {"format": FORMAT_VERSION, "step": step, "created": time.time(),
                "save_seconds": time.time() - self.save_started,  # Young/Daly advice (resilience/advice.py)
                "layout": {"world_size": self.world.size, "dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp,
                           "ep": p.ep, "zero": p.zero},
                "config": to_toml(cfg), "tokenizer": self.tokenizer,
                **self._saved_state, "tensors": dict(sorted(tensors.items())), "files": records}

    # -- saving
    def _prepare(self, step: int) -> tuple[Path, Path]:
        """Collective: rank 0 makes `step_X.partial`; every rank learns that it exists (or why it does not).
        The training state beside the tensors is taken now: an asynchronous save commits steps later."""
        self.save_started = time.time()
        self._saved_state = {"train_state": {"next_step": step, "optimizer_steps": self.optimizer.steps_taken},
                             "extra_state": self.save_extra()}  # e.g. the data offset of bad-step rollbacks
        final = self.directory / step_dir_name(step)
        partial = self.directory / (final.name + ".partial")
        failure = None
        if self.world.rank == 0:
            try:
                partial.parent.mkdir(parents=True, exist_ok=True)
                if partial.exists():
                    shutil.rmtree(partial)  # a leftover of an interrupted save of the same step
                partial.mkdir()
            except OSError as exc:
                failure = storage_failure(0, exc, partial)
        # the directory exists before anyone writes into it (a watched collective; the details only on a failure)
        if self.world.all_reduce_scalar(float(failure is not None), op="max"):
            self._fail(step, partial, [self.world.broadcast_object(failure)])
        return partial, final

    def _host_pieces(self) -> list:
        """Copies of the pieces this rank writes, taken now (so training may go on changing the originals)."""
        return [(item.piece, np.array(to_host(item.view()), copy=True)) for item in self.held() if item.writer]

    def _commit(self, step: int, partial: Path, final: Path, record: dict | None, error: dict | None) -> None:
        """Collective: gather every rank's file record (or error) to rank 0, which commits; all learn the outcome."""
        gathered = self.world.gather_object((record, error))
        failures = None
        if self.world.rank == 0:
            failures = [err for _, err in gathered if err]
            if not failures:
                try:
                    self._publish(step, partial, final, [rec for rec, _ in gathered])
                except OSError as exc:
                    failures = [storage_failure(0, exc, partial)]
        failures = self.world.broadcast_object(failures)
        if failures:
            self._fail(step, partial, failures)

    def _publish(self, step: int, partial: Path, final: Path, records: list[dict]) -> None:
        """Rank 0, once every rank's file is written: index, marker, rename, `latest`, retention."""
        # Restoring already set later checkpoints aside; one found now at this step or beyond (another run writing to
        # the same directory) is not this run's past either: the new state wins, the old one is kept aside. Only
        # >= step: the previous save (step - 1 when saving every step) is this run's past, and moving it would leave
        # nothing committed if the job died before this commit.
        set_aside_newer(self.directory, step, None, self.echo)
        if final.exists():
            shutil.rmtree(final)  # a step directory without its marker: the leftover of an interrupted save
        commit(partial, final, self._index(step, records))
        removed = clean(self.directory, self.keep)
        self.echo(f"checkpoint: saved step {step} to {final}" + (f" (removed {len(removed)} older)" if removed else ""))

    def _fail(self, step: int, partial: Path, failures: list[dict]) -> None:
        """Collective, once every rank knows that the save of `step` failed: rank 0 removes the partial directory and
        words the line (the file, the error, the last good checkpoint); every rank raises CheckpointWriteFailed."""
        line = None
        if self.world.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            first = failures[0]
            others = f" (and {len(failures) - 1} other rank(s))" if len(failures) > 1 else ""
            committed = committed_checkpoints(self.directory)
            last = (f"the last good checkpoint is {committed[-1]}; continue with --resume auto once the storage is "
                    f"fixed" if committed else "no checkpoint of this run is committed yet")
            line = (f"checkpoint: saving step {step} failed: rank {first['rank']} could not write {first['path']}: "
                    f"{first['error']}{others}; removed {partial.name}; {last}; exiting with status "
                    f"{STORAGE_FAILED_EXIT_CODE}")
        raise CheckpointWriteFailed(self.world.broadcast_object(line))

    def _write(self, step: int, partial: Path, pieces: list) -> tuple[dict | None, dict | None]:
        """This rank's file of the save: (its index record, None), or (None, why it could not be written)."""
        path = partial / rank_file_name(self.world.rank)
        try:
            return write_rank_file(path, pieces, storage_fault(self.faults, step, path)), None
        except OSError as exc:
            return None, storage_failure(self.world.rank, exc, path)

    def _already_saved(self, step: int) -> bool:
        """Only the checkpoint this run was restored from (resumed at the last step: nothing left to train) holds
        this very state; any other checkpoint of the same step is replaced by the new save."""
        final = self.directory / step_dir_name(step)
        same = self.resumed_from is not None and (final / "COMMITTED").is_file() and \
            final.resolve() == self.resumed_from.resolve()
        same = self.world.broadcast_object(same)
        if same and self.world.rank == 0:
            self.echo(f"checkpoint: step {step} is already saved (the checkpoint this run resumed from)")
        return same

    def save(self, step: int) -> None:
        """Synchronous save of the state after `step` steps (collective). A storage failure on any rank raises
        CheckpointWriteFailed on every rank, after the partial directory is removed."""
        self.wait()
        if self._already_saved(step):
            return
        partial, final = self._prepare(step)
        record, error = self._write(step, partial, self._host_pieces())
        self._commit(step, partial, final, record, error)

    def save_async(self, step: int) -> None:
        """Copy the state to host memory now, write it in a background thread, commit once all ranks are done."""
        self.wait()
        if self._already_saved(step):
            return
        partial, final = self._prepare(step)
        pieces = self._host_pieces()
        injected = storage_fault(self.faults, step, partial / rank_file_name(self.world.rank))  # decided here
        result: dict = {}

        def write():
            path = partial / rank_file_name(self.world.rank)
            try:
                result["record"] = write_rank_file(path, pieces, injected)
            except OSError as exc:
                result["error"] = storage_failure(self.world.rank, exc, path)
            except Exception as exc:  # noqa: BLE001 -- reported to every rank at the next poll
                result["error"] = {"rank": self.world.rank, "path": str(path), "error": f"{type(exc).__name__}: {exc}"}

        thread = threading.Thread(target=write, name=f"checkpoint-writer-{step}", daemon=True)
        thread.start()
        self._pending = (step, partial, final, thread, result)

    def poll(self) -> None:
        """Collective, once per step while an asynchronous save is in flight: commit when every writer is done."""
        if self._pending is None:
            return
        step, partial, final, thread, result = self._pending
        still_writing = self.world.all_reduce_scalar(float(thread.is_alive()), op="max")
        if still_writing:
            return
        self._pending = None
        self._commit(step, partial, final, result.get("record"), result.get("error"))

    def wait(self) -> None:
        """Finish an asynchronous save in flight (collective)."""
        if self._pending is not None:
            self._pending[3].join()
            self.poll()

    # -- restoring
    def find_resume_point(self, spec: str) -> Path | None:
        """Collective. Rank 0 picks and verifies the checkpoint ("auto": the newest whose files verify; None when
        the directory has none; an error when all are broken); every rank gets the same answer (or error).
        Safe mid-run: an asynchronous save in flight is finished first."""
        self.wait()
        answer = None
        if self.world.rank == 0:
            try:
                if spec == "auto":
                    clean(self.directory, keep=0)  # leftovers of interrupted saves only (keep=0 removes no committed)
                chosen = choose_checkpoint(self.directory, spec, self.echo)
                answer = str(chosen) if chosen else None
            except CheckpointError as exc:
                answer = f"error: {exc}"
        answer = self.world.broadcast_object(answer)
        if isinstance(answer, str) and answer.startswith("error:"):
            raise CheckpointError(answer[len("error:"):].strip())
        return Path(answer) if answer else None

    def restore(self, path: Path) -> int:
        """Collective. Load the checkpoint at `path` into every rank's state after checking that it holds this
        model; then set aside this directory's checkpoints beyond its step. Returns the step to continue from."""
        self.wait()
        path = Path(path)
        checkpoint = Checkpoint.open(path)
        mismatch = model_mismatch(checkpoint, self.cfg.model)  # the same verdict on every rank
        if mismatch:
            raise CheckpointError(mismatch)
        held = self.held()
        self._check_tensors(checkpoint, held)
        checkpoint.load_into(held)
        return self.after_load(checkpoint.index, path)

    def after_load(self, saved: dict, kept: Path | None) -> int:
        """Collective, once the tensors are loaded (from files, or from peer memory: checkpoint/peer.py): the state
        beside them from `saved` (an index, or a peer copy's header), then this directory's checkpoints beyond its
        step set aside (`kept`: the checkpoint of that step, if any). Returns the step to continue from."""
        self.state.after_restore()
        self.optimizer.after_restore()  # e.g. 8-bit Adam's block scales from the loaded element-wise ones
        self.optimizer.steps_taken = int(saved["train_state"]["optimizer_steps"])
        step = int(saved["train_state"]["next_step"])
        self.load_extra(saved.get("extra_state", {}))
        self.set_aside_beyond(step, kept=kept)
        self.resumed_from = kept
        return step

    def set_aside_beyond(self, step: int, kept: Path | None = None) -> None:
        """Collective: move this directory's checkpoints beyond `step` (the run continues from there) out of reach of
        resume and retention (see resume.set_aside_newer); `kept`: the checkpoint restored, at `step`."""
        if self.world.rank == 0:
            set_aside_newer(self.directory, step, kept, self.echo)
        self.world.barrier()

    def _check_tensors(self, checkpoint: Checkpoint, held: list[HeldPiece]) -> None:
        """Every tensor a rank needs is in the checkpoint with the same global shape, and every saved tensor is
        needed by some rank (pipeline stages hold different tensors: rank 0 sees them all). Same error everywhere."""
        saved = checkpoint.tensors()
        wrong = sorted({f"{p.tensor} {saved[p.tensor]['global_shape']} there, {list(p.global_shape)} here"
                        for p in (item.piece for item in held)
                        if p.tensor in saved and tuple(saved[p.tensor]["global_shape"]) != p.global_shape})
        needed = {item.piece.tensor for item in held}
        gathered = self.world.gather_object((needed, wrong))
        verdict = None
        if self.world.rank == 0:
            needed = set().union(*(names for names, _ in gathered))
            problems = []
            if needed - saved.keys():
                problems.append(f"missing there: {', '.join(sorted(needed - saved.keys()))}")
            if saved.keys() - needed:
                problems.append(f"unused here: {', '.join(sorted(saved.keys() - needed))}")
            shapes = sorted(set().union(*(set(w) for _, w in gathered)))
            if shapes:
                problems.append(f"other shapes: {'; '.join(shapes)}")
            if problems:
                verdict = f"{checkpoint.path} does not fit this model ({' | '.join(problems)}); check the model.* keys"
        verdict = self.world.broadcast_object(verdict)
        if verdict:
            raise CheckpointError(verdict)
