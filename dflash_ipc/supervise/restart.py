"""The restart policy: may a worker that died be started again, and after how long?

A small named thing in the style of circus's flapping plugin: at most `max_restarts`
restarts within any trailing `window_s`; the k-th restart inside the window waits
`backoff_s * 2**(k-1)` (capped at `max_backoff_s`), so a worker that dies at once on every
start (bad GPU, broken model path) burns through its budget in seconds instead of
hammering the machine, and a worker that dies once a day is always restarted at once-ish.

    policy = RestartPolicy(max_restarts=3, window_s=600, role="target/2")
    decision = policy.on_death()       # records the death
    if decision.allowed:
        restart_after(decision.delay_s)
    else:
        fail(decision.reason)          # names the role, the count and the window

One policy per supervised process (per role and rank): a flapping target/2 does not use
up target/3's budget.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable

DEFAULT_BACKOFF_S = 1.0   # delay before the first restart inside a window
MAX_BACKOFF_S = 30.0      # the doubling stops here


@dataclass(frozen=True, slots=True)
class RestartDecision:
    """What the supervisor does about one death."""
    allowed: bool
    """True: start the process again after `delay_s`. False: fail the job with `reason`."""
    delay_s: float = 0.0
    """Seconds to wait before the restart (exponential backoff)."""
    reason: str = ""
    """Why the restart is refused (empty when allowed)."""
    restarts_in_window: int = 0
    """Restarts inside the window, this one included when allowed."""


class RestartPolicy:
    """Counts restarts in a trailing window and spaces them out by exponential backoff."""

    def __init__(self, *, max_restarts: int, window_s: float, backoff_s: float = DEFAULT_BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S, role: str = "worker",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if backoff_s < 0 or max_backoff_s < backoff_s:
            raise ValueError(f"need 0 <= backoff_s <= max_backoff_s, got {backoff_s!r}, {max_backoff_s!r}")
        self.max_restarts = max_restarts
        self.window_s = float(window_s)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.role = role
        self.clock = clock
        self._restarts: collections.deque[float] = collections.deque()  # times, oldest first
        self.total_restarts = 0

    def restarts_in_window(self) -> int:
        """Restarts granted within the trailing window, as of now."""
        self._forget_old(self.clock())
        return len(self._restarts)

    def on_death(self) -> RestartDecision:
        """Records a death now; returns whether and when to restart."""
        now = self.clock()
        self._forget_old(now)
        count = len(self._restarts)
        if count >= self.max_restarts:
            if self.max_restarts == 0:
                why = "restarts are off (supervise.max_restarts=0)"
            else:
                why = (f"it was already restarted {count} times within {self.window_s:.0f}s "
                       f"(supervise.max_restarts={self.max_restarts} per "
                       f"supervise.restart_window_s={self.window_s:.0f})")
            return RestartDecision(allowed=False, reason=f"{self.role} died and {why}",
                                   restarts_in_window=count)
        self._restarts.append(now)
        self.total_restarts += 1
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** count)
        return RestartDecision(allowed=True, delay_s=delay, restarts_in_window=count + 1)

    def _forget_old(self, now: float) -> None:
        while self._restarts and now - self._restarts[0] >= self.window_s:
            self._restarts.popleft()
