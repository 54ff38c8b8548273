"""What the dispatcher knows of each registered worker: its seat, credits and counters.

Batch facts never live here (the ledger holds them); a seat holds what flow control
needs: credits, the target's free slots and the slots it was given for its leases.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

RATE_WINDOW_S = 10.0  # rates in the status are averaged over this trailing window


@dataclass
class Seat:
    rank: int
    identity: bytes
    node: int
    pid: int
    last_seen: float
    credits: int = 0
    batches_done: int = 0
    tokens_done: int = 0
    metrics: dict = field(default_factory=dict)
    done: bool = False  # got EndOfData


@dataclass
class TargetSeat(Seat):
    pool: dict = field(default_factory=dict)
    num_slots: int = 0
    free_slots: collections.deque = field(default_factory=collections.deque)
    leases: dict = field(default_factory=dict)  # batch id -> (slot, tokens) given with its Batch
    compute_s: float = 0.0


@dataclass
class DrafterSeat(Seat):
    waiting_since: float = 0.0


class Rate:
    """Tokens per second over a trailing window, from cumulative counts."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.points: collections.deque = collections.deque()

    def add(self, now: float, total: float) -> None:
        self.points.append((now, total))
        while len(self.points) > 2 and now - self.points[1][0] > self.window_s:
            self.points.popleft()

    def value(self) -> float:
        if len(self.points) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0
