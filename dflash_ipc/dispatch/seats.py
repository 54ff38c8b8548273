"""What the dispatcher knows of each registered worker: its seat, credits and counters.

Batch facts never live here: the ledger holds them, the slots of a target's pool and the
committed tokens included. A seat holds who the worker is, its credits (flow control) and
what it reports (counters, metrics).
"""

from __future__ import annotations

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
    pool: dict = field(default_factory=dict)  # its slot-pool descriptor, sent with each Assign
    num_slots: int = 0                        # bounds its credits (the ledger has the slots)
    compute_s: float = 0.0


@dataclass
class DrafterSeat(Seat):
    waiting_since: float = 0.0
