"""Fault attribution by replay (fault.attribute): compute a bad step again from its starting state and say whose fault
it was.

A bad step's update is skipped (resilience/guard.py), so the parameters it started from are still there, and its data
is a pure function of the step: the replay is the step's forward and backward run again on every rank. Then:
    transient   the replay is good on every rank: the fault did not come back (a cosmic ray, a one-off glitch). The
                replay is the step's result and its update is applied, so the run goes on exactly as if nothing had
                happened (the losses of an uninterrupted run, bitwise).
    genuine     the replay is bad on every rank, with bitwise the same loss and gradient norm everywhere: the data or
                the model makes the step bad, and it stays skipped.
    persistent  the replay is bad on some ranks only, or its results differ between ranks: data-parallel replicas
                hold the same state and, after the gradient's reduction, the same gradient, so they must compute
                bitwise the same norm; a rank that computes another one, again, has bad hardware. Its host goes into
                RUN_DIR/faults.jsonl, which the restart loop excludes (faulty_hosts.py); the step stays skipped.
Every verdict is one line of RUN_DIR/faults.jsonl (step, rank, host, kind, verdict, evidence); only persistent ones
name a host to exclude.

A fault inside one rank's forward is spread to every rank by the sum of the loss: the replay is then bad alike
everywhere. So before a replay is called genuine, each data-parallel replica also computes the next replica's
micro-batches of the step, forward only, from its own parameters (the same), and compares that loss sum with the one
the next replica computed itself: where they differ (one non-finite, or apart by more than rounding), the replica
that computed its own micro-batches otherwise is named persistent. (Not with parallel.cp > 1: a cp rank holds chunks
of the rows. With one replica there is nobody to compare with.) A fault in one rank's backward, spread by the
gradient's reduction, still reads as genuine: telling it apart would take the peer's backward too. fault.attribute
needs parallel.zero = 0: sharded optimizer states reduce the gradient norm over the replicas as well.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mpitrain.resilience.faulty_hosts import record_fault, this_host
from mpitrain.resilience.guard import GOOD, NONFINITE_GRAD, NONFINITE_LOSS, SPIKE, is_spike
from mpitrain.resilience.sdc import UNSIGNED, odd_ones_out

GENUINE, TRANSIENT, PERSISTENT = "genuine", "transient", "persistent"
VERDICTS = (GENUINE, TRANSIENT, PERSISTENT)  # a faults.jsonl record with another (or none) names a faulty host
KIND_OF = {SPIKE: "loss_spike", NONFINITE_GRAD: "nonfinite_grad", NONFINITE_LOSS: "nonfinite_loss"}  # replayed
ROUNDING = 1e-6  # relative: a peer's forward-only loss sum may round otherwise than the training step's


def flip_gradient_exponent(segments) -> None:
    """MPITRAIN_FAULT=gradflip: flip the top exponent bit of this rank's largest gradient element (of magnitude
    below 2, as gradients are): it grows by 2**128 (float32) or 2**1024 (float64), and the squared norm overflows."""
    grads = segments[0].grads
    index = int(np.argmax(np.abs(grads)))
    exponent_top = np.finfo(grads.dtype).bits - 2  # the bit below the sign
    as_int = grads.view(UNSIGNED[grads.itemsize])
    as_int[index:index + 1] ^= as_int.dtype.type(1) << as_int.dtype.type(exponent_top)


def step_is_bad(loss: float, grad_norm: float, good_losses, zscore: float) -> bool:
    """The guard's rule, on one rank's numbers: a non-finite loss or norm, or a loss spike."""
    return not (math.isfinite(loss) and math.isfinite(grad_norm)) or is_spike(loss, good_losses, zscore)


def classify(replays: list[dict]) -> tuple[str, list[int], str]:
    """(verdict, suspect ranks, evidence) from every rank's replay: {"bad": bool, "loss": float, "grad_norm": float},
    indexed by world rank."""
    bad = [rank for rank, replay in enumerate(replays) if replay["bad"]]
    if not bad:
        return TRANSIENT, [], f"the replay was good on every rank ({_numbers(replays[0])})"
    results = [(float(r["loss"]).hex(), float(r["grad_norm"]).hex()) for r in replays]
    if len(bad) == len(replays) and len(set(results)) == 1:
        return GENUINE, [], f"the replay was bad again on every rank, bitwise alike ({_numbers(replays[0])})"
    if len(bad) < len(replays):
        suspects = bad  # its replicas computed a good step from the same state and data
        good = _numbers(replays[next(r for r in range(len(replays)) if r not in bad)])
    else:
        suspects, _ = odd_ones_out(results)  # every rank bad, but not alike: the odd ones out
        good = "the others' results"
    named = "; ".join(f"rank {r}: {_numbers(replays[r])}" for r in suspects)
    return PERSISTENT, suspects, f"the replay was bad again on {named}, where its replicas computed {good}"


def same_loss(a: float, b: float) -> bool:
    """Did a peer's recomputation of a loss sum give what its owner computed (both non-finite, or within rounding)?"""
    if not (math.isfinite(a) and math.isfinite(b)):
        return not (math.isfinite(a) or math.isfinite(b))
    return abs(a - b) <= ROUNDING * max(abs(a), abs(b))


def peer_suspects(checks: list[dict]) -> list[tuple[int, dict]]:
    """(suspect world rank, the check that found it) from every rank's peer check: {"rank", "dp", "place", "peer",
    "differs", ...}; the suspect is the rank at the checked replica's place."""
    at = {(c["dp"], c["place"]): c["rank"] for c in checks}
    return [(at[c["peer"], c["place"]], c) for c in checks if c["differs"]]


def _numbers(replay: dict) -> str:
    return f"loss {replay['loss']:.6g}, grad norm {replay['grad_norm']:.6g}"


class FaultAttribution:
    """Replays bad steps when fault.attribute is on. `mesh`: its world and replicas' (dp) groups; `guard`: the
    BadStepGuard (its loss history judges spikes); `run_dir`: where faults.jsonl goes (None: not recorded)."""

    def __init__(self, enabled: bool, mesh, guard, run_dir: Path | None, say):
        self.enabled, self.mesh, self.world, self.guard, self.say = enabled, mesh, mesh.world, guard, say
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.counts = dict.fromkeys(VERDICTS, 0)

    def wanted(self, verdict: int) -> bool:
        """Is a step with this verdict replayed? (Not a skip the config asked for, nor a float16 overflow.)"""
        return self.enabled and verdict in KIND_OF

    def judge(self, done: int, verdict: int, first: tuple[float, float], replay: tuple[float, float],
              own_loss_sum: float, peer_loss_sum) -> int:
        """Collective: the verdict of step `done` after its replay, the same on every rank: GOOD when the fault was
        transient (the replay's gradients are then the step's), else the first verdict. `first` and `replay` are
        this rank's (loss, grad norm) of the step and of its replay; `own_loss_sum` its replay's loss sum over its
        own micro-batches; `peer_loss_sum(dp_rank)` computes that replica's, forward only (collective over the
        replica's ranks)."""
        history, zscore = self.guard.good_losses, self.guard.cfg.spike_zscore
        mine = {"rank": self.world.rank, "host": this_host(), "first_bad": step_is_bad(*first, history, zscore),
                "bad": step_is_bad(*replay, history, zscore), "loss": replay[0], "grad_norm": replay[1]}
        everyone = self.world.gather_object(mine)
        outcome = self.world.broadcast_object(classify(everyone) if self.world.rank == 0 else None)
        if outcome[0] == GENUINE and self.mesh.dp.size > 1 and self.mesh.cp.size == 1:
            outcome = self._check_peers(own_loss_sum, peer_loss_sum) or outcome
        if self.world.rank == 0:
            self._report(done, verdict, everyone, *outcome)
        self.counts[outcome[0]] += 1
        return GOOD if outcome[0] == TRANSIENT else verdict

    def _check_peers(self, own_loss_sum: float, peer_loss_sum) -> tuple[str, list[int], str] | None:
        """Collective: each replica computes the next one's micro-batches; the persistent verdict when some replica
        computed its own otherwise, else None."""
        dp, mesh = self.mesh.dp, self.mesh
        sums = np.zeros(dp.size, dtype=np.float64)
        dp.all_gather(np.array([own_loss_sum], dtype=np.float64), sums)
        peer = (dp.rank + 1) % dp.size
        recomputed = float(peer_loss_sum(peer))
        check = {"rank": self.world.rank, "dp": dp.rank, "place": (mesh.pp_rank, mesh.tp_rank), "peer": peer,
                 "recomputed": recomputed, "theirs": float(sums[peer]),
                 "differs": not same_loss(recomputed, float(sums[peer]))}
        checks = self.world.gather_object(check)
        outcome = None
        if self.world.rank == 0 and (found := peer_suspects(checks)):
            evidence = "; ".join(f"rank {c['rank']} computed rank {suspect}'s micro-batches to a loss sum of "
                                 f"{c['recomputed']:.6g} where rank {suspect} had {c['theirs']:.6g}"
                                 for suspect, c in found)
            outcome = (PERSISTENT, sorted({suspect for suspect, _ in found}),
                       f"the replay was bad alike on every rank, but {evidence}")
        return self.world.broadcast_object(outcome)

    def _report(self, done: int, verdict: int, everyone: list[dict], name: str, suspects: list[int],
                evidence: str) -> None:
        """Rank 0: one faults.jsonl line per rank named (the suspects, else the ranks whose step was bad) and one
        console line."""
        named = suspects or [m["rank"] for m in everyone if m["first_bad"]] or [0]
        if self.run_dir is not None:
            for rank in named:
                record_fault(self.run_dir, KIND_OF[verdict], everyone[rank]["host"], rank=rank, step=done,
                             verdict=name, evidence=evidence)
        action = {TRANSIENT: "update applied from the replay", GENUINE: "update skipped",
                  PERSISTENT: "update skipped; host recorded to be excluded at the next restart"}[name]
        ranks = ", ".join(f"rank {r} on {everyone[r]['host']}" for r in named)
        self.say(f"step {done}: replayed: {name} fault ({ranks}): {evidence}; {action}")
