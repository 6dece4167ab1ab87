"""What the `mpitrain` commands share (cli.py and the command groups of cli_doctor.py and cli_bench.py): the CONFIG
argument, the --set option and the one-line report of a user error."""
from __future__ import annotations

import click

from mpitrain.errors import MpitrainError

CONFIG_ARG = click.argument("config", type=click.Path(dir_okay=False))
SET_OPTION = click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
                          help="Override a config key, e.g. --set train.steps=50 (repeatable).")


def user_errors(fn):
    """Commands that run in one process: a user error is one line on stderr and exit status 1."""
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MpitrainError as exc:
            raise click.ClickException(str(exc)) from None
    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper
