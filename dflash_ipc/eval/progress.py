"""A progress line for long evaluations: prompts done, tokens/s, ETA, every few seconds."""

from __future__ import annotations

import time
from collections.abc import Callable

PROGRESS_INTERVAL_S = 5.0


def format_duration(seconds: float) -> str:
    """``h:mm:ss`` or ``m:ss``."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressLine:
    """``emit``s ``label: 37/128 prompts, 4,210 tokens, 512 tok/s, ETA 0:42`` at most every
    ``interval_s`` (and always for the last prompt)."""

    def __init__(self, label: str, total: int, emit: Callable[[str], None], *,
                 interval_s: float = PROGRESS_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.emit = label, total, emit
        self.interval_s, self.clock = interval_s, clock
        self.started = clock()
        self._last_emit = self.started

    def line(self, done: int, tokens: int) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        eta = format_duration(elapsed * (self.total - done) / done) if done else "?"
        return (f"{self.label}: {done}/{self.total} prompts, {tokens:,} tokens, {tokens / elapsed:,.0f} tok/s, "
                f"ETA {eta}")

    def update(self, done: int, tokens: int) -> None:
        now = self.clock()
        if done >= self.total or now - self._last_emit >= self.interval_s:
            self._last_emit = now
            self.emit(self.line(done, tokens))
