"""A progress line for long evaluations: prompts done, tokens/s, ETA, every few seconds (the ETA\ntext is obs/progress.py's, as everywhere)."""

from __future__ import annotations

import time
from collections.abc import Callable

from dflash_ipc.obs.progress import eta

PROGRESS_INTERVAL_S = 5.0


class EvalProgress:
    """``emit``s ``label: 37/128 prompts, 4,210 tokens, 512 tok/s, ETA 42s`` at most every
    ``interval_s`` (and always for the last one); ``unit`` "turns" for multi-turn sets."""

    def __init__(self, label: str, total: int, emit: Callable[[str], None], *, unit: str = "prompts",
                 interval_s: float = PROGRESS_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.emit, self.unit = label, total, emit, unit
        self.interval_s, self.clock = interval_s, clock
        self.started = clock()
        self._last_emit = self.started

    def line(self, done: int, tokens: int) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        return (f"{self.label}: {done}/{self.total} {self.unit}, {tokens:,} tokens, {tokens / elapsed:,.0f} tok/s, "
                f"{eta(done, self.total, done / elapsed)}")

    def update(self, done: int, tokens: int) -> None:
        now = self.clock()
        if done >= self.total or now - self._last_emit >= self.interval_s:
            self._last_emit = now
            self.emit(self.line(done, tokens))
