"""The dispatcher's logic: who gets which batch, and when. No sockets here.

`Dispatcher.handle(sender, msg)` and `Dispatcher.tick(now)` return the messages to send, as
`(identity, message)` pairs, so tests can step the whole policy in one process;
`dflash_ipc.dispatch.proc` wraps it with a ZMQ ROUTER socket.

Pull policy (the default): nothing is sent that was not asked for. A target's `Ready(n)`
adds n credits; it gets a `Batch` when it has a credit AND a free slot, so a slow target
(long batches, slow GPU) simply asks less often and fast ones take the rest: no batch waits
behind a busy worker while another idles. A drafter's `WantHidden(n)` likewise; produced
batches go to the drafter that has waited longest, oldest batch first.

Target faults: a target silent for `heartbeat_timeout_s` is dropped (`tick`), and a
`Register` for a target rank held under another identity (a restarted process: identities
carry the pid) drops the old seat first; the same identity registering twice is refused. A
drop returns the target's leased and produced batches to pending, including produced ones
already assigned to a drafter that has not reported `Consumed` (its late `Consumed` is
refused; see `_without_revoked` for its `Committed`). The dropped pid is listed in the
status (`dropped_targets`) so the supervisor kills the process if it still runs; anything
it sends later is answered `Unregistered` (same `instance`: the worker exits).

Drafter faults: the drafters train as one group, so the supervisor restarts all of them
together. A `Register` for a drafter rank held under another identity (a new process) is
that restart: every drafter seat is dropped, batches consumed but not committed return to
pending (the new group resumes from the last committed step's checkpoint, which does not
hold them), and batches assigned but not yet consumed are assigned again to the new group
(their slots still hold them). Every `Assign` carries an `attempt`, echoed by `Consumed`,
so a late `Consumed` of an old copy never frees the slot of a newer one, and by
`Committed`, so the commit of a copy that was trained after a newer copy of the same batch
had been consumed counts for nothing (the newer copy commits later). Rank 0 commits for the
whole group (`Committed.ranks` says who trained what) right after its checkpoint: a commit
is all of a checkpoint's batches or none.

Dispatcher restarts: a new dispatcher process (new `instance`) restores the ledger (every
batch not committed is pending) and answers `Unregistered` to the surviving targets, which
register again with their pools; the supervisor restarts the drafter group.

Round-robin policy (`dispatch.policy: round_robin`) reproduces the reference system for
benchmarks: batch i belongs to target i mod N from the start and produced batch j to
drafter j mod M, whatever their speed. Workers still only receive when they have credit,
so the comparison measures the assignment policy, not flow control.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field

from dflash_ipc import protocol as p
from dflash_ipc.config import POLICIES
from dflash_ipc.dispatch.buckets import PlannedBatch
from dflash_ipc.dispatch.ledger import BatchState, Ledger
from dflash_ipc.errors import ProtocolError, UnregisteredSender
from dflash_ipc.token_rate import TokenRate

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0  # status rates span at least this long (token_rate.py: and whole batches)
DROPPED_KEPT = 64     # status lists this many of the latest dropped targets (pid -> reason)

# Rates (tokens/s, valid tokens, padding excluded):
#   tgt_rate  produced by targets into slots
#   dft_rate  copied out of slots by drafters (Consumed)
#   tok_rate  trained: went through a drafter optimizer step (end-to-end throughput)


@dataclass
class TargetSeat:
    """What the dispatcher knows of one target worker."""
    rank: int
    identity: bytes
    node: int
    pool: dict
    num_slots: int
    pid: int = 0
    credits: int = 0
    free_slots: collections.deque = field(default_factory=collections.deque)
    last_seen: float = 0.0
    batches_done: int = 0
    tokens_done: int = 0
    compute_s: float = 0.0
    metrics: dict = field(default_factory=dict)
    done: bool = False  # got EndOfData


@dataclass
class DrafterSeat:
    """What the dispatcher knows of one drafter worker."""
    rank: int
    identity: bytes
    node: int
    pid: int = 0
    credits: int = 0
    waiting_since: float = 0.0
    last_seen: float = 0.0
    batches_done: int = 0
    tokens_done: int = 0
    metrics: dict = field(default_factory=dict)
    done: bool = False


Outgoing = list[tuple[bytes, "p.Message"]]


class Dispatcher:
    """Plans are fixed at construction; the ledger records every batch's state."""

    def __init__(self, epochs: list[list[PlannedBatch]], *, policy: str, num_targets: int,
                 num_drafters: int, heartbeat_timeout_s: float = 30.0,
                 ledger: Ledger | None = None, clock=time.monotonic, drafter_generation: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy '{policy}' not allowed; allowed: {', '.join(POLICIES)}")
        self.policy = policy
        self.num_targets, self.num_drafters = num_targets, num_drafters
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self.ledger = ledger or Ledger()
        if ledger is None:
            for batches in epochs:
                self.ledger.add_epoch(batches)
        self.num_batches = sum(len(b) for b in epochs)
        self.tokens_planned = sum(b.num_tokens for batches in epochs for b in batches)
        self.targets: dict[int, TargetSeat] = {}
        self.drafters: dict[int, DrafterSeat] = {}
        self.observers: set[bytes] = set()
        self.produced: collections.deque[int] = collections.deque()  # batch ids, oldest first
        self.in_flight: dict[int, tuple[int, int]] = {}  # batch id -> (drafter, attempt): assigned, not consumed
        self.consumed_attempt: dict[int, int] = {}  # batch id -> attempt consumed, until committed
        # (batch id, attempt) consumed on the word of a group commit that overtook the
        # drafter's own Consumed (two sockets, no order): that Consumed is then a no-op.
        self.consumed_by_commit: set[tuple[int, int]] = set()
        self.next_attempt = 1
        self.instance = os.urandom(6).hex()  # tells this process from a restarted one
        # The drafter group's generation: +1 on each group restart. Drafters meet for their
        # collectives at MASTER_PORT + generation, so a new group (on every node) never
        # joins the store of the dead one.
        self.drafter_generation = drafter_generation
        self.target_waiters: collections.deque[int] = collections.deque()  # ranks, by ask time
        self.started = clock()
        self.tokens_produced = 0
        self.tokens_consumed = 0
        self.tokens_committed = 0
        self.rates = {name: TokenRate(RATE_WINDOW_S) for name in ("tgt_rate", "dft_rate", "tok_rate")}
        self.end_sent = False
        self.refusals = 0
        # Targets dropped while their process may still run (hung, or replaced): pid -> why.
        # The supervisor reads it from the status and kills those processes.
        self.dropped_targets: collections.OrderedDict[int, str] = collections.OrderedDict()
        # Batches taken back from a drafter by a drop (assigned, not yet consumed): id -> rank.
        # If that drafter had copied the batch anyway, its Committed lists it: _without_revoked.
        self.revoked: dict[int, set[int]] = {}  # batch id -> drafters whose copy was revoked
        # Round-robin: fixed ownership decided up front, by plan order.
        order = [b.batch_id for batches in epochs for b in batches]
        self.rr_target_of = {bid: i % num_targets for i, bid in enumerate(order)}
        self.rr_drafter_of: dict[int, int] = {}
        self.rr_produced_count = 0

    # --- entry points -----------------------------------------------------------------

    def handle(self, sender: bytes, msg: p.Message) -> Outgoing:
        """Applies one message from `sender`; returns what to send. Raises ProtocolError for
        messages that are not allowed from this sender now (the caller logs and refuses)."""
        now = self.clock()
        if isinstance(msg, p.Register):
            return self._register(sender, msg, now)
        if isinstance(msg, p.StatusRequest):
            return [(sender, p.StatusReply(status=self.status()))]
        seat = self._seat_of(sender)
        if seat is None:
            raise UnregisteredSender(f"{msg.KIND.name} from an unregistered sender")
        seat.last_seen = now
        if isinstance(msg, p.Heartbeat):
            seat.metrics = dict(msg.metrics)
            return [(sender, p.Heartbeat(metrics={}))]
        if isinstance(seat, TargetSeat):
            return self._from_target(seat, msg, now)
        return self._from_drafter(seat, msg, now)

    def tick(self) -> Outgoing:
        """Periodic work: declare silent workers dead, finish the job when all is done."""
        now = self.clock()
        out: Outgoing = []
        for seat in list(self.targets.values()):
            if not seat.done and now - seat.last_seen > self.heartbeat_timeout_s:
                silent = now - seat.last_seen
                log.warning("target/%d silent for %.1fs: declared dead", seat.rank, silent)
                out += self.drop_target(seat.rank, reason=f"silent for {silent:.1f}s")
        trained = sum(s.metrics.get("trained_tokens", 0.0) for s in self.drafters.values())
        for name, total in (("tgt_rate", self.tokens_produced), ("dft_rate", self.tokens_consumed),
                            ("tok_rate", trained)):
            self.rates[name].add(now, total)
        return out + self._maybe_end()

    @property
    def finished(self) -> bool:
        return self.ledger.all_committed()

    def drop_target(self, rank: int, reason: str = "dropped") -> Outgoing:
        """A target died, hung or was replaced: its leased and produced batches (produced
        ones too if already assigned to a drafter that has not reported Consumed) go back to
        pending. Its identity is forgotten, so a late Produced from it is refused."""
        seat = self.targets.pop(rank, None)
        if seat is None:
            return []
        requeued = set(self.ledger.requeue_target(rank))
        self.produced = collections.deque(b for b in self.produced if b not in requeued)
        for batch_id in requeued:
            assigned = self.in_flight.pop(batch_id, None)  # a late Consumed for it is refused
            if assigned is not None:
                self.revoked.setdefault(batch_id, set()).add(assigned[0])
        if rank in self.target_waiters:
            self.target_waiters.remove(rank)
        self.dropped_targets[seat.pid] = reason
        while len(self.dropped_targets) > DROPPED_KEPT:
            self.dropped_targets.popitem(last=False)
        log.warning("target/%d (pid %d) dropped (%s); %d batches back to pending",
                    rank, seat.pid, reason, len(requeued))
        return self._serve_targets()

    # --- registration -----------------------------------------------------------------

    def _register(self, sender: bytes, msg: p.Register, now: float) -> Outgoing:
        if msg.role == "observer":
            self.observers.add(sender)
            return [(sender, p.Registered(role=msg.role, rank=msg.rank, num_batches=self.num_batches))]
        limit = {"target": self.num_targets, "drafter": self.num_drafters}.get(msg.role)
        if limit is None:
            raise ProtocolError(f"Register: role '{msg.role}' not allowed; allowed: target, drafter, observer")
        if not 0 <= msg.rank < limit:
            raise ProtocolError(f"Register: {msg.role} rank {msg.rank} outside [0, {limit})")
        seats = self.targets if msg.role == "target" else self.drafters
        old = seats.get(msg.rank)
        if old is not None and old.identity == sender:
            raise ProtocolError(f"Register: {msg.role}/{msg.rank} is already registered by this sender")
        out: Outgoing = []
        if msg.role == "drafter" and old is not None:
            # A new process for a held drafter seat: the supervisor restarted the group.
            self.restart_drafter_group(reason=f"drafter/{msg.rank} registered again as pid {msg.pid}")
            # Batches went back to pending, maybe after every target went idle: serve them.
            out += self._serve_targets()
        if msg.role == "target":
            if msg.pool is None or msg.num_slots < 1:
                raise ProtocolError("Register: a target must send its slot pool and num_slots >= 1")
            self.dropped_targets.pop(msg.pid, None)  # a reused pid is a new process
            if old is not None:
                # A new process for a seat that is still held: the supervisor restarted the
                # target before the old one's silence was noticed. The old one is gone.
                out = self.drop_target(msg.rank, reason=f"replaced by pid {msg.pid}")
            seat = TargetSeat(rank=msg.rank, identity=sender, node=msg.node, pool=msg.pool,
                              num_slots=msg.num_slots, free_slots=collections.deque(range(msg.num_slots)),
                              last_seen=now, pid=msg.pid)
            self.targets[msg.rank] = seat
        else:
            self.drafters[msg.rank] = DrafterSeat(rank=msg.rank, identity=sender, node=msg.node,
                                                  last_seen=now, pid=msg.pid)
        log.info("%s/%d registered (pid %d, %s)", msg.role, msg.rank, msg.pid, msg.device)
        # Drafters resume from the checkpoint of the last commit the ledger holds (a restored
        # ledger: a rerun in the same run directory); batches committed then are not served.
        last = self.ledger.last_committed_step() if msg.role == "drafter" else None
        return out + [(sender, p.Registered(role=msg.role, rank=msg.rank, num_batches=self.num_batches,
                                            resume_step=-1 if last is None else last,
                                            instance=self.instance,
                                            generation=self.drafter_generation))]

    def restart_drafter_group(self, reason: str) -> None:
        """Every drafter seat goes; the new group resumes from the last committed checkpoint.
        Consumed-not-committed batches go back to pending; assigned-not-consumed ones are
        assigned again (their slots still hold them). Messages from the old processes are
        answered `Unregistered` from now on."""
        self.drafter_generation += 1
        requeued = self.ledger.requeue_all_uncommitted_consumed()
        reassign = [b for b in self.in_flight if self.ledger.entry(b).state is BatchState.PRODUCED]
        self.produced = collections.deque(reassign + [b for b in self.produced if b not in self.in_flight])
        self.in_flight.clear()
        self.revoked.clear()
        self.consumed_attempt.clear()  # nothing consumed is left: it all went back to pending
        self.consumed_by_commit.clear()
        self.drafters.clear()
        self.rr_drafter_of.clear()
        self._reopen()
        log.warning("drafter group restart %d (%s): %d consumed batches back to pending, %d assigned "
                    "batches to assign again", self.drafter_generation, reason, len(requeued), len(reassign))

    def _reopen(self) -> None:
        """Batches went back to pending after EndOfData: the job is open again."""
        if self.end_sent and not self._all_consumed():
            self.end_sent = False
            for seat in list(self.targets.values()) + list(self.drafters.values()):
                seat.done = False

    def _seat_of(self, sender: bytes) -> TargetSeat | DrafterSeat | None:
        for seats in (self.targets, self.drafters):
            for seat in seats.values():
                if seat.identity == sender:
                    return seat
        return None

    # --- targets ----------------------------------------------------------------------

    def _from_target(self, seat: TargetSeat, msg: p.Message, now: float) -> Outgoing:
        if isinstance(msg, p.Ready):
            if msg.credits < 1:
                raise ProtocolError(f"Ready: credits must be >= 1, got {msg.credits}")
            seat.credits += msg.credits
            if seat.rank not in self.target_waiters:
                self.target_waiters.append(seat.rank)
            return self._serve_targets()
        if isinstance(msg, p.Produced):
            self.ledger.produced(msg.batch_id, seat.rank, msg.slot)
            seat.batches_done += 1
            seat.tokens_done += msg.num_tokens
            seat.compute_s += msg.compute_s
            self.tokens_produced += msg.num_tokens
            self.produced.append(msg.batch_id)
            return self._serve_drafters()
        raise ProtocolError(f"{msg.KIND.name} is not a message a target may send")

    def _next_batch_for(self, rank: int) -> PlannedBatch | None:
        if self.policy == "pull":
            return self.ledger.next_pending()
        for batch in self.ledger.pending_batches():
            if self.rr_target_of[batch.batch_id] == rank:
                return batch
        return None

    def _serve_targets(self) -> Outgoing:
        out: Outgoing = []
        for rank in list(self.target_waiters):
            seat = self.targets[rank]
            while seat.credits > 0 and seat.free_slots:
                batch = self._next_batch_for(rank)
                if batch is None:
                    break
                slot = seat.free_slots.popleft()
                self.ledger.lease(batch.batch_id, rank)
                seat.credits -= 1
                out.append((seat.identity, p.Batch(batch_id=batch.batch_id, epoch=batch.epoch, slot=slot,
                                                   sample_ids=list(batch.sample_ids),
                                                   padded_len=batch.padded_len)))
            if seat.credits == 0:
                self.target_waiters.remove(rank)
        return out

    # --- drafters ---------------------------------------------------------------------

    def _from_drafter(self, seat: DrafterSeat, msg: p.Message, now: float) -> Outgoing:
        if isinstance(msg, p.WantHidden):
            if msg.credits < 1:
                raise ProtocolError(f"WantHidden: credits must be >= 1, got {msg.credits}")
            if seat.credits == 0:
                seat.waiting_since = now
            seat.credits += msg.credits
            return self._serve_drafters()
        if isinstance(msg, p.Consumed):
            if (msg.batch_id, msg.attempt) in self.consumed_by_commit:
                self.consumed_by_commit.discard((msg.batch_id, msg.attempt))
                return []  # rank 0's commit of it came first and did this already
            if self.in_flight.get(msg.batch_id) != (seat.rank, msg.attempt):
                raise ProtocolError(f"Consumed: batch {msg.batch_id} attempt {msg.attempt} is not "
                                    f"assigned to drafter/{seat.rank}")
            self._consume(seat, msg.batch_id, msg.attempt)
            return self._serve_targets()
        if isinstance(msg, p.Committed):
            if msg.ranks and len(msg.ranks) != len(msg.batch_ids):
                raise ProtocolError(f"Committed: {len(msg.ranks)} ranks for {len(msg.batch_ids)} batch ids")
            if msg.attempts and len(msg.attempts) != len(msg.batch_ids):
                raise ProtocolError(f"Committed: {len(msg.attempts)} attempts for {len(msg.batch_ids)} batch ids")
            ranks = msg.ranks or [seat.rank] * len(msg.batch_ids)
            # Attempts count from 1; anything else says "not known" (the check by revocation).
            attempts = [a if a >= 1 else None for a in msg.attempts] or [None] * len(msg.batch_ids)
            if any(r not in self.drafters for r in ranks):
                raise ProtocolError(f"Committed: ranks {sorted(set(ranks))} include one not registered")
            consumed_now = False
            for batch_id, rank, attempt in zip(msg.batch_ids, ranks, attempts):
                if attempt is not None and self.in_flight.get(batch_id) == (rank, attempt):
                    # The rank trained this copy, so it copied it: its Consumed is on the way.
                    self._consume(self.drafters[rank], batch_id, attempt)
                    self.consumed_by_commit.add((batch_id, attempt))
                    consumed_now = True
            out = self._serve_targets() if consumed_now else []  # slots came free
            batch_ids = []
            for batch_id, rank, attempt in zip(msg.batch_ids, ranks, attempts):
                if self._superseded(batch_id, rank, attempt):
                    continue
                batch_ids += self._without_revoked(rank, [batch_id])
            self.ledger.committed(batch_ids, seat.rank, msg.step,
                                  group=sorted(set(ranks)) if msg.ranks else None)
            for batch_id in batch_ids:
                self.consumed_attempt.pop(batch_id, None)
            self.tokens_committed += sum(self.ledger.entry(b).batch.num_tokens for b in batch_ids)
            return out + self._maybe_end()
        raise ProtocolError(f"{msg.KIND.name} is not a message a drafter may send")

    def _unrevoke(self, batch_id: int, rank: int) -> None:
        ranks = self.revoked.get(batch_id)
        if ranks is not None:
            ranks.discard(rank)
            if not ranks:
                del self.revoked[batch_id]

    def _consume(self, seat: DrafterSeat, batch_id: int, attempt: int) -> None:
        """The bookkeeping of drafter `seat`'s Consumed of `batch_id`'s copy `attempt`."""
        entry = self.ledger.entry(batch_id)
        target_rank, slot = entry.target, entry.slot
        self.ledger.consumed(batch_id, seat.rank)
        del self.in_flight[batch_id]
        self.consumed_attempt[batch_id] = attempt
        seat.batches_done += 1
        seat.tokens_done += entry.batch.num_tokens
        self.tokens_consumed += entry.batch.num_tokens
        target = self.targets.get(target_rank)
        if target is not None:  # the slot goes back to its (still living) target
            target.free_slots.append(slot)

    def _superseded(self, batch_id: int, rank: int, attempt: int | None) -> bool:
        """Whether drafter `rank` commits a copy of `batch_id` that is not the one the ledger
        holds as consumed: a target drop took that copy back after the drafter had copied it
        (its Consumed was refused), and the batch went round again, to whichever drafter, once
        or more. Only the copy consumed last counts, and it commits when its drafter has
        trained it; committing an older one would refuse that commit (all or none) and stall
        the job. The attempt number tells the copies apart."""
        if attempt is None or batch_id not in self.ledger:
            return False
        entry = self.ledger.entry(batch_id)
        consumed = self.consumed_attempt.get(batch_id)
        if entry.state is BatchState.CONSUMED and entry.drafter == rank and consumed == attempt:
            return False
        log.warning("drafter/%d committed attempt %d of batch %d, which is %s (drafter %s, attempt "
                    "%s): an older copy, not counted", rank, attempt, batch_id, entry.state.name,
                    entry.drafter, consumed)
        self._unrevoke(batch_id, rank)
        return True

    def _without_revoked(self, rank: int, batch_ids: list[int]) -> list[int]:
        """`batch_ids` less those a target drop took back from drafter `rank` after it had
        copied them (its Consumed came too late and was refused). The drafter trained them
        anyway; they are produced and consumed again, and only that second time counts.
        Committing them now would be refused and, all-or-none, refuse the whole commit."""
        kept = []
        for batch_id in batch_ids:
            if rank in self.revoked.get(batch_id, ()) and batch_id in self.ledger:
                entry = self.ledger.entry(batch_id)
                if not (entry.state is BatchState.CONSUMED and entry.drafter == rank):
                    # Its stale copy: whoever consumed the batch again commits it (or did).
                    log.warning("drafter/%d committed batch %d, which a target drop took back "
                                "before its Consumed: not counted, it is served again", rank, batch_id)
                    self._unrevoke(batch_id, rank)
                    continue
                self._unrevoke(batch_id, rank)  # this commit is of its second, valid copy
            kept.append(batch_id)
        return kept

    def _drafter_for(self, batch_id: int) -> DrafterSeat | None:
        """The drafter that gets `batch_id` now, or None if it must wait."""
        node = self.targets[self.ledger.entry(batch_id).target].node
        if self.policy == "round_robin":
            if batch_id not in self.rr_drafter_of:
                self.rr_drafter_of[batch_id] = self.rr_produced_count % self.num_drafters
                self.rr_produced_count += 1
            seat = self.drafters.get(self.rr_drafter_of[batch_id])
            return seat if seat is not None and seat.credits > 0 else None
        # Hidden states never leave their node: only drafters of the producing node qualify.
        ready = [s for s in self.drafters.values() if s.credits > 0 and s.node == node]
        return min(ready, key=lambda s: s.waiting_since) if ready else None

    def _serve_drafters(self) -> Outgoing:
        out: Outgoing = []
        kept: collections.deque[int] = collections.deque()
        while self.produced:
            batch_id = self.produced.popleft()
            seat = self._drafter_for(batch_id)
            if seat is None:
                kept.append(batch_id)
                continue
            entry = self.ledger.entry(batch_id)
            seat.credits -= 1
            seat.waiting_since = self.clock()
            self.in_flight[batch_id] = (seat.rank, self.next_attempt)
            target = self.targets[entry.target]
            out.append((seat.identity, p.Assign(batch_id=batch_id, epoch=entry.batch.epoch,
                                                 target=entry.target, pool=target.pool,
                                                 slot=entry.slot, sample_ids=list(entry.batch.sample_ids),
                                                 num_tokens=entry.batch.num_tokens,
                                                 attempt=self.next_attempt)))
            self.next_attempt += 1
        self.produced = kept
        return out

    # --- end of job -------------------------------------------------------------------

    def _all_consumed(self) -> bool:
        counts = self.ledger.counts()
        return not any(counts.get(s, 0) for s in (BatchState.PENDING, BatchState.LEASED, BatchState.PRODUCED))

    def _maybe_end(self) -> Outgoing:
        """When every batch is consumed, tell everyone no more work will come."""
        if self.end_sent or not self._all_consumed():
            return []
        self.end_sent = True
        log.info("every batch consumed: sending EndOfData")
        seats = list(self.targets.values()) + list(self.drafters.values())
        for seat in seats:
            seat.done = True
        return [(seat.identity, p.EndOfData()) for seat in seats]

    def status(self) -> dict:
        """Everything the supervisor's status line and `dflash-ipc status` show."""
        counts = self.ledger.counts()
        return {
            "elapsed_s": self.clock() - self.started,
            "policy": self.policy,
            "num_batches": self.num_batches,
            "batches": {state.name.lower(): counts.get(state, 0) for state in BatchState},
            "epochs": self.ledger.epoch_progress(),
            "tokens": {"total": self.tokens_planned, "produced": self.tokens_produced, "consumed": self.tokens_consumed,
                       "trained": sum(s.metrics.get("trained_tokens", 0.0) for s in self.drafters.values()),
                       "committed": self.tokens_committed},
            "rates": {name: rate.value() for name, rate in self.rates.items()},
            "produced_waiting": len(self.produced),
            "targets": {str(r): {"pid": s.pid, "credits": s.credits, "free_slots": len(s.free_slots),
                                 "batches": s.batches_done, "tokens": s.tokens_done,
                                 "compute_s": s.compute_s, "metrics": s.metrics,
                                 "heartbeat_age_s": self.clock() - s.last_seen}
                        for r, s in sorted(self.targets.items())},
            "drafters": {str(r): {"pid": s.pid, "credits": s.credits, "batches": s.batches_done, "tokens": s.tokens_done,
                                  "metrics": s.metrics, "heartbeat_age_s": self.clock() - s.last_seen}
                         for r, s in sorted(self.drafters.items())},
            "refusals": self.refusals,
            "instance": self.instance,
            "drafter_generation": self.drafter_generation,
            "dropped_targets": {str(pid): why for pid, why in self.dropped_targets.items()},
            "finished": self.finished,
        }
