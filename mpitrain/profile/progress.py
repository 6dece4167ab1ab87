"""Progress bars for long work (data prepare on big inputs, checkpoint export), through tqdm.

Shown on an interactive terminal only (tqdm's disable=None), and only for work big enough to wait on, so logs of
batch jobs and tests stay clean."""
from __future__ import annotations

from tqdm import tqdm

BIG_BYTES = 64 * 2**20  # below this, preparing a dataset takes seconds: no bar


def progress(iterable=None, total=None, desc: str = "", unit: str = "it", show: bool = True, **options):
    """tqdm over `iterable` (or a manual bar with .update(n)), to stderr, hidden when not on a terminal."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=None if show else True, leave=False,
                mininterval=0.5, dynamic_ncols=True, **options)
