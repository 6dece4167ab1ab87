"""`mpitrain doctor hang | parity | precision` (and the hidden `capture` that parity runs on every rank): what went
wrong at scale. cli.py registers the group; each command imports what it runs inside its own function."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from mpitrain.cli_common import CONFIG_ARG, SET_OPTION, user_errors


@click.group()
def doctor():
    """What went wrong at scale: a hang, or a layout that does not match one process."""


@doctor.command("hang")
@click.argument("run_dir", type=click.Path(file_okay=False))
@user_errors
def doctor_hang(run_dir):
    """Read the ranks' flight records (RUN_DIR/flight): per group, the collective reached, who is stuck in it and
    who never entered it, with what each was doing instead."""
    from mpitrain.doctor.hang import diagnose
    click.echo(diagnose(Path(run_dir)))


@doctor.command("parity")
@CONFIG_ARG
@SET_OPTION
@click.option("-n", "n_ranks", type=int, required=True, help="Ranks of the layout (run under mpiexec).")
@click.option("--tol", type=float, default=1e-9, show_default=True, help="Largest relative difference accepted.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Where both runs' records go (default: a new temporary directory).")
@user_errors
def doctor_parity(config, overrides, n_ranks, tol, out_dir):
    """One step of the layout beside a one-process float64 reference on the same batch: forward outputs per layer,
    gradients, then the updated state, each rank's shards against the reference's matching slices. Names the first
    tensor beyond --tol (layer, rank, shard); exit status 0 when every tensor matches, 1 otherwise."""
    from mpitrain.doctor.parity import run_parity
    sys.exit(run_parity(config, list(overrides), n_ranks, tol, out_dir, click.echo))


@doctor.command("precision")
@CONFIG_ARG
@SET_OPTION
@click.option("--steps", type=int, default=3, show_default=True, help="Training steps measured (one process).")
@user_errors
def doctor_precision(config, overrides, steps):
    """An error budget of the configured precision: per layer, the relative error of its output and gradients
    against a float64 replay of that layer on the same inputs, beside the recipe's bound; exit status 1 when a
    layer is over its bound."""
    from mpi4py import MPI

    from mpitrain.doctor.precision import run_precision
    sys.exit(run_precision(config, list(overrides), steps, MPI.COMM_WORLD, click.echo))


@doctor.command("capture", hidden=True)
@CONFIG_ARG
@SET_OPTION
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True)
def doctor_capture(config, overrides, out_dir):
    """What `doctor parity` runs on every rank: one step, everything it computed saved to OUT."""
    from mpi4py import MPI

    from mpitrain.comm.failure import abort_on_error
    from mpitrain.config import load_config
    from mpitrain.doctor.parity import capture
    with abort_on_error(MPI.COMM_WORLD):
        capture(load_config(config, overrides), MPI.COMM_WORLD, Path(out_dir))
