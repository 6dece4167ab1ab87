"""What the config checks share (no MPI, no arrays): the names some keys take, and the two ways a value is refused,
`require` for any condition and `positive_degree` for a parallel degree or a count of ranks."""
from __future__ import annotations

import difflib

from mpitrain.errors import ConfigError

# parallel.schedule (mpitrain/parallel/schedule.py)
SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev")
OPTIMIZERS = ("adamw", "adafactor", "adam8bit", "sgd")  # optim.name (mpitrain/optim/factory.py)
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")  # optim.schedule (mpitrain/optim/schedule.py)
DECAY_SHAPES = ("linear", "cosine", "sqrt")  # optim.decay_shape: the wsd schedule's decay


def require(cond: bool, message: str) -> None:
    """Refuse unless `cond` holds: written as "refuse unless provably in range", so NaN (every comparison False)
    is refused too."""
    if not cond:
        raise ConfigError(message)


def toml_key(field_name: str) -> str:
    """The TOML key of a field: a trailing underscore only dodges a Python keyword (`async_` is `async`)."""
    return field_name.rstrip("_")


def positive_degree(key: str, value, error: type[Exception] = ConfigError) -> int:
    """A parallel degree (or a number of ranks) is a positive integer; `error` names `key` otherwise. The callers
    differ only in the error they raise (a config key, a layout, a schedule, a command-line flag)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise error(f"{key} must be a positive integer, got {value!r}")
    return value


def did_you_mean(word: str, choices, shown_as: str = "{}") -> str:
    """'did you mean X? ' for the closest of `choices` to a mistyped `word` (X is `shown_as` filled with it, e.g.
    "[{}]" or "train.{}"), or '' when none is close: the hint goes before the list of what is allowed."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean {shown_as.format(close[0])}? " if close else ""
