"""What the dispatcher knows of each registered worker: its seat, credits and counters.

Batch facts never live here (the ledger holds them); a seat holds what flow control
needs: credits, the target's free slots and the slots it was given for its leases.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

RATE_WINDOW_S = 10.0  # status rates span at least this long (token_rate.py: and whole batches)


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
