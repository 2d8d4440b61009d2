"""Progress bars: tqdm's redrawn bar on a terminal; plain periodic lines anywhere else.

A log file or a pipe (CI, `kiln speedrun > log`) gets no carriage-return redraws, which would make
it mostly bar: `LineBar` prints the bar's text as one line when it starts, at most every
`KILN_PROGRESS_EVERY` seconds (default 30) while it runs, and once when it closes.
Modules import `tqdm` from here; `tqdm.write` works as usual.
"""
from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm as _tqdm


class LineBar(_tqdm):
    """A tqdm bar that prints whole lines, rate-limited, never redraws."""

    def __init__(self, *args, every: float | None = None, **kw):
        self._every = float(os.environ.get("KILN_PROGRESS_EVERY", "30")) if every is None else every
        self._printed, self._final = -float("inf"), False
        super().__init__(*args, **kw)

    def display(self, msg=None, pos=None):
        now = time.monotonic()
        if msg is None and not self._final and now - self._printed < self._every:
            return True
        line = self.__str__() if msg is None else msg
        if line.strip():
            self.fp.write(line.rstrip() + "\n")
            self.fp.flush()
            self._printed = now
        return True

    # tqdm.write() and nested bars clear and move the cursor with '\r' and '\n' around their own
    # output; a bar printed as whole lines has nothing to clear and no cursor to move.
    def clear(self, nolock=False):
        pass

    def moveto(self, n):
        pass

    def close(self):
        if not self.disable and not self._final:
            self._final = True
            self.display()
        self.sp = None  # tqdm's own close then writes nothing more (no redraw, no '\r')
        super().close()


def _on_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stderr
        return False


tqdm = _tqdm if _on_terminal() else LineBar
