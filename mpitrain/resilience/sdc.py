"""Silent data corruption: compare a hash of what data-parallel replicas must hold identically, every N steps.

A bit flipped in memory or a miscomputing core raises no error; the model just drifts on one rank. Data-parallel
replicas are meant to hold bitwise the same replicated state, so a 64-bit checksum of it is gathered over the
data-parallel group (8 bytes per rank) and compared: the odd one out (majority vote) is named with its host, recorded in
RUN_DIR/faults.jsonl (kind "sdc"; the sbatch restart loop excludes that host) and the job stops. The check also runs
before every checkpoint save, so no checkpoint is ever written from a state that failed it.

What is compared, per parallel.zero:
    0     the full parameters and both Adam moments: every replica keeps and updates its own copy, so a corruption
          stays visible at every later check.
    1, 2  the full parameters, which every replica rebuilds by the all-gather at the end of each step (Adam moments
          are sharded: one copy each, nothing to compare). A corruption is visible only until the next step's
          all-gather, which overwrites it (a non-owned part) or copies it to every replica (the rank's own shard):
          set fault.sdc_every = 1 to cover every step.
    3     nothing: every parameter and moment has exactly one copy at rest; comparing gathered parameters would only
          test the all-gather. The check is off (with a warning).
Each pipeline stage and tensor-parallel rank compares with its own data-parallel peers; the verdict is then shared
over the world so that every rank stops together. Under expert parallelism (parallel.ep > 1) the peers are the
expert_dp group: the dp ranks that hold the same experts (and, like every dp rank, the same dense tensors).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from mpitrain.backend import array_module
from mpitrain.errors import MpitrainError
from mpitrain.resilience.faulty_hosts import FAULTS_FILE, record_fault, this_host


class SilentDataCorruption(MpitrainError):
    """Data-parallel replicas disagree on state they must hold identically."""


UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def digest(arrays) -> int:
    """A 64-bit checksum of the arrays' bits: each array's elements read as unsigned integers and summed modulo 2**64,
    chained over the arrays. Integer sums are exact in any order, so it is computed where the array lives (a GPU
    reduction, no copy to the host), ~2.7x faster than zlib.crc32 on the CPU; a flipped bit always changes it."""
    value = 0
    for array in arrays:
        xp = array_module(array)
        words = array.reshape(-1).view(UNSIGNED[array.dtype.itemsize])
        value = (value * 1_000_003 + int(xp.sum(words, dtype=xp.uint64))) % 2**64
    return value


def odd_ones_out(hashes: list[int]) -> tuple[list[int], bool]:
    """(indices whose hash differs from the majority, whether the vote was a tie). Without a strict majority (e.g.
    two replicas that disagree) every index is named."""
    counts = Counter(hashes).most_common()
    if len(counts) == 1:
        return [], False
    if counts[0][1] == counts[1][1]:
        return list(range(len(hashes))), True
    majority = counts[0][0]
    return [i for i, h in enumerate(hashes) if h != majority], False


def replicated_arrays(state, optimizer) -> list:
    """What every data-parallel replica holds bitwise the same between steps, as the state declares it for
    checkpoints (which write a replicated tensor once): the parameter windows when they are dp-replicated, the Adam
    moments when they are (see the module table)."""
    layout = state.checkpoint_layout()
    arrays = [window[2] for window in layout["param_windows"]] if layout["params_dp_replicated"] else []
    if layout["moments_dp_replicated"]:
        arrays += optimizer.state_arrays()
    return arrays


def flip_one_bit(segments) -> None:
    """MPITRAIN_FAULT=flip: flip the top mantissa bit of one parameter this rank updates (its value changes by up to
    a half and stays finite: silent)."""
    params = segments[0].params
    index = params.size // 2
    mantissa_bits = np.finfo(params.dtype).nmant
    as_int = params.view(UNSIGNED[params.itemsize])
    as_int[index:index + 1] ^= as_int.dtype.type(1) << as_int.dtype.type(mantissa_bits - 1)


class ReplicaCheck:
    """The check for one rank: `mesh` gives the data-parallel and world groups, `run_dir` where faults.jsonl goes."""

    def __init__(self, every: int, zero: int, mesh, run_dir: Path, say, arrays=list):
        """arrays: returns the arrays to compare (replicated_arrays of the trainer's state), called at each check."""
        self.every, self.zero, self.mesh, self.run_dir, self.arrays = every, zero, mesh, Path(run_dir), arrays
        # Under expert parallelism the ranks of a dp group hold different experts; only the ranks of an expert_dp
        # group (the same experts, and the dense tensors every dp rank holds) are replicas of each other.
        experts_split = mesh.ep.size > 1
        self.replicas = mesh.expert_dp if experts_split else mesh.dp
        self.enabled = every > 0 and self.replicas.size > 1 and zero < 3
        if every > 0 and not self.enabled:
            why = ("parallel.zero = 3 keeps one copy of every parameter" if zero == 3 else
                   "every expert-parallel rank holds its own experts (parallel.ep = dp)" if experts_split else
                   "there is one data-parallel replica")
            say(f"warning: fault.sdc_every = {every} but {why}: nothing to compare, the replica check is off")

    def due(self, done: int, saving: bool) -> bool:
        return self.enabled and (saving or done % self.every == 0)

    def check(self, done: int) -> None:
        """Collective (the replicas' group, then world): raise SilentDataCorruption on every rank on a mismatch."""
        replicas, world = self.replicas, self.mesh.world
        mine = np.array([digest(self.arrays())], dtype=np.uint64)
        hashes = np.zeros(replicas.size, dtype=np.uint64)
        replicas.all_gather(mine, hashes)
        suspects, tie = odd_ones_out(hashes.tolist())
        if not world.all_reduce_scalar(float(bool(suspects)), op="max"):
            return
        me = {"rank": world.rank, "host": this_host(), "replica": replicas.rank, "suspect": replicas.rank in suspects,
              "tie": tie, "hash": int(mine[0])}
        everyone = world.gather_object(me)
        message = None
        if world.rank == 0:
            message = self._report(done, [m for m in everyone if m["suspect"]])
        raise SilentDataCorruption(world.broadcast_object(message))

    def _report(self, done: int, suspects: list[dict]) -> str:
        """Append one "sdc" record per suspect rank to RUN_DIR/faults.jsonl; the line that stops the job."""
        tie = any(s["tie"] for s in suspects)
        for s in suspects:
            record_fault(self.run_dir, "sdc", s["host"], rank=s["rank"], step=done, certain=not s["tie"],
                         detail="parameter hash differs from its data-parallel replicas'")
        named = ", ".join(f"rank {s['rank']} on {s['host']}" for s in suspects)
        verdict = ("no majority among the replicas, so either may be the corrupted one: " if tie else
                   "differs from the majority of its data-parallel replicas: ")
        return (f"silent data corruption at step {done}: {verdict}{named}; stopped before saving a checkpoint from it "
                f"(recorded in {self.run_dir / FAULTS_FILE}; restart with --resume auto without the named host)")
