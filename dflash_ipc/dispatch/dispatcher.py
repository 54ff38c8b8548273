"""The dispatcher's logic: seats, credits and when to serve. No sockets here.

`Dispatcher.handle(sender, msg)` and `Dispatcher.tick()` return the messages to send, as
`(identity, message)` pairs, so tests step the whole job in one process;
`dflash_ipc.dispatch.proc` wraps it with a ZMQ ROUTER socket. Every fact about a batch is
in the `Ledger`, its slot and the committed tokens included; whom to serve is the `Policy`'s
answer; this class keeps the seats (who is registered, with how many credits, and what it
reports) and sends nothing that was not asked for: a target gets a `Batch` while it has a
credit and the ledger a free slot of its pool, a drafter an `Assign` while it has a credit.

Seats: a `Register` for a target or drafter seat carries the job's secret (`secret`: the
bytes of `<run_dir>/keys/job_secret`, wire/security.py), or is refused whatever it asks;
a peer that only reached the socket never gets a seat. A `Register` for a held seat from another process is a restart when the new process
names the old pid in `replaces_pids` (its supervisor knows them), or when the old seat has
been silent past its timeout; otherwise it is refused (a stray second worker must not take
over a live seat). A target restart drops the old seat (`drop_target`); a drafter restart
restarts the whole drafter group (`restart_drafter_group`), which resumes from the last
committed checkpoint (its rank 0 confirms with `Resumed`, and may fall back to an older
one: `Ledger.rollback_to`). A target silent for `heartbeat_timeout_s` is dropped in `tick`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time

from dflash_ipc.wire import protocol as p
from dflash_ipc.wire import status as st
from dflash_ipc.dispatch.buckets import PlannedBatch
from dflash_ipc.dispatch.ledger import BatchState, Ledger, TrainedCopy
from dflash_ipc.dispatch.policy import make_policy
from dflash_ipc.dispatch.seats import RATE_WINDOW_S, DrafterSeat, Seat, TargetSeat
from dflash_ipc.errors import BatchKeepsGettingLost, ProtocolError, UnregisteredSender
from dflash_ipc.obs.token_rate import TokenRate
from dflash_ipc.wire.security import secret_matches

log = logging.getLogger(__name__)

DROPPED_KEPT = 64     # status lists this many of the latest dropped targets (pid -> reason)
MAX_SLOTS = 256       # a target's slot count (target.num_slots is at most this)
MAX_TRUSTED_OBSERVERS = 16  # observers with the secret (supervisors, status, health): the latest are kept

Outgoing = list[tuple[bytes, "p.Message"]]


class Dispatcher:
    """Plans are fixed at construction; the ledger records every batch's state."""

    def __init__(self, epochs: list[list[PlannedBatch]], *, policy: str = "pull", num_targets: int, num_drafters: int,
                 num_nodes: int = 1, heartbeat_timeout_s: float = 30.0, drafter_timeout_s: float | None = None,
                 ledger: Ledger | None = None, clock=time.monotonic, drafter_generation: int = 0,
                 secret: bytes | None = None, max_batch_losses: int = 20) -> None:
        """`secret`: what every seat's Register must carry; None only where no peer can reach
        the logic (tests and benches stepping it in one process). `max_batch_losses`: a batch
        reported lost this many times raises BatchKeepsGettingLost (dispatch.max_batch_losses)."""
        self.secret = secret
        self.trusted_observers: dict[bytes, None] = {}  # observers whose Register had the secret, oldest first
        self.ledger = ledger or Ledger()
        if ledger is None:
            for batches in epochs:
                self.ledger.add_epoch(batches)
        order = [b.batch_id for batches in epochs for b in batches]
        self.policy = make_policy(policy, order, num_targets=num_targets, num_drafters=num_drafters,
                                  num_nodes=num_nodes)
        self.num_targets, self.num_drafters, self.num_nodes = num_targets, num_drafters, num_nodes
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.drafter_timeout_s = drafter_timeout_s or heartbeat_timeout_s
        self.clock = clock
        self.num_batches = sum(len(b) for b in epochs)
        self.tokens_planned = sum(b.num_tokens for batches in epochs for b in batches)
        self.targets: dict[int, TargetSeat] = {}
        self.drafters: dict[int, DrafterSeat] = {}
        self.target_waiters: collections.deque[int] = collections.deque()  # ranks, by ask time
        self.instance = os.urandom(6).hex()  # tells this process from a restarted one
        # The drafter group's generation: +1 on each group restart. Drafters meet for their
        # collectives at MASTER_PORT + generation, so a new group (on every node) never
        # joins the store of the dead one.
        self.drafter_generation = drafter_generation
        self.started = clock()
        # Tokens this process moved (throughput; a restarted dispatcher counts from 0). The
        # committed tokens are the ledger's (it alone knows rollbacks and earlier runs); the
        # count at start splits them into this process' share for its average rate.
        self.tokens_produced = self.tokens_consumed = 0
        self.committed_at_start = self.ledger.committed_tokens()
        # The drafters count the tokens they trained from 0 in every group: the job's trained
        # tokens are theirs on top of what was committed when their group started (set again
        # at each group restart and at its Resumed, after any rollback).
        self.trained_before_group = self.committed_at_start
        self.rates = {name: TokenRate(RATE_WINDOW_S) for name in ("tgt_rate", "dft_rate", "tok_rate")}
        self.end_sent = False
        self.refusals = 0
        # Targets dropped while their process may still run (hung, or replaced): pid -> why.
        # The supervisor reads it from the status and kills those processes.
        self.dropped_targets: collections.OrderedDict[int, str] = collections.OrderedDict()
        # Lost reports per batch (this process's): a copy that fails again and again is a fault
        # to report, not work to requeue without end.
        self.max_batch_losses = max_batch_losses
        self.losses: collections.Counter[int] = collections.Counter()

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
            return self._from_target(seat, msg)
        return self._from_drafter(seat, msg, now)

    def tick(self) -> Outgoing:
        """Periodic work: declare silent targets dead, update rates, finish when all is done."""
        now = self.clock()
        out: Outgoing = []
        for seat in list(self.targets.values()):
            if not seat.done and now - seat.last_seen > self.heartbeat_timeout_s:
                silent = now - seat.last_seen
                log.warning("target/%d silent for %.1fs: declared dead", seat.rank, silent)
                out += self.drop_target(seat.rank, reason=f"silent for {silent:.1f}s")
        for name, total in (("tgt_rate", self.tokens_produced), ("dft_rate", self.tokens_consumed),
                            ("tok_rate", self._trained_tokens())):
            self.rates[name].add(now, total)
        return out + self._maybe_end()

    @property
    def finished(self) -> bool:
        return self.ledger.all_committed()

    # --- registration -----------------------------------------------------------------

    def _register(self, sender: bytes, msg: p.Register, now: float) -> Outgoing:
        if msg.role == "observer":
            # One with the job's secret (the supervisor's status poller) is trusted: past the
            # strangers' budgets, so a flood of connections cannot keep the status from it.
            if self.secret is not None and msg.secret and secret_matches(self.secret, msg.secret):
                self.trusted_observers.pop(sender, None)
                self.trusted_observers[sender] = None
                while len(self.trusted_observers) > MAX_TRUSTED_OBSERVERS:  # oldest first
                    self.trusted_observers.pop(next(iter(self.trusted_observers)))
            return [(sender, p.Registered(role=msg.role, rank=msg.rank, num_batches=self.num_batches))]
        limit = {"target": self.num_targets, "drafter": self.num_drafters}.get(msg.role)
        if limit is None:
            raise ProtocolError(f"Register: role '{msg.role}' not allowed; allowed: target, drafter, observer")
        if self.secret is not None and not secret_matches(self.secret, msg.secret):
            raise ProtocolError(f"Register: {msg.role}/{msg.rank} without the job's secret (a stage of this job "
                                f"reads it from <run_dir>/keys/job_secret); no seat for pid {msg.pid}")
        if not 0 <= msg.rank < limit:
            raise ProtocolError(f"Register: {msg.role} rank {msg.rank} outside [0, {limit})")
        if not 0 <= msg.node < self.num_nodes:
            raise ProtocolError(f"Register: node {msg.node} outside [0, {self.num_nodes})")
        if msg.role == "target" and (not msg.pool or not 1 <= msg.num_slots <= MAX_SLOTS):
            raise ProtocolError(f"Register: a target sends its slot pool and 1 <= num_slots <= {MAX_SLOTS}, "
                                f"got num_slots={msg.num_slots}")
        seats = self.targets if msg.role == "target" else self.drafters
        out: Outgoing = []
        if (old := seats.get(msg.rank)) is not None:
            self._check_takeover(old, sender, msg, now)
            if msg.role == "target":
                out += self.drop_target(msg.rank, reason=f"replaced by pid {msg.pid}")
            else:
                out += self.restart_drafter_group(f"drafter/{msg.rank} registered again as pid {msg.pid}")
        if msg.role == "target":
            self.dropped_targets.pop(msg.pid, None)  # a reused pid is a new process
            self.ledger.open_pool(msg.rank, msg.num_slots)
            seats[msg.rank] = TargetSeat(rank=msg.rank, identity=sender, node=msg.node, pid=msg.pid, last_seen=now,
                                         pool=msg.pool, num_slots=msg.num_slots)
        else:
            seats[msg.rank] = DrafterSeat(rank=msg.rank, identity=sender, node=msg.node, pid=msg.pid, last_seen=now)
        log.info("%s/%d registered (pid %d, %s)", msg.role, msg.rank, msg.pid, msg.device)
        # Drafters resume from the checkpoint of the last commit the ledger holds.
        last = self.ledger.last_committed_step() if msg.role == "drafter" else None
        steps = self.ledger.committed_steps() if msg.role == "drafter" else []
        return out + [(sender, p.Registered(role=msg.role, rank=msg.rank, num_batches=self.num_batches,
                                            resume_step=-1 if last is None else last, instance=self.instance,
                                            generation=self.drafter_generation, committed_steps=steps))]

    def _check_takeover(self, old: Seat, sender: bytes, msg: p.Register, now: float) -> None:
        """A held seat goes to a new process only if that process succeeds the holder."""
        role = f"{msg.role}/{msg.rank}"
        if old.identity == sender:
            raise ProtocolError(f"Register: {role} is already registered by this sender")
        timeout = self.heartbeat_timeout_s if msg.role == "target" else self.drafter_timeout_s
        silent = now - old.last_seen
        if old.pid not in msg.replaces_pids and silent <= timeout:
            raise ProtocolError(f"Register: {role} is held by live pid {old.pid} (heard {silent:.1f}s ago); "
                                f"pid {msg.pid} does not replace it")

    def trusted(self, sender: bytes) -> bool:
        """Whether `sender` holds a seat or is an observer that registered with the secret."""
        return sender in self.trusted_observers or self.holds_seat(sender)

    def holds_seat(self, sender: bytes) -> bool:
        """Whether `sender` registered a target or drafter seat (its Register had the secret)."""
        return self._seat_of(sender) is not None

    def _seat_of(self, sender: bytes) -> Seat | None:
        for seats in (self.targets, self.drafters):
            for seat in seats.values():
                if seat.identity == sender:
                    return seat
        return None

    # --- failures ---------------------------------------------------------------------

    def drop_target(self, rank: int, reason: str = "dropped") -> Outgoing:
        """A target died, hung or was replaced: its pool closes, its leased and produced
        batches go back to pending (assigned ones stay with their drafters, whose copy may be
        under way). Its identity is forgotten, so a late message from it is answered
        Unregistered."""
        seat = self.targets.pop(rank, None)
        if seat is None:
            return []
        requeued = self.ledger.drop_target(rank)
        if rank in self.target_waiters:
            self.target_waiters.remove(rank)
        self.dropped_targets[seat.pid] = reason
        while len(self.dropped_targets) > DROPPED_KEPT:
            self.dropped_targets.popitem(last=False)
        log.warning("target/%d (pid %d) dropped (%s); %d batches back to pending", rank, seat.pid, reason,
                    len(requeued))
        self._reopen()
        return self._serve_targets()

    def restart_drafter_group(self, reason: str) -> Outgoing:
        """Every drafter seat goes; the new group resumes from the last committed checkpoint.
        Messages from the old processes are answered `Unregistered` from now on."""
        self.drafter_generation += 1
        requeued, again = self.ledger.restart_drafters()
        self.drafters.clear()
        self.trained_before_group = self.ledger.committed_tokens()
        self.policy.forget_drafters()
        self._reopen()
        log.warning("drafter group restart %d (%s): %d batches back to pending, %d to assign again",
                    self.drafter_generation, reason, len(requeued), len(again))
        return self._serve_targets()  # batches went back to pending, maybe after targets went idle

    def _reopen(self) -> None:
        """Batches went back to pending after EndOfData: the job is open again."""
        if self.end_sent and not self.ledger.all_consumed():
            self.end_sent = False
            for seat in list(self.targets.values()) + list(self.drafters.values()):
                seat.done = False

    # --- targets ----------------------------------------------------------------------

    def _from_target(self, seat: TargetSeat, msg: p.Message) -> Outgoing:
        if isinstance(msg, p.Ready):
            if not 1 <= msg.credits <= seat.num_slots:
                raise ProtocolError(f"Ready: credits must be in [1, {seat.num_slots}], got {msg.credits}")
            seat.credits = min(seat.credits + msg.credits, seat.num_slots)
            if seat.rank not in self.target_waiters:
                self.target_waiters.append(seat.rank)
            return self._serve_targets()
        if isinstance(msg, p.Produced):
            return self._produced(seat, msg)
        raise ProtocolError(f"{msg.KIND.name} is not a message a target may send")

    def _produced(self, seat: TargetSeat, msg: p.Produced) -> Outgoing:
        if msg.compute_s < 0:
            raise ProtocolError(f"Produced: batch {msg.batch_id}: compute_s {msg.compute_s} < 0")
        if not self.ledger.produced(msg.batch_id, seat.rank, msg.slot, num_tokens=msg.num_tokens):
            return self._serve_targets()  # a lease taken back meanwhile: only its slot came free
        seat.batches_done += 1
        seat.tokens_done += msg.num_tokens
        seat.compute_s += msg.compute_s
        self.tokens_produced += msg.num_tokens
        return self._serve_drafters()

    def _serve_targets(self) -> Outgoing:
        out: Outgoing = []
        for rank in list(self.target_waiters):
            seat = self.targets[rank]
            while seat.credits > 0 and self.ledger.free_slots(rank):
                batch = self.policy.next_batch(rank, self.ledger)
                if batch is None:
                    break
                work = self.ledger.lease(batch.batch_id, rank)
                seat.credits -= 1
                out.append((seat.identity, p.Batch(batch_id=work.batch_id, epoch=work.epoch, slot=work.slot,
                                                   sample_ids=list(work.sample_ids), padded_len=work.padded_len)))
            if seat.credits == 0:
                self.target_waiters.remove(rank)
        return out

    # --- drafters ---------------------------------------------------------------------

    def _from_drafter(self, seat: DrafterSeat, msg: p.Message, now: float) -> Outgoing:
        if isinstance(msg, p.WantHidden):
            if not 1 <= msg.credits <= 1024:
                raise ProtocolError(f"WantHidden: credits must be in [1, 1024], got {msg.credits}")
            if seat.credits == 0:
                seat.waiting_since = now
            seat.credits = min(seat.credits + msg.credits, 1024)
            return self._serve_drafters()
        if isinstance(msg, p.Consumed):
            consumption = self.ledger.consumed(msg.batch_id, seat.rank, msg.attempt)
            if consumption is None:
                return []  # its group commit came first and did this already
            self._count_consumed(seat, consumption.tokens)
            return self._serve_targets()
        if isinstance(msg, p.Lost):
            self.ledger.lost(msg.batch_id, seat.rank, msg.attempt)
            self.losses[msg.batch_id] += 1
            times = self.losses[msg.batch_id]
            if times >= self.max_batch_losses:
                raise BatchKeepsGettingLost(
                    f"batch {msg.batch_id} was lost {times} times (dispatch.max_batch_losses={self.max_batch_losses}), "
                    f"the last by drafter/{seat.rank}: {msg.reason}; a dead target loses a batch once, so the drafters "
                    "cannot copy what live targets produce: see the drafters' logs")
            log.warning("drafter/%d lost batch %d (attempt %d; lost %d times, the dispatcher stops at %d): %s; "
                        "back to pending", seat.rank, msg.batch_id, msg.attempt, times, self.max_batch_losses,
                        msg.reason)
            return self._serve_targets()
        if isinstance(msg, p.Committed):
            return self._committed(seat, msg)
        if isinstance(msg, p.Resumed):
            return self._resumed(seat, msg)
        raise ProtocolError(f"{msg.KIND.name} is not a message a drafter may send")

    def _count_consumed(self, seat: DrafterSeat, tokens: int) -> None:
        seat.batches_done += 1
        seat.tokens_done += tokens
        self.tokens_consumed += tokens

    def _committed(self, seat: DrafterSeat, msg: p.Committed) -> Outgoing:
        n = len(msg.batch_ids)
        if seat.rank != 0 and any(r != seat.rank for r in msg.ranks):
            raise ProtocolError(f"Committed from drafter/{seat.rank}: only rank 0 commits for the group")
        if not len(msg.ranks) == len(msg.attempts) == len(msg.samples) == n:
            raise ProtocolError(f"Committed: {n} batch ids, {len(msg.ranks)} ranks, {len(msg.attempts)} attempts, "
                                f"{len(msg.samples)} sample lists")
        if any(r not in self.drafters for r in msg.ranks):
            raise ProtocolError(f"Committed: ranks {sorted(set(msg.ranks))} include one not registered")
        copies = [TrainedCopy(batch_id=b, drafter=r, attempt=a, sample_ids=tuple(s))
                  for b, r, a, s in zip(msg.batch_ids, msg.ranks, msg.attempts, msg.samples)]
        self.ledger.commit(msg.step, copies)
        done = [(seat.identity, p.CommitDone(step=msg.step))]
        return self._serve_targets() + done + self._maybe_end()

    def _resumed(self, seat: DrafterSeat, msg: p.Resumed) -> Outgoing:
        """Rank 0 says from which checkpoint the group resumed; commits after it are undone
        (that checkpoint was unreadable, so the model holds none of them)."""
        last = self.ledger.last_committed_step()
        if seat.rank != 0 or (msg.step >= 0 and msg.step not in self.ledger.committed_steps()):
            raise ProtocolError(f"Resumed: drafter/{seat.rank} resumed from step {msg.step}, which is not a "
                                f"committed checkpoint (latest committed: {self.ledger.committed_steps()[-5:]})")
        if last is not None and msg.step < last:
            log.warning("the drafter group resumed from step %d, older than the last commit (step %d, "
                        "unreadable): the commits after it are undone", msg.step, last)
            self.ledger.rollback_to(msg.step)
            self._reopen()
        self.trained_before_group = self.ledger.committed_tokens()
        return [(seat.identity, p.Resumed(step=msg.step))] + self._serve_targets()

    def _serve_drafters(self) -> Outgoing:
        out: Outgoing = []
        drafters = list(self.drafters.values())
        for batch_id in self.ledger.produced_batches():
            entry = self.ledger.entry(batch_id)
            seat = self.policy.drafter_for(batch_id, self.targets[entry.target].node, drafters)
            if seat is None:
                continue
            attempt = self.ledger.assign(batch_id, seat.rank)
            seat.credits -= 1
            seat.waiting_since = self.clock()
            sample_ids, lengths = entry.remaining()
            out.append((seat.identity, p.Assign(batch_id=batch_id, epoch=entry.batch.epoch, target=entry.target,
                                                pool=self.targets[entry.target].pool, slot=entry.slot,
                                                sample_ids=list(sample_ids), num_tokens=sum(lengths),
                                                attempt=attempt)))
        return out

    # --- end of job, status -----------------------------------------------------------

    def _maybe_end(self) -> Outgoing:
        """When every batch is consumed, tell everyone no more work will come."""
        if self.end_sent or not self.ledger.all_consumed():
            return []
        self.end_sent = True
        log.info("every batch consumed: sending EndOfData")
        seats = list(self.targets.values()) + list(self.drafters.values())
        for seat in seats:
            seat.done = True
        return [(seat.identity, p.EndOfData()) for seat in seats]

    def _trained_tokens(self) -> float:
        # A drafter's own count, never below zero whatever it sends (no negative rates).
        return sum(max(0.0, s.metrics.get("trained_tokens", 0.0)) for s in self.drafters.values())

    def average_rates(self) -> st.Rates:
        """Whole-life averages of this process (tokens/s since it started): produced,
        consumed, and committed by it. Committed, not the drafters' trained counts: those
        restart from 0 with every drafter group, while elapsed time does not."""
        elapsed = max(1e-9, self.clock() - self.started)
        committed = max(0, self.ledger.committed_tokens() - self.committed_at_start)
        return st.Rates(tgt_rate=self.tokens_produced / elapsed, dft_rate=self.tokens_consumed / elapsed,
                        tok_rate=committed / elapsed)

    def status(self) -> st.JobStatus:
        """Everything the supervisor's status line and `dflash-ipc status` show."""
        counts = self.ledger.counts()
        now = self.clock()
        return st.JobStatus(
            elapsed_s=now - self.started,
            policy=self.policy.name,
            num_batches=self.num_batches,
            batches=st.BatchCounts(**{state.name.lower(): counts[state] for state in BatchState}),
            epochs=[st.EpochProgress(**e) for e in self.ledger.epoch_progress()],
            tokens=st.TokenCounts(total=self.tokens_planned, produced=self.tokens_produced,
                                  consumed=self.tokens_consumed,
                                  trained=self.trained_before_group + self._trained_tokens(),
                                  committed=self.ledger.committed_tokens()),
            committed_tokens_by_epoch={str(e): n for e, n in self.ledger.committed_tokens_by_epoch().items()},
            last_committed_step=self.ledger.last_committed_step(),
            rates=st.Rates(**{name: rate.value() for name, rate in self.rates.items()}),
            produced_waiting=counts[BatchState.PRODUCED],
            targets={str(r): st.TargetStatus(pid=s.pid, credits=s.credits, free_slots=self.ledger.free_slots(r),
                                             batches=s.batches_done, tokens=s.tokens_done, compute_s=s.compute_s,
                                             metrics=dict(s.metrics), heartbeat_age_s=now - s.last_seen)
                     for r, s in sorted(self.targets.items())},
            drafters={str(r): st.DrafterStatus(pid=s.pid, credits=s.credits, batches=s.batches_done,
                                               tokens=s.tokens_done, metrics=dict(s.metrics),
                                               heartbeat_age_s=now - s.last_seen)
                      for r, s in sorted(self.drafters.items())},
            refusals=self.refusals,
            instance=self.instance,
            drafter_generation=self.drafter_generation,
            dropped_targets={str(pid): why for pid, why in self.dropped_targets.items()},
            finished=self.finished,
        )

    def final_status(self) -> st.JobStatus:
        """The status at the end of the job: with this process' averages and the ledger's
        exactly-once audit against the plan."""
        return dataclasses.replace(self.status(), average_rates=self.average_rates(),
                                   audit=st.AuditSummary(**self.ledger.audit().summary()))
