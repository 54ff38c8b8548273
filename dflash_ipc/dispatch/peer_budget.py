"""What a peer without a seat may cost the dispatcher, and how often it hears the status.

A peer is a ZMQ routing identity (one connection). Until it holds a seat (its `Register`
carried the job's secret), whatever it sends is hostile: `PeerBudget` lets it spend
`frames` frames and `nbytes` bytes per `window_s`; beyond that its frames are dropped
unread and counted, and the caller logs the peer once per window. The table holds at most
`max_peers` identities per window; later peers share one budget, so 3,000 connections grow
nothing but that one entry.

`StatusAnswers` keeps at most one outstanding status request per peer: more requests from a
peer whose answer is pending coalesce into it, and a peer is answered at most once per
`interval_s`. A flood of requests from connections that never read thus queues a bounded
number of replies, which share one body (built once per pass). Past `max_waiting` waiting
peers a stranger's request is dropped; a trusted peer's (a seat, or an observer whose Register
carried the job's secret, as the supervisor's) is not, and a trusted peer skips `PeerBudget`.
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass

OVERFLOW = b""  # the shared entry of the peers past `max_peers` (no ZMQ identity is empty)


class Verdict(enum.Enum):
    ADMIT = "admit"
    DROP = "drop"              # over budget, as earlier in this window
    DROP_FIRST = "drop_first"  # the peer's first drop of this window: log it


@dataclass
class _Spent:
    frames: int = 0
    nbytes: int = 0
    dropped: int = 0


class PeerBudget:
    def __init__(self, *, frames: int, nbytes: int, window_s: float, max_peers: int = 1024,
                 clock=time.monotonic) -> None:
        self.frames, self.nbytes, self.window_s, self.max_peers = frames, nbytes, window_s, max_peers
        self.clock = clock
        self._window_start = clock()
        self._spent: dict[bytes, _Spent] = {}
        self.dropped = 0  # frames dropped since the start, for the status

    def admit(self, identity: bytes, nbytes: int) -> Verdict:
        """Charges one frame of `nbytes` to `identity`; whether it may be read."""
        now = self.clock()
        if now - self._window_start >= self.window_s:
            self._window_start, self._spent = now, {}
        key = identity if identity in self._spent or len(self._spent) < self.max_peers else OVERFLOW
        spent = self._spent.setdefault(key, _Spent())
        spent.frames += 1
        spent.nbytes += nbytes
        if spent.frames <= self.frames and spent.nbytes <= self.nbytes:
            return Verdict.ADMIT
        spent.dropped += 1
        self.dropped += 1
        return Verdict.DROP_FIRST if spent.dropped == 1 else Verdict.DROP


class StatusAnswers:
    def __init__(self, *, interval_s: float, max_waiting: int = 1024, clock=time.monotonic) -> None:
        self.interval_s, self.max_waiting, self.clock = interval_s, max_waiting, clock
        self._waiting: dict[bytes, None] = {}  # peers with a request not yet answered, in ask order
        self._answered: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # peer -> when
        self.dropped = 0  # requests refused because `max_waiting` peers were waiting

    def ask(self, identity: bytes, *, trusted: bool = False) -> None:
        """A status request from `identity` (a second one while the first waits is the same).
        A trusted one (a seat, an observer with the job's secret: few) is never dropped."""
        if identity in self._waiting:
            return
        if len(self._waiting) >= self.max_waiting and not trusted:
            self.dropped += 1
            return
        self._waiting[identity] = None

    def due(self) -> list[bytes]:
        """The peers to answer now (each then counts as answered)."""
        now = self.clock()
        while self._answered and now - next(iter(self._answered.values())) >= self.interval_s:
            self._answered.popitem(last=False)  # oldest first: only recent answers hold a peer back
        due = [identity for identity in self._waiting if identity not in self._answered]
        for identity in due:
            del self._waiting[identity]
            self._answered[identity] = now
        return due

    @property
    def waiting(self) -> int:
        return len(self._waiting)
