"""Progress bars (mpitrain/profile/progress.py): drawn on a terminal, silent in logs and for small work."""
from __future__ import annotations

import io

from mpitrain.profile.progress import progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_bar_on_a_terminal_only():
    shown, logged, small = Terminal(), io.StringIO(), Terminal()
    assert list(progress(range(3), desc="tokenizing", file=shown)) == [0, 1, 2]
    assert list(progress(range(3), desc="tokenizing", file=logged)) == [0, 1, 2]
    assert list(progress(range(3), desc="tokenizing", show=False, file=small)) == [0, 1, 2]
    assert "tokenizing" in shown.getvalue() and "/3" in shown.getvalue()
    assert logged.getvalue() == "" and small.getvalue() == ""
