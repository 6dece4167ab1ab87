"""`mpitrain lab list` and `mpitrain lab NAME [--quick] [--png FILE]` (a one-line hook in cli.py adds it)."""
from __future__ import annotations

from pathlib import Path

import click

from mpitrain.errors import MpitrainError
from mpitrain.lab import LABS
from mpitrain.lab.runner import run_lab


@click.command("lab")
@click.argument("name")
@click.option("--quick", is_flag=True, help="A smaller model and fewer ranks/points (under a minute on 2 cores).")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None, help="Write the lab's plot here.")
def lab_command(name, quick, png_path):
    """Reproduce a textbook claim about parallel training on this machine: NAME is a lab, or `list`."""
    if name == "list":
        for lab in LABS.values():
            click.echo(f"{lab.NAME:10s} {lab.TITLE}")
        return
    if name not in LABS:
        raise click.ClickException(f"no lab '{name}'; labs: {', '.join(LABS)} (mpitrain lab list)")
    if png_path and not Path(png_path).resolve().parent.is_dir():
        raise click.ClickException(f"--png {png_path}: folder {Path(png_path).resolve().parent} does not exist")
    try:
        report, rows = run_lab(LABS[name], quick, Path(png_path) if png_path else None)
    except MpitrainError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(report)
    if png_path:
        click.echo(f"\nplot: {png_path}")
    if not all(row.holds for row in rows):
        raise click.ClickException("a measured quantity differs from its formula (rows marked FAILS)")
