"""`mpitrain bench step` (time training steps: tokens/s, MFU, the time breakdown) and `mpitrain bench comm`
(collective bandwidth per size and a fitted latency + bandwidth). cli.py registers the group; each command imports
what it runs inside its own function."""
from __future__ import annotations

import json
import os
import statistics

import click

from mpitrain.cli_common import CONFIG_ARG, SET_OPTION, user_errors
from mpitrain.launcher import find_mpiexec, rank_environment


@click.group()
def bench():
    """Benchmarks."""


@bench.command("step")
@CONFIG_ARG
@SET_OPTION
@click.option("--steps", type=int, default=6, show_default=True, help="Timed steps.")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed steps first.")
@click.option("--real-data", is_flag=True, help="Read data.path instead of synthetic tokens.")
def bench_step(config, overrides, steps, warmup, real_data):
    """Time training steps; prints one JSON object last (tokens_per_s, mfu, peak_flops, ...)."""
    from mpi4py import MPI

    from mpitrain.comm.failure import end_job_on_error
    from mpitrain.config import load_config
    from mpitrain.profile.breakdown import RunSummary, gather_summary
    from mpitrain.train import Trainer

    comm = MPI.COMM_WORLD
    with end_job_on_error(comm):  # a user error (config, layout, data): one line from rank 0
        overrides = list(overrides) + ([] if real_data else ["data.synthetic=true"])
        overrides.append(f"train.steps={warmup + steps}")
        cfg = load_config(config, overrides)
        trainer = Trainer(cfg, comm)
        times, tp_seconds, bubbles, breakdown = [], [], [], RunSummary()
        for step in range(warmup + steps):
            trainer.model.tp.reset_timers()
            result = trainer.train_step(step, measure_bubble=step >= warmup)
            if step >= warmup:
                times.append(result.seconds)
                breakdown.add(result.breakdown)
                tp_seconds.append(sum(trainer.model.tp.seconds.values()))
                bubbles.append(result.bubble)
        step_time = statistics.median(times)
        tokens_per_s = trainer.tokens_per_step / step_time
        report = {"config": config, "world_size": comm.Get_size(), "step_time_s": step_time,
                  "tokens_per_s": tokens_per_s,
                  "mfu": trainer.model.flops_per_token() * tokens_per_s / trainer.cluster_peak_flops,
                  "peak_flops": trainer.cluster_peak_flops, "model_flops_per_token": trainer.model.flops_per_token(),
                  "n_params": trainer.model.n_params, "threads": os.environ.get("OMP_NUM_THREADS"),
                  "thread_replicas": trainer.replicas,
                  "tp_comm_share": statistics.median(tp_seconds) / step_time,
                  "pipeline_bubble": statistics.median(bubbles) if None not in bubbles else None,
                  "comm_bytes_per_step": result.comm_bytes}
        report["breakdown"] = gather_summary(trainer.mesh.world, breakdown)  # mean over steps, max over ranks
        if comm.Get_rank() == 0:
            click.echo(json.dumps(report))


@bench.command("comm")
@click.option("-n", "n_ranks", type=int, default=0, help="Start N local ranks through mpiexec (else: this MPI job).")
@click.option("--sizes", default="1K..64M", show_default=True, help="LOW..HIGH (doubling) or a list: 1K,1M,64M.")
@click.option("--ops", default="all_reduce,reduce_scatter,all_gather,all_to_all,sendrecv", show_default=True)
@click.option("--tp", type=int, default=1, show_default=True, help="Also measure the tp and dp groups of this split.")
@click.option("--json", "json_path", default="comm_bench.json", show_default=True, help="Where the fit is written.")
@user_errors
def bench_comm(n_ranks, sizes, ops, tp, json_path):
    """Collective bandwidth per size (nccl-tests' table) and a fitted latency + bandwidth per op and group."""
    from mpitrain.profile import comm_bench
    size_list, op_list = comm_bench.parse_sizes(sizes), comm_bench.parse_ops(ops)
    if n_ranks:  # this command again (without -n) on N local ranks
        comm_bench.relaunch(find_mpiexec(), n_ranks, rank_environment, sizes=sizes, ops=ops, tp=tp, json=json_path)
    comm_bench.run_world(op_list, size_list, tp, json_path, click.echo)
