"""The pipeline bubble measured by the clock, beside the formula and the bubble of the executor's recorded order.

    python benchmarks/bench_pipeline.py [--pp 2] [--steps 8] [--kinds 1f1b:2,1f1b:4,1f1b:8,gpipe:4,zb1p:4,interleaved:4]

Starts itself under `mpiexec -n PP` (1 BLAS thread per rank). For each schedule and micro-batch count m it trains
`--steps` steps of a compute-dominated model (4 blocks of width 384 per stage, a tiny vocabulary so the stages are
balanced, float32) and reports, per step after the first, the idle fraction of the pipeline ranks measured from their
recorded timelines (idle / (ranks x makespan), wall clock). Printed side by side: the best and median measured bubble,
the formula ((p-1)/(m+p-1); interleaved (p-1)/(v m+p-1); zb1p its ZB-H1 value), and the bubble of the recorded event
order replayed with unit costs (what tests/test_pipeline.py checks; it does not depend on the load). Noise (a core
busy elsewhere) only adds idle time, hence the best step. Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from mpitrain.launcher import find_mpiexec

REPO = Path(__file__).resolve().parent.parent
WORKER_FLAG = "--worker"


def worker(kinds: list[tuple[str, int]], steps: int) -> None:
    """Runs on every rank under mpiexec; rank 0 prints one JSON line per (kind, m)."""
    from mpi4py import MPI

    from mpitrain.config import load_config
    from mpitrain.parallel.schedule import theoretical_bubble
    from mpitrain.parallel.timeline import bubble_fraction, replay
    from mpitrain.train import Trainer

    world = MPI.COMM_WORLD
    p = world.size
    for kind, m in kinds:
        v = 2 if kind == "interleaved" else 1
        cfg = load_config(REPO / "configs/tiny.toml", [
            "data.synthetic=true", "logging.peak_flops=1e9", f"model.n_layer={4 * p}", "model.d_model=384",
            "model.n_head=6", "model.vocab_size=32", "model.seq_len=64", "train.micro_batch=4",
            f"train.global_batch={4 * m}", f"parallel.pp={p}", f"parallel.schedule={kind}",
            f"parallel.virtual_stages={v}"])
        trainer = Trainer(cfg, world)
        measured = []
        for step in range(steps):
            measured.append(trainer.train_step(step, measure_bubble=True).bubble)
        events = world.gather(trainer.pipeline.timeline.to_dicts(), root=0)
        if world.rank == 0:
            print("RESULT " + json.dumps({
                "kind": kind, "m": m, "p": p, "v": v, "measured": measured[1:],  # the first step warms up
                "formula": theoretical_bubble(kind, p, m, v),
                "recorded_order": bubble_fraction(replay(events, p)),
            }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kinds", default="1f1b:2,1f1b:4,1f1b:8,gpipe:4,zb1p:4,interleaved:4",
                        help="comma-separated schedule:microbatches")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [find_mpiexec(), "-n", str(args.pp), sys.executable, __file__, WORKER_FLAG, args.kinds, str(args.steps)]
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{out.stderr}")
    results = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    print(f"pp = {args.pp}, {args.steps - 1} measured steps each (the first is a warm-up), load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'schedule':<12} {'m':>3} {'measured best':>14} {'median':>8} {'formula':>8} {'recorded order':>15}")
    for r in results:
        print(f"{r['kind']:<12} {r['m']:>3} {min(r['measured']):>14.4f} {statistics.median(r['measured']):>8.4f} "
              f"{r['formula']:>8.4f} {r['recorded_order']:>15.4f}")
    print(json.dumps({"pp": args.pp, "results": results, "loadavg": os.getloadavg()[0]}))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == WORKER_FLAG:
        sys.path.insert(0, str(REPO))
        worker([(kind, int(m)) for kind, m in (item.split(":") for item in sys.argv[2].split(","))], int(sys.argv[3]))
    else:
        main()
