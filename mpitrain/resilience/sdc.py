"""Silent data corruption: compare a hash of what data-parallel replicas must hold identically, every N steps.

A bit flipped in memory or a miscomputing core raises no error; the model just drifts on one rank. Data-parallel
replicas are meant to hold bitwise the same replicated state, so a 64-bit checksum of it is gathered over the
data-parallel group (8 bytes per rank) and compared: the odd one out (majority vote) is named with its host, recorded in
RUN_DIR/faults.jsonl (kind "sdc"; the sbatch restart loop excludes that host) and the job stops. The check also runs
before every checkpoint save, so no checkpoint is ever written from a state that failed it.

What is compared, per parallel.zero:
    0     the full parameters and the Adam moments: every replica keeps and updates its own copy, so a corruption
          stays visible at every later check.
    1, 2  the full parameters, which every replica rebuilds by the all-gather at the end of each step (Adam moments
          are sharded: one copy each, nothing to compare). A corruption is visible only until the next step's
          all-gather, which overwrites it (a non-owned part) or copies it to every replica (the rank's own shard):
          set fault.sdc_every = 1 to cover every step.
    3     nothing: every parameter and moment has exactly one copy at rest; comparing gathered parameters would only
          test the all-gather. The check is off (with a warning).
Replicas are the group each tensor's gradient is reduced over (`ParamSpec.reduce_over`): dense tensors are compared
over dp (dp x cp under context parallelism), experts under expert parallelism over expert_dp, the dp ranks that hold
the same experts. So at parallel.ep = dp, where every expert has one copy, the dense tensors are still compared.
Each pipeline stage and tensor-parallel rank compares with its own peers; the verdict is then shared over the world
so that every rank stops together.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from mpitrain.backend import array_module
from mpitrain.errors import MpitrainError
from mpitrain.resilience.faulty_hosts import FAULTS_FILE, record_fault, this_host
from mpitrain.state.params import intersect


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


def replicated_arrays(state, optimizer) -> dict[str, list]:
    """{reduce_over group name: what every rank of that group holds bitwise the same between steps}, as the state
    declares it for checkpoints (which write a replicated tensor once): the parameter windows when they are
    replicated, the optimizer's state when it is (see the module table), each cut to the tensors of its group."""
    layout = state.checkpoint_layout()
    geometry = layout.geometry
    names = sorted({spec.reduce_over for unit in geometry.layouts for spec in unit.specs})
    if len(names) == 1:  # one group holds everything: the arrays whole (also state that is not element-wise)
        arrays = [window[2] for window in layout.param_windows] if layout.params_dp_replicated else []
        return {names[0]: arrays + (optimizer.state_arrays() if layout.moments_dp_replicated else [])}
    by_name = {}
    for name in names:
        ranges = geometry.ranges(lambda spec, name=name: spec.reduce_over == name)
        arrays = []
        if layout.params_dp_replicated:
            arrays += [array[offset + a:offset + b] for start, end, array, offset in layout.param_windows
                       for a, b in intersect(ranges, start, end)]
        if layout.moments_dp_replicated:
            arrays += [piece for array in elementwise(optimizer, layout.segment_windows)
                       for piece in cut(array, ranges, layout.segment_windows)]
        by_name[name] = arrays
    return by_name


def elementwise(optimizer, segment_windows) -> list:
    """The optimizer's state arrays with one value per parameter (Adam's moments), which can be cut by tensor;
    factored statistics and block scales mix tensors of several groups and are left out."""
    total = sum(end - start for start, end in segment_windows)
    return [array for array in optimizer.state_arrays() if array.ndim == 1 and array.size == total]


def cut(array, ranges, segment_windows) -> list:
    """The pieces of an array over the concatenated segment windows that hold `ranges` (geometry coordinates)."""
    pieces, position = [], 0
    for start, end in segment_windows:
        pieces += [array[position + a:position + b] for a, b in intersect(ranges, start, end)]
        position += end - start
    return pieces


def flip_one_bit(segments) -> None:
    """MPITRAIN_FAULT=flip: flip the top mantissa bit of one parameter this rank updates (its value changes by up to
    a half and stays finite: silent)."""
    params = segments[0].params
    index = params.size // 2
    mantissa_bits = np.finfo(params.dtype).nmant
    as_int = params.view(UNSIGNED[params.itemsize])
    as_int[index:index + 1] ^= as_int.dtype.type(1) << as_int.dtype.type(mantissa_bits - 1)


class ReplicaCheck:
    """The check for one rank: `mesh` gives the replicas' and world groups, `run_dir` where faults.jsonl goes."""

    def __init__(self, every: int, zero: int, mesh, run_dir: Path, say, arrays=dict):
        """arrays: returns {reduce_over group name: the arrays to compare} (replicated_arrays of the trainer's state),
        called at each check."""
        self.every, self.zero, self.mesh, self.run_dir, self.arrays = every, zero, mesh, Path(run_dir), arrays
        names = sorted(arrays()) if every > 0 and zero < 3 else []
        self.replicas = {name: getattr(mesh, name) for name in names if getattr(mesh, name).size > 1}
        self.enabled = bool(self.replicas)
        if every > 0 and not self.enabled:
            why = ("parallel.zero = 3 keeps one copy of every parameter" if zero == 3 else
                   "there is one data-parallel replica")
            say(f"warning: fault.sdc_every = {every} but {why}: nothing to compare, the replica check is off")

    def due(self, done: int, saving: bool) -> bool:
        return self.enabled and (saving or done % self.every == 0)

    def check(self, done: int) -> None:
        """Collective (each replicas' group, then world): raise SilentDataCorruption on every rank on a mismatch."""
        arrays, world = self.arrays(), self.mesh.world
        mismatch, suspect, tie, differs_over = False, False, False, []
        for name, replicas in self.replicas.items():  # sorted names: the same order on every rank of a group
            mine = np.array([digest(arrays[name])], dtype=np.uint64)
            hashes = np.zeros(replicas.size, dtype=np.uint64)
            replicas.all_gather(mine, hashes)
            odd, group_tie = odd_ones_out(hashes.tolist())
            mismatch = mismatch or bool(odd)
            if replicas.rank in odd:
                suspect, tie = True, tie or group_tie
                differs_over.append(name)
        if not world.all_reduce_scalar(float(mismatch), op="max"):
            return
        me = {"rank": world.rank, "host": this_host(), "suspect": suspect, "tie": tie, "groups": differs_over}
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
                         detail=f"hash differs from its replicas' over {' and '.join(s['groups'])}")
        named = ", ".join(f"rank {s['rank']} on {s['host']}" for s in suspects)
        verdict = ("no majority among the replicas, so either may be the corrupted one: " if tie else
                   "differs from the majority of its data-parallel replicas: ")
        return (f"silent data corruption at step {done}: {verdict}{named}; stopped before saving a checkpoint from it "
                f"(recorded in {self.run_dir / FAULTS_FILE}; restart with --resume auto without the named host)")
