"""User-facing errors: each is printed as one line that names the problem (key, file, rank), never a traceback."""
from __future__ import annotations

import os


class MpitrainError(Exception):
    """Base class for errors the user can fix (bad config, missing file, wrong layout)."""


class ConfigError(MpitrainError):
    """A config key is unknown, has the wrong type or a value outside what is allowed."""


class DataError(MpitrainError):
    """A dataset file is missing, unreadable or does not match the config."""


class LayoutError(MpitrainError):
    """Parallel degrees do not fit the world size or the model (e.g. dp*tp*pp*cp != world size)."""


def shown_path(path) -> str:
    """A path as an error names it: a relative one with the directory it was resolved from, since "not found" is
    often "not found from here" ("data/x.h5 (resolved from /home/me/runs)")."""
    text = str(path)
    return text if os.path.isabs(text) else f"{text} (resolved from {os.getcwd()})"
