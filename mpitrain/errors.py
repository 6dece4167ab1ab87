"""User-facing errors: each is printed as one line that names the problem (key, file, rank), never a traceback."""


class MpitrainError(Exception):
    """Base class for errors the user can fix (bad config, missing file, wrong layout)."""


class ConfigError(MpitrainError):
    """A config key is unknown, has the wrong type or a value outside what is allowed."""


class DataError(MpitrainError):
    """A dataset file is missing, unreadable or does not match the config."""


class LayoutError(MpitrainError):
    """Parallel degrees do not fit the world size or the model (e.g. dp*tp*pp*cp != world size)."""
