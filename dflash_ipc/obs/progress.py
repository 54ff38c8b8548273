"""Progress lines: when one is shown (in place on a terminal, every 10 s in a log), and the
duration and ETA texts every progress and status line uses.

`ProgressLine` is shared by `prepare` and `regenerate` (callers format the line, this decides
when it is shown); eval's per-set line (eval/progress.py) and the supervisor's status line
(obs/status_line.py) format their durations here.
"""

from __future__ import annotations

import sys
import time

TTY_INTERVAL_S = 0.25
LOG_INTERVAL_S = 10.0


def format_duration(seconds: float) -> str:
    """e.g. `45s`, `3m12s`, `1h02m`, `2d03h` (rounded down to the shown unit)."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class ProgressLine:
    """Shows a line when enough time has passed (always when final)."""

    def __init__(self, enabled: bool, *, stream=None, clock=time.monotonic):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.clock = clock
        self.start = clock()
        # A terminal shows the line at once; a log gets its first line after an interval.
        self._last = float("-inf") if self.tty else self.start
        self._shown = ""

    @property
    def elapsed_s(self) -> float:
        """Seconds since the line was created."""
        return self.clock() - self.start

    def due(self) -> bool:
        """True when show() would print now."""
        return self.enabled and self.clock() - self._last >= (TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S)

    def show(self, line: str, *, final: bool = False) -> None:
        """Print line if due (always when final); a final line ends with a newline."""
        if not self.enabled or not (final or self.due()) or (final and not self.tty and line == self._shown):
            return
        self._last = self.clock()
        self._shown = line
        end = "\n" if final or not self.tty else ""
        self.stream.write(("\r\x1b[K" if self.tty else "") + line + end)
        self.stream.flush()


def eta(done: float, total: float | None, rate: float) -> str:
    """`ETA 3m12s` for the work left at the current rate; `ETA --` when unknown."""
    if total is None or rate <= 0:
        return "ETA --"
    return f"ETA {format_duration(max(0.0, total - done) / rate)}"
