"""The pipeline bubble measured by the clock, beside schedule_costs' formula and the bubble of the executor's recorded
order, for every schedule kind in one run.

    python benchmarks/bench_pipeline.py [--pp 4] [--steps 4] [--d-model 256] [--micro-batch 2]
                                        [--kinds gpipe:8,1f1b:8,interleaved:8,zb1p:8,zbv:8,dualpipev:8]

Starts itself under `mpiexec -n PP` (1 BLAS thread per rank; MPICH's yield settings when ranks outnumber cores). For
each schedule and micro-batch count m it trains `--steps` steps of a compute-dominated model (4 blocks per rank, 2
per chunk where v = 2, heads of 64, sequences of 64 tokens, a tiny vocabulary so the stages are balanced, float32)
and reports, per step after the first, the idle fraction of the pipeline ranks measured from their recorded
timelines (idle / (ranks x makespan), wall clock). Each kind runs with its own placement (`schedule.placement_of`):
round-robin chunks for gpipe, 1f1b, zb1p and interleaved (v = 2), the V for zbv and dualpipev (v = 2; rank r holds
stages r and 2p-1-r), and the recorded order is replayed with the same placement. Printed side by side: the best and
median measured bubble, `schedule_costs.bubble` (unit costs: F 1, a full backward 2, B = W = 1 where split), the
best measured over the formula, and the recorded order replayed with those unit costs (what tests/test_pipeline.py
and tests/test_dualpipev.py check; it does not depend on the load). Noise (a core busy elsewhere) only adds idle
time, hence the best step. Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from mpitrain.launcher import find_mpiexec, rank_environment
from mpitrain.parallel.schedule import V_KINDS

REPO = Path(__file__).resolve().parent.parent
WORKER_FLAG = "--worker"
DEFAULT_KINDS = "gpipe:8,1f1b:8,interleaved:8,zb1p:8,zbv:8,dualpipev:8"
UNIT_COSTS = {"t_forward": 1.0, "t_backward": 2.0, "t_backward_input": 1.0, "t_backward_weight": 1.0}


def chunks_per_rank(kind: str) -> int:
    """v: 2 for interleaved and the V kinds (their only value), 1 otherwise."""
    return 2 if kind == "interleaved" or kind in V_KINDS else 1


def worker(kinds: list[tuple[str, int]], steps: int, d_model: int, micro_batch: int) -> None:
    """Runs on every rank under mpiexec; rank 0 prints one JSON line per (kind, m)."""
    from mpi4py import MPI

    from mpitrain.config import load_config
    from mpitrain.parallel import schedule_costs
    from mpitrain.parallel.schedule import placement_of
    from mpitrain.parallel.timeline import bubble_fraction, replay
    from mpitrain.train import Trainer

    world = MPI.COMM_WORLD
    p = world.size
    for kind, m in kinds:
        v = chunks_per_rank(kind)
        cfg = load_config(REPO / "configs/tiny.toml", [
            "data.synthetic=true", "logging.peak_flops=1e9", f"model.n_layer={4 * p}", f"model.d_model={d_model}",
            f"model.n_head={max(1, d_model // 64)}", "model.vocab_size=32", "model.seq_len=64",
            f"train.micro_batch={micro_batch}", f"train.global_batch={micro_batch * m}", f"parallel.pp={p}",
            f"parallel.schedule={kind}",
            f"parallel.virtual_stages={v}"])
        trainer = Trainer(cfg, world)
        measured = [trainer.train_step(step, measure_bubble=True).bubble for step in range(steps)]
        events = world.gather(trainer.pipeline.timeline.to_dicts(), root=0)
        if world.rank == 0:
            print("RESULT " + json.dumps({
                "kind": kind, "m": m, "p": p, "v": v, "placement": placement_of(kind),
                "measured": measured[1:],  # the first step warms up
                "formula": float(schedule_costs.bubble(kind, p, m, v)),
                "recorded_order": bubble_fraction(replay(events, p, placement_of(kind), **UNIT_COSTS)),
            }), flush=True)


def print_table(results: list[dict], pp: int, steps: int) -> None:
    cores = os.cpu_count() or 1
    print(f"pp = {pp} on {cores} cores, {steps - 1} measured steps each (the first is a warm-up), load average "
          f"{os.getloadavg()[0]:.2f}" + (" (ranks outnumber cores: measured columns include waiting for a core)"
                                         if pp > cores else ""))
    print(f"{'schedule':<12} {'m':>3} {'v':>2} {'placement':>9} {'measured best':>14} {'median':>8} "
          f"{'formula':>8} {'best/formula':>13} {'recorded order':>15}")
    for r in results:
        best = min(r["measured"])
        print(f"{r['kind']:<12} {r['m']:>3} {r['v']:>2} {r['placement']:>9} {best:>14.4f} "
              f"{statistics.median(r['measured']):>8.4f} {r['formula']:>8.4f} {best / r['formula']:>13.2f} "
              f"{r['recorded_order']:>15.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--kinds", default=DEFAULT_KINDS, help="comma-separated schedule:microbatches")
    args = parser.parse_args()
    threads = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env = rank_environment(args.pp, os.cpu_count() or 1, {
        **os.environ, **threads,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    command = [find_mpiexec(), "-n", str(args.pp), sys.executable, __file__, WORKER_FLAG, args.kinds,
               str(args.steps), str(args.d_model), str(args.micro_batch)]
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{out.stderr}")
    results = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    print_table(results, args.pp, args.steps)
    print(json.dumps({"pp": args.pp, "results": results, "loadavg": os.getloadavg()[0]}))


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == WORKER_FLAG:
        sys.path.insert(0, str(REPO))
        worker([(kind, int(m)) for kind, m in (item.split(":") for item in sys.argv[2].split(","))],
               *map(int, sys.argv[3:]))
    else:
        main()
