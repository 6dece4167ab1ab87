"""The latency hook, for tests and benchmarks: it gives the MPI operations of some groups a deterministic transfer
time, e.g. MPITRAIN_COMM_LATENCY="tp=0.02" (seconds; several groups separated by commas): each operation of a tp
group then completes no earlier than 0.02 s after it was started, as on a slow link. A blocking call waits that long;
a non-blocking one is not done (Test) before then, and its wait sleeps what is left, so compute issued in between
hides it (profile/breakdown.py's MPITRAIN_COMM_DELAY instead adds its delay to every wait, hidden or not).
"""
from __future__ import annotations

import os
import time

from mpitrain.errors import ConfigError

LATENCY_ENV = "MPITRAIN_COMM_LATENCY"


def parse_seconds(text: str, env: str, form: str) -> dict[str, float]:
    """'tp=0.02, dp=1' -> {"tp": 0.02, "dp": 1.0}: the test hooks' KEY=SECONDS lists (this one and
    profile/breakdown.py's MPITRAIN_COMM_DELAY); a malformed entry is one line naming `env` and the `form` expected."""
    seconds = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        try:
            seconds[key.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"{env}: {item!r} is not {form}") from None
    return seconds


def latency_of(group_kind: str) -> float:
    """Seconds every operation of a `group_kind` group takes at least, from MPITRAIN_COMM_LATENCY (0: none)."""
    latencies = parse_seconds(os.environ.get(LATENCY_ENV, ""), LATENCY_ENV, "GROUP=SECONDS (e.g. tp=0.02)")
    return latencies.get(group_kind, 0.0)


class LateRequest:
    """An MPI request that completes no earlier than `ready` (time.monotonic()): the latency hook."""

    def __init__(self, request, ready: float):
        self._request, self._ready = request, ready

    def Test(self) -> bool:
        return bool(self._request.Test()) and time.monotonic() >= self._ready

    def Wait(self) -> None:
        time.sleep(max(0.0, self._ready - time.monotonic()))
        self._request.Wait()
