"""Tokens per second from a cumulative count, over a window that always spans work.

The dispatcher's status rates (`tgt_rate`, `dft_rate`, `tok_rate`) come from counters that
grow in steps: a target adds a whole batch when it reports `Produced`, a drafter a whole step
when its heartbeat arrives. A plain trailing window shorter than the time between two such
steps swings between 0 (no step inside it) and a spike (one step over a short span): with one
batch every ~15 s (a real model on CPU) and a 10 s window, alternate status lines read 0 and
~160 tok/s.

So the window starts and ends at growths of the count: it reaches back to the newest growth
at least `window_s` old (at least one growth back), and the rate is the tokens added since
that growth over the time they took. Between growths at a steady pace the rate holds still.
Once the wait since the last growth exceeds the mean gap between growths in the window, the
wait counts too (the denominator grows with it), so a stall shows as a falling rate that
reaches 0 only slowly and never jumps.
"""

from __future__ import annotations

import collections


class TokenRate:
    """`add(now, total)` on every tick (a total that did not grow only moves the clock);
    `value()` the rate at the last tick, 0.0 until the count has grown once."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.points: collections.deque[tuple[float, float]] = collections.deque()  # where the count grew
        self.now = 0.0

    def add(self, now: float, total: float) -> None:
        self.now = now
        if self.points and total < self.points[-1][1]:
            self.points.clear()  # a counter that restarted (e.g. a new drafter group)
        if self.points and total == self.points[-1][1]:
            return
        self.points.append((now, total))
        while len(self.points) > 2 and now - self.points[1][0] >= self.window_s:
            self.points.popleft()

    def value(self) -> float:
        if len(self.points) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        mean_gap = (t1 - t0) / (len(self.points) - 1)
        span = max(t1 - t0, self.now - t0 - mean_gap)
        return (v1 - v0) / span if span > 0 else 0.0
