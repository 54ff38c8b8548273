"""The exactly-once ledger: every fact about every planned batch, and nothing else's.

States, and the message that moves a batch (the dispatcher calls the method of the same
name when the message arrives)::

    PENDING --lease(t)--> LEASED(t, slot) --produced--> PRODUCED --assign(d)--> ASSIGNED(d, attempt)
       ^                    |                             ^    |                  |    |
       |  drop_target(t) ---+-----------------------------|----+   lost(d, a) ----+    |
       |                                   restart_drafters: ASSIGNED back to PRODUCED   |
       |                                                                    consumed(d, a)
       +-- restart_drafters / requeue_uncommitted / rollback_to ------- CONSUMED(d, attempt)
                                                                              |
                                             commit(step, copies): every sample committed
                                                                              v
                                                                          COMMITTED

Slots are the ledger's too: each target's pool (`open_pool`, closed by `drop_target`) has
free slots, `lease` takes one and every transition that ends the slot's use (consumed,
lost, a commit that consumes, a requeue) puts it back, so the dispatcher only asks how many
are free (`free_slots`). A slot holds its batch from the lease until a drafter's copy is
out of it. A lease taken back while its target computes (`rollback_to`) keeps the slot
until the target reports it produced (the target writes it whatever we decide): that late
`produced` frees the slot and moves nothing.

Commits are per sample: a checkpoint commits the samples of each copy that went through an
optimizer step before it (`CommitRecord`), so a batch whose sequences straddle a checkpoint
is committed in two parts, and a batch returned to pending keeps its committed samples: it
is leased again with only the rest (`LeasedWork`). The committed history is then exactly
what the checkpoints of the drafter group hold, sample by sample; `audit` checks it.

Rules:
* Only the owner moves a batch on: the target that leased it reports it produced; the
  drafter that holds an assignment under its attempt number consumes it, loses it or
  commits it. Anything else raises ``ProtocolError`` naming the batch, its state and the
  sender, and changes nothing; ``commit`` checks every copy first and applies all or none.
* A target that dies loses its pool, its LEASED and PRODUCED batches (back to PENDING). An
  ASSIGNED batch stays with its drafter, which may have copied it before the target died: its
  `consumed` or `lost` decides (a copy that completed is valid data).
* A drafter-group restart resumes from the last committed checkpoint: CONSUMED batches go
  back to PENDING (their committed samples stay committed), ASSIGNED ones go back to
  PRODUCED (their slots still hold them) or to PENDING when their target is gone.
* A dispatcher restart (`requeue_uncommitted`, applied by `ledger_file.load`): everything
  not committed is PENDING again. `rollback_to(step)` un-commits what came after a
  checkpoint that turned out unreadable, when the group resumes from an older one.
* Requeued batches are served before untouched ones, oldest (plan order) first.
"""

from __future__ import annotations

import enum
import heapq
import logging
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Mapping, Union

import collections

from dflash_ipc.dispatch.audit import AuditReport, audit_samples
from dflash_ipc.dispatch.buckets import PlannedBatch
from dflash_ipc.errors import DataError, ProtocolError

logger = logging.getLogger(__name__)

Owner = Union[int, str]
"""A worker as the dispatcher names it: its rank (int) or a name."""


class BatchState(enum.IntEnum):
    """Lifecycle of a planned batch; values are persisted, do not renumber."""

    PENDING = 0
    LEASED = 1
    PRODUCED = 2
    CONSUMED = 3
    COMMITTED = 4
    ASSIGNED = 5


IN_FLIGHT = (BatchState.LEASED, BatchState.PRODUCED, BatchState.ASSIGNED, BatchState.CONSUMED)


@dataclass(slots=True)
class LedgerEntry:
    """One batch and where it is. ``target`` keeps the producer after consumption."""

    batch: PlannedBatch
    seq: int
    """Position in plan order (add order); requeue priority is by this."""
    state: BatchState = BatchState.PENDING
    target: Owner | None = None
    slot: int | None = None
    drafter: Owner | None = None
    attempt: int = 0
    """The current assignment's attempt number (0: never assigned)."""
    leases: int = 0
    """Number of leases so far; > 0 while PENDING means requeued."""
    step: int | None = None
    """Checkpoint step of the commit that completed the batch."""
    done: frozenset = frozenset()
    """Sample ids committed so far (all of them once COMMITTED)."""
    orphaned: bool = False
    """ASSIGNED from a target that was dropped since: its slot belongs to no live pool."""
    token: int = field(default=0, repr=False, compare=False)
    """Queue generation: heap items with another token are stale."""

    def remaining(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Sample ids and lengths not committed yet, in plan order."""
        pairs = [(s, n) for s, n in zip(self.batch.sample_ids, self.batch.lengths) if s not in self.done]
        return tuple(s for s, _ in pairs), tuple(n for _, n in pairs)

    @property
    def remaining_tokens(self) -> int:
        return sum(self.remaining()[1])


@dataclass(frozen=True, slots=True)
class LeasedWork:
    """What a target computes for a lease: the samples of the batch not yet committed."""

    batch_id: int
    epoch: int
    sample_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    padded_len: int
    slot: int
    """The target's slot the ledger gave this lease."""

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """Samples of one batch that one checkpoint committed."""

    batch_id: int
    step: int
    sample_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TrainedCopy:
    """One drafter's trained samples of one assigned copy, as a checkpoint reports them."""

    batch_id: int
    drafter: Owner
    attempt: int
    sample_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Consumption:
    """What a Consumed did: the tokens the copy holds (its slot is free again)."""

    tokens: int


@dataclass(slots=True)
class CommitResult:
    """What one commit did."""

    completed: list[int] = field(default_factory=list)
    """Batches now fully committed."""
    tokens: int = 0
    """Tokens of the samples committed."""


class Ledger:
    """State of every planned batch; the single source of truth for exactly-once."""

    def __init__(self) -> None:
        self._entries: dict[int, LedgerEntry] = {}
        self._order: list[int] = []  # batch ids in seq order
        # Requeued PENDING batches as (seq, token, batch_id), oldest first; items whose
        # token no longer matches the entry are stale and skipped lazily.
        self._requeued: list[tuple[int, int, int]] = []
        # Untouched PENDING batches (leases == 0) never come back once leased, so a
        # cursor over plan order finds the next one in amortized O(1).
        self._fresh_cursor = 0
        self._counts = {s: 0 for s in BatchState}
        self._epoch_total: dict[int, int] = {}
        self._epoch_committed: dict[int, int] = {}
        self._epoch_tokens: dict[int, int] = {}  # epoch -> its planned tokens
        self._pools: dict[Owner, collections.deque[int]] = {}  # open pools: target -> its free slots
        # (target, slot) -> the batch holding it: LEASED, PRODUCED, ASSIGNED, or a lease taken
        # back whose target still computes into it
        self._slots: dict[tuple[Owner, int], int] = {}
        self._produced: dict[int, None] = {}  # PRODUCED ids, insertion = produce order
        self._history: list[CommitRecord] = []
        # Kept with the history, so a status (read several times a second) costs
        # O(epochs + checkpoints), not O(commit records): a long job has hundreds of thousands.
        self._committed_tokens: dict[int, int] = {}  # epoch -> tokens of its committed samples
        self._records_by_step: dict[int, int] = {}  # checkpoint step -> commit records at it
        self.next_attempt = 1

    # ---- planning -------------------------------------------------------------------

    def add_epoch(self, batches: Iterable[PlannedBatch]) -> None:
        """Append planned batches (PENDING, served in the given order after older ones).

        Raises DataError on a batch id already in the ledger (or repeated); adds nothing.
        """
        batches = list(batches)
        seen: set[int] = set()
        for b in batches:
            if b.batch_id in self._entries or b.batch_id in seen:
                raise DataError(f"add_epoch: batch id {b.batch_id} (epoch {b.epoch}) is already in the "
                                f"ledger; plan each epoch with first_batch_id after the previous one")
            seen.add(b.batch_id)
        for b in batches:
            self._entries[b.batch_id] = LedgerEntry(batch=b, seq=len(self._order))
            self._order.append(b.batch_id)
            self._counts[BatchState.PENDING] += 1
            self._epoch_total[b.epoch] = self._epoch_total.get(b.epoch, 0) + 1
            self._epoch_committed.setdefault(b.epoch, 0)
            self._epoch_tokens[b.epoch] = self._epoch_tokens.get(b.epoch, 0) + b.num_tokens
            self._committed_tokens.setdefault(b.epoch, 0)

    # ---- queries --------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, batch_id: object) -> bool:
        return batch_id in self._entries

    def entry(self, batch_id: int) -> LedgerEntry:
        """A copy of the entry of ``batch_id`` (ProtocolError if unknown)."""
        return replace(self._get(batch_id, "query", "read"))

    def entries(self) -> Iterator[LedgerEntry]:
        """Every entry in plan order (live objects: read only)."""
        return (self._entries[b] for b in self._order)

    def next_pending(self) -> PlannedBatch | None:
        """The batch the next lease takes (requeued first, oldest first), or None."""
        self._drop_stale()
        if self._requeued:
            return self._entries[self._requeued[0][2]].batch
        return next(self._fresh(), None)

    def pending_batches(self) -> Iterator[PlannedBatch]:
        """Every PENDING batch in serving order (lazy; do not change the ledger meanwhile)."""
        self._drop_stale()
        for _, token, bid in sorted(self._requeued):
            if self._is_requeued_item(token, bid):
                yield self._entries[bid].batch
        yield from self._fresh()

    def _drop_stale(self) -> None:
        while self._requeued and not self._is_requeued_item(*self._requeued[0][1:]):
            heapq.heappop(self._requeued)

    def _fresh(self) -> Iterator[PlannedBatch]:
        """Untouched PENDING batches in plan order."""
        order, entries = self._order, self._entries
        while self._fresh_cursor < len(order) and not self._is_fresh(entries[order[self._fresh_cursor]]):
            self._fresh_cursor += 1
        for bid in order[self._fresh_cursor:]:
            if self._is_fresh(entries[bid]):
                yield entries[bid].batch

    def has_pool(self, target: Owner) -> bool:
        """True while `target`'s slot pool is open (from `open_pool` to `drop_target`)."""
        return target in self._pools

    def free_slots(self, target: Owner) -> int:
        """Slots of `target`'s pool no batch holds (0 without a pool)."""
        return len(self._pools.get(target, ()))

    def produced_batches(self) -> list[int]:
        """PRODUCED batch ids, oldest produced first (waiting for a drafter)."""
        return list(self._produced)

    def counts(self) -> dict[BatchState, int]:
        """Number of batches in each state (every state present, zeros included)."""
        return dict(self._counts)

    def epoch_progress(self) -> list[dict]:
        """Per epoch, in order: {"epoch", "batches", "committed", "tokens"} (progress bars):
        its planned batches, those fully committed, and its planned tokens."""
        return [{"epoch": e, "batches": total, "committed": self._epoch_committed[e],
                 "tokens": self._epoch_tokens[e]} for e, total in sorted(self._epoch_total.items())]

    def all_committed(self) -> bool:
        """True when every batch in the ledger is committed (vacuously for an empty one)."""
        return self._counts[BatchState.COMMITTED] == len(self._entries)

    def all_consumed(self) -> bool:
        """True when no batch waits for a target or a drafter's copy any more."""
        c = self._counts
        return not (c[BatchState.PENDING] or c[BatchState.LEASED] or c[BatchState.PRODUCED]
                    or c[BatchState.ASSIGNED])

    def history(self) -> list[CommitRecord]:
        """Every commit record, in commit order."""
        return list(self._history)

    def committed_steps(self) -> list[int]:
        """The distinct checkpoint steps with a commit, increasing."""
        return sorted(self._records_by_step)

    def last_committed_step(self) -> int | None:
        """Step of the latest commit (the checkpoint a restarted drafter group resumes)."""
        return max(self._records_by_step, default=None)

    def committed_tokens_by_epoch(self) -> dict[int, int]:
        """Tokens of the committed samples, per epoch: what the checkpoints trained."""
        return dict(self._committed_tokens)

    def committed_tokens(self) -> int:
        """Tokens of every committed sample: the job's trained-and-kept total, whichever
        dispatcher committed them (the one owner of this count)."""
        return sum(self._committed_tokens.values())

    def _record_tokens(self, record: CommitRecord) -> int:
        batch = self._entries[record.batch_id].batch
        samples = set(record.sample_ids)
        return sum(n for s, n in zip(batch.sample_ids, batch.lengths) if s in samples)

    def _count_record(self, record: CommitRecord, sign: int) -> int:
        """Adds (sign 1) or takes back (-1) one commit record in the running totals; its tokens."""
        tokens = self._record_tokens(record)
        epoch = self._entries[record.batch_id].batch.epoch
        self._committed_tokens[epoch] += sign * tokens
        left = self._records_by_step.get(record.step, 0) + sign
        if left:
            self._records_by_step[record.step] = left
        else:
            del self._records_by_step[record.step]
        return tokens

    def audit(self, expected: Mapping[int, Iterable[int] | int] | None = None) -> AuditReport:
        """Check the committed history: each expected sample of each epoch exactly once
        (default: the samples planned in each epoch of this ledger)."""
        if expected is None:
            expected = {}
            for entry in self.entries():
                expected.setdefault(entry.batch.epoch, []).extend(entry.batch.sample_ids)
        return audit_samples(((self._entries[r.batch_id].batch.epoch, s)
                              for r in self._history for s in r.sample_ids), expected)

    # ---- transitions ----------------------------------------------------------------

    def open_pool(self, target: Owner, num_slots: int) -> None:
        """A target registered its slot pool: slots 0 .. num_slots-1, free but for those a
        restored batch holds (none after a dispatcher restart: `requeue_uncommitted`)."""
        if target in self._pools:
            raise ProtocolError(f"target {target!r} already has an open slot pool (drop_target first)")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ProtocolError(f"target {target!r}: a slot pool of {num_slots!r} slots")
        self._pools[target] = collections.deque(s for s in range(num_slots) if (target, s) not in self._slots)

    def lease(self, batch_id: int, target: Owner) -> LeasedWork:
        """PENDING -> LEASED(target, slot), in a free slot of the target's pool. Any pending
        batch may be leased, not only the head."""
        who = f"target {target!r}"
        entry = self._get(batch_id, who, "lease")
        self._expect(entry, BatchState.PENDING, who, "lease")
        if not self._pools.get(target):
            raise ProtocolError(f"{who} may not lease batch {batch_id}: "
                                f"{'no free slot in its pool' if target in self._pools else 'it has no slot pool'}")
        slot = self._pools[target].popleft()
        self._move(entry, BatchState.LEASED)
        entry.target, entry.slot, entry.drafter = target, slot, None
        self._slots[(target, slot)] = batch_id
        entry.leases += 1
        sample_ids, lengths = entry.remaining()
        return LeasedWork(batch_id=batch_id, epoch=entry.batch.epoch, sample_ids=sample_ids, lengths=lengths,
                          padded_len=entry.batch.padded_len, slot=slot)

    def produced(self, batch_id: int, target: Owner, slot: int, num_tokens: int | None = None) -> bool:
        """LEASED(target, slot) -> PRODUCED; True. `num_tokens` (when given) must be the
        lease's. False for the report of a lease taken back meanwhile (`rollback_to`): its
        slot is free again and nothing else changes."""
        who = f"target {target!r}"
        entry = self._get(batch_id, who, "report produced")
        if entry.state is BatchState.LEASED and (entry.target, entry.slot) == (target, slot):
            if num_tokens is not None and num_tokens != entry.remaining_tokens:
                raise ProtocolError(f"{who}: batch {batch_id} has {entry.remaining_tokens} tokens, "
                                    f"reported {num_tokens}")
            self._move(entry, BatchState.PRODUCED)
            self._produced[batch_id] = None
            return True
        if (self._slots.get((target, slot)) == batch_id and (entry.target, entry.slot) != (target, slot)
                and target in self._pools):
            del self._slots[(target, slot)]
            self._pools[target].append(slot)
            return False
        raise ProtocolError(f"{who} may not report batch {batch_id} produced in slot {slot!r}: that lease was not "
                            f"given to it (batch {entry.state.name}, target={entry.target!r}, slot={entry.slot!r})")

    def assign(self, batch_id: int, drafter: Owner) -> int:
        """PRODUCED -> ASSIGNED(drafter, attempt); returns the new attempt number."""
        who = f"drafter {drafter!r}"
        entry = self._get(batch_id, who, "be assigned")
        self._expect(entry, BatchState.PRODUCED, who, "be assigned")
        del self._produced[batch_id]
        self._move(entry, BatchState.ASSIGNED)
        entry.drafter, entry.attempt = drafter, self.next_attempt
        self.next_attempt += 1
        return entry.attempt

    def consumed(self, batch_id: int, drafter: Owner, attempt: int) -> Consumption | None:
        """ASSIGNED(drafter, attempt) -> CONSUMED: the copy is in the drafter's memory.

        None when a group commit of this copy already consumed it (its commit overtook
        this Consumed: two sockets, no order between them)."""
        who = f"drafter {drafter!r}"
        entry = self._get(batch_id, who, "report consumed")
        if entry.drafter == drafter and entry.attempt == attempt and entry.state in (
                BatchState.CONSUMED, BatchState.COMMITTED):
            return None
        self._expect_copy(entry, drafter, attempt, "report consumed")
        self._release_slot(entry)
        self._move(entry, BatchState.CONSUMED)
        entry.orphaned = False
        return Consumption(tokens=entry.remaining_tokens)

    def lost(self, batch_id: int, drafter: Owner, attempt: int) -> None:
        """ASSIGNED(drafter, attempt) -> PENDING: the drafter could not copy it (its target
        died first). Its slot is free again if its pool still lives."""
        entry = self._get(batch_id, f"drafter {drafter!r}", "report lost")
        self._expect_copy(entry, drafter, attempt, "report lost")
        self._release_slot(entry)
        self._to_pending(entry)

    def commit(self, step: int, copies: Iterable[TrainedCopy]) -> CommitResult:
        """Commits the trained samples of each copy at checkpoint `step`, all or none.

        A copy still ASSIGNED (its Consumed not here yet: two sockets, no order between
        them) is consumed first, and its late Consumed is a no-op."""
        copies = list(copies)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ProtocolError(f"commit of {len(copies)} copies at invalid step {step!r}")
        ids = [c.batch_id for c in copies]
        if len(set(ids)) != len(ids):
            raise ProtocolError(f"a commit names a batch twice: {sorted(ids)}")
        for copy in copies:
            entry = self._get(copy.batch_id, f"drafter {copy.drafter!r}", "commit")
            if entry.state is not BatchState.CONSUMED or (entry.drafter, entry.attempt) != (copy.drafter, copy.attempt):
                self._expect_copy(entry, copy.drafter, copy.attempt, "commit")
            if not copy.sample_ids:
                raise ProtocolError(f"batch {copy.batch_id}: a commit of no samples")
            extra = set(copy.sample_ids) - set(entry.remaining()[0])
            if extra or len(set(copy.sample_ids)) != len(copy.sample_ids):
                raise ProtocolError(f"batch {copy.batch_id}: committed samples {sorted(extra) or copy.sample_ids} "
                                    f"are not uncommitted samples of it")
        result = CommitResult()
        for copy in copies:
            entry = self._entries[copy.batch_id]
            if entry.state is BatchState.ASSIGNED:
                self._release_slot(entry)
                self._move(entry, BatchState.CONSUMED)
            entry.done = entry.done | frozenset(copy.sample_ids)
            record = CommitRecord(batch_id=copy.batch_id, step=step, sample_ids=tuple(copy.sample_ids))
            self._history.append(record)
            result.tokens += self._count_record(record, 1)
            if len(entry.done) == len(entry.batch.sample_ids):
                self._move(entry, BatchState.COMMITTED)
                entry.step = step
                self._epoch_committed[entry.batch.epoch] += 1
                result.completed.append(copy.batch_id)
        return result

    # ---- failures -------------------------------------------------------------------

    def drop_target(self, target: Owner) -> list[int]:
        """A target died: its pool closes, its LEASED and PRODUCED batches go back to PENDING;
        its ASSIGNED ones stay with their drafters (a copy may be under way)."""
        self._pools.pop(target, None)
        for key in [k for k in self._slots if k[0] == target]:
            del self._slots[key]
        moved = []
        for entry in self.entries():
            if entry.target != target:
                continue
            if entry.state in (BatchState.LEASED, BatchState.PRODUCED):
                self._release_slot(entry)
                self._to_pending(entry)
                moved.append(entry.batch.batch_id)
            elif entry.state is BatchState.ASSIGNED and not entry.orphaned:
                self._release_slot(entry)
                entry.orphaned = True
        return self._logged(moved, f"target {target!r} dropped")

    def restart_drafters(self) -> tuple[list[int], list[int]]:
        """The drafter group restarts from its last commit: CONSUMED -> PENDING; ASSIGNED ->
        PRODUCED (assigned again to the new group), or PENDING when its target is gone.
        Returns (requeued, to assign again)."""
        requeued, again = [], []
        for entry in self.entries():
            if entry.state is BatchState.CONSUMED or (entry.state is BatchState.ASSIGNED and entry.orphaned):
                self._release_slot(entry)
                self._to_pending(entry)
                requeued.append(entry.batch.batch_id)
            elif entry.state is BatchState.ASSIGNED:
                self._move(entry, BatchState.PRODUCED)
                entry.drafter = None
                self._produced[entry.batch.batch_id] = None
                again.append(entry.batch.batch_id)
        self._logged(requeued, "drafter group restart")
        return requeued, again

    def requeue_uncommitted(self) -> list[int]:
        """Dispatcher-restart rule: every batch not committed -> PENDING."""
        moved = []
        for entry in self.entries():
            if entry.state in IN_FLIGHT:
                self._release_slot(entry)
                self._to_pending(entry)
                moved.append(entry.batch.batch_id)
        return self._logged(moved, "dispatcher restart")

    def rollback_to(self, step: int) -> list[int]:
        """Un-commits every commit after checkpoint `step` (-1: all): the group resumed from
        it because the newer ones are unreadable. A touched batch that is leased or produced
        again (its uncommitted rest only) goes back to pending with all its rest: a produced
        one frees its slot, a leased one keeps it until its target reports it (`produced`).
        No drafter may hold a copy (call it when the new group starts). Returns the batches
        touched."""
        if self._counts[BatchState.ASSIGNED] or self._counts[BatchState.CONSUMED]:
            raise ProtocolError(f"rollback to step {step} while drafters hold copies")
        undone = [r for r in self._history if r.step > step]
        self._history = [r for r in self._history if r.step <= step]
        touched = set()
        for record in undone:
            self._count_record(record, -1)
            entry = self._entries[record.batch_id]
            touched.add(record.batch_id)
            if entry.state is BatchState.COMMITTED:
                self._epoch_committed[entry.batch.epoch] -= 1
                entry.step = None
            if entry.state is BatchState.PRODUCED:
                self._release_slot(entry)
            if entry.state is not BatchState.PENDING:
                self._to_pending(entry)
            entry.done = entry.done - frozenset(record.sample_ids)
        return self._logged(sorted(touched), f"rollback to step {step}")

    # ---- restoring a saved ledger (ledger_file) --------------------------------------

    def restore_entry(self, batch_id: int, *, state: BatchState, target: Owner | None, drafter: Owner | None,
                      slot: int | None, leases: int, attempt: int, orphaned: bool = False) -> None:
        """Sets one entry as saved (before `restore_history`)."""
        entry = self._entries[batch_id]
        self._move(entry, state)
        entry.target, entry.drafter, entry.slot, entry.leases, entry.attempt = target, drafter, slot, leases, attempt
        entry.orphaned = orphaned
        if state is BatchState.PENDING and leases:
            entry.token += 1
            heapq.heappush(self._requeued, (entry.seq, entry.token, batch_id))
        elif state in (BatchState.LEASED, BatchState.PRODUCED, BatchState.ASSIGNED) and not orphaned:
            self._slots[(target, slot)] = batch_id
            if state is BatchState.PRODUCED:
                self._produced[batch_id] = None

    def restore_history(self, records: list[CommitRecord], *, next_attempt: int) -> None:
        """Replays the saved commit records; checks them against the restored states."""
        last_step: dict[int, int] = {}
        for record in records:
            entry = self._entries[record.batch_id]
            last_step[record.batch_id] = record.step
            if entry.done & set(record.sample_ids) or not set(record.sample_ids) <= set(entry.batch.sample_ids):
                raise DataError(f"history: batch {record.batch_id} samples {record.sample_ids} committed twice "
                                f"or not in the batch")
            entry.done = entry.done | frozenset(record.sample_ids)
            self._history.append(record)
            self._count_record(record, 1)
        for entry in self.entries():
            complete = len(entry.done) == len(entry.batch.sample_ids)
            if complete != (entry.state is BatchState.COMMITTED):
                raise DataError(f"batch {entry.batch.batch_id} is {entry.state.name} but the history commits "
                                f"{len(entry.done)} of its {len(entry.batch.sample_ids)} samples")
            if complete:
                entry.step = last_step[entry.batch.batch_id]
                self._epoch_committed[entry.batch.epoch] += 1
        self.next_attempt = max(next_attempt, 1, *(e.attempt + 1 for e in self.entries()))

    # ---- internals ------------------------------------------------------------------

    def _get(self, batch_id: int, sender: str, op: str) -> LedgerEntry:
        entry = self._entries.get(batch_id)
        if entry is None:
            raise ProtocolError(f"{sender} may not {op} unknown batch id {batch_id!r}")
        return entry

    @staticmethod
    def _expect(entry: LedgerEntry, state: BatchState, sender: str, op: str) -> None:
        if entry.state is not state:
            raise ProtocolError(f"{sender} may not {op} batch {entry.batch.batch_id}: it is {entry.state.name} "
                                f"(target={entry.target!r}, drafter={entry.drafter!r}), expected {state.name}")

    def _expect_copy(self, entry: LedgerEntry, drafter: Owner, attempt: int, op: str) -> None:
        """The entry must be ASSIGNED to this drafter under this attempt."""
        if entry.state is not BatchState.ASSIGNED or (entry.drafter, entry.attempt) != (drafter, attempt):
            raise ProtocolError(f"drafter {drafter!r} may not {op} batch {entry.batch.batch_id} attempt "
                                f"{attempt}: it is {entry.state.name} (drafter={entry.drafter!r}, "
                                f"attempt {entry.attempt})")

    def _move(self, entry: LedgerEntry, state: BatchState) -> None:
        self._counts[entry.state] -= 1
        self._counts[state] += 1
        entry.state = state

    def _to_pending(self, entry: LedgerEntry) -> None:
        self._move(entry, BatchState.PENDING)
        entry.target = entry.slot = entry.drafter = None
        entry.orphaned = False
        entry.token += 1
        heapq.heappush(self._requeued, (entry.seq, entry.token, entry.batch.batch_id))

    @staticmethod
    def _is_fresh(entry: LedgerEntry) -> bool:
        return entry.state is BatchState.PENDING and entry.leases == 0 and not entry.done

    def _is_requeued_item(self, token: int, batch_id: int) -> bool:
        entry = self._entries[batch_id]
        return entry.state is BatchState.PENDING and entry.token == token

    def _release_slot(self, entry: LedgerEntry) -> None:
        """The entry's slot goes back to its pool (when it still holds this batch and its
        pool lives: a dropped target's slots went with its pool)."""
        self._produced.pop(entry.batch.batch_id, None)
        key = (entry.target, entry.slot)
        if entry.slot is not None and self._slots.get(key) == entry.batch.batch_id:
            del self._slots[key]
            if (pool := self._pools.get(entry.target)) is not None:
                pool.append(entry.slot)
        entry.slot = None

    @staticmethod
    def _logged(moved: list[int], why: str) -> list[int]:
        if moved:
            head = ", ".join(map(str, moved[:8])) + (", ..." if len(moved) > 8 else "")
            logger.info("%s: %d batches back to pending [%s]", why, len(moved), head)
        return moved
