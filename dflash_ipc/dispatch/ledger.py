"""The exactly-once ledger: every planned batch's state, owner and commit step.

States and who moves a batch between them (the dispatcher calls these methods when the
matching message arrives)::

    PENDING --lease(target)--> LEASED --produced(target, slot)--> PRODUCED
       ^                          |                                  |
       |   requeue_target(t) <----+----------------------------------+
       |                                                   consumed(drafter)
       |                                                             v
       +-- requeue_drafter(d) / requeue_all_uncommitted_consumed -- CONSUMED
                                                                     |
                                                 committed(ids, drafter, step)
                                                                     v
                                                                 COMMITTED (final)

Rules:

* Only the owner moves a batch on: the target that leased it reports it produced, the
  drafter that consumed it commits it. Any other transition (unknown id, wrong state,
  wrong sender, slot already holding another batch) raises ``ProtocolError`` naming the
  batch, its state and the sender, and changes nothing: the dispatcher logs and refuses.
  ``committed`` checks every id first and applies all or none.
* A dead target loses its leased batches and its slot pool, so its LEASED and PRODUCED
  batches return to PENDING. A dead drafter loses what it consumed but has not committed
  (CONSUMED by it); a drafter-group restart from the last checkpoint loses every
  CONSUMED batch. Requeued batches are served before untouched ones, oldest (plan order)
  first, so an epoch does not end with stragglers from its start.
* COMMITTED is final; the committed history (ids in commit order) is what ``audit``
  checks: each sample of each epoch exactly once.

Dispatcher restart rule (``Ledger.load``, ``recover=True``): only COMMITTED survives.
Every LEASED, PRODUCED and CONSUMED batch goes back to PENDING, because nobody can tell
which in-flight work the old dispatcher's peers still hold. Workers re-register and drop
what they held (targets free their slots; drafters discard their local FIFO) and the
drafter group resumes from the checkpoint at ``last_committed_step()``. A drafter may
hold a newer checkpoint whose ``Committed`` the old dispatcher never persisted; it must
discard it, otherwise batches trained into it would be trained again. With that rule the
committed history equals the batches trained into the resumed checkpoint, exactly once.
The rule is correct however rarely the dispatcher saves; saving after each ``committed``
only shortens the rollback. Drafters keep their checkpoints back to the last persisted
commit step (the dispatcher tells them ``last_committed_step()`` when they re-register).

Persistence: one uncompressed ``.npz`` of column arrays (no pickle), written to a temp file
in the same directory, fsynced, then ``os.replace``d over the old file, so a crash at any
point leaves either the old or the new ledger. The immutable batch columns are cached
between saves; a save only rebuilds the small mutable columns.
"""

from __future__ import annotations

import enum
import heapq
import logging
import os
import tempfile
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Mapping, Union

import numpy as np

from dflash_ipc.dispatch.buckets import PlannedBatch
from dflash_ipc.errors import DataError, ProtocolError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
NO_OWNER = -1  # owner/slot/step columns use -1 for "none" on disk

Owner = Union[int, str]
"""A worker as the dispatcher names it: its rank (int) or a name."""


class BatchState(enum.IntEnum):
    """Lifecycle of a planned batch; values are persisted, do not renumber."""

    PENDING = 0
    LEASED = 1
    PRODUCED = 2
    CONSUMED = 3
    COMMITTED = 4


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
    attempts: int = 0
    """Number of leases so far; > 0 while PENDING means requeued."""
    step: int | None = None
    """Checkpoint step of the commit."""
    token: int = field(default=0, repr=False)
    """Queue generation: heap items with another token are stale."""


@dataclass(slots=True)
class AuditReport:
    """Result of ``audit``: per epoch, samples never committed and committed twice+."""

    missing: dict[int, list[int]]
    duplicated: dict[int, dict[int, int]]
    """epoch -> {sample id: times committed} for samples committed more than once."""
    unexpected: dict[int, list[int]]
    """epoch -> committed sample ids that the expectation does not contain."""
    num_committed_batches: int

    @property
    def ok(self) -> bool:
        """True if every expected sample was committed exactly once and nothing else."""
        return not (self.missing or self.duplicated or self.unexpected)


def audit_history(
    committed: Iterable[PlannedBatch], expected: Mapping[int, Iterable[int] | int]
) -> AuditReport:
    """Check a committed history against the expected samples per epoch.

    ``expected`` maps epoch -> sample ids (or an int n meaning ``range(n)``). Epochs that
    appear in the history but not in ``expected`` report all their samples unexpected.
    """
    counts: dict[int, dict[int, int]] = {}
    num_batches = 0
    for batch in committed:
        num_batches += 1
        per_epoch = counts.setdefault(batch.epoch, {})
        for sid in batch.sample_ids:
            per_epoch[sid] = per_epoch.get(sid, 0) + 1
    missing: dict[int, list[int]] = {}
    duplicated: dict[int, dict[int, int]] = {}
    unexpected: dict[int, list[int]] = {}
    for epoch in sorted(set(expected) | set(counts)):
        want = expected.get(epoch, ())
        want_set = set(range(want)) if isinstance(want, int) else set(want)
        got = counts.get(epoch, {})
        if miss := sorted(want_set.difference(got)):
            missing[epoch] = miss
        if dup := {s: n for s, n in sorted(got.items()) if n > 1}:
            duplicated[epoch] = dup
        if extra := sorted(set(got).difference(want_set)):
            unexpected[epoch] = extra
    return AuditReport(
        missing=missing, duplicated=duplicated, unexpected=unexpected,
        num_committed_batches=num_batches,
    )


class Ledger:
    """State of every planned batch; the single source of truth for exactly-once."""

    def __init__(self) -> None:
        self._entries: dict[int, LedgerEntry] = {}
        self._order: list[int] = []  # batch ids in seq order
        # Requeued PENDING batches as (seq, token, batch_id), oldest first; items whose
        # token no longer matches the entry are stale and skipped lazily.
        self._requeued: list[tuple[int, int, int]] = []
        # Untouched PENDING batches (attempts == 0) never come back once leased, so a
        # cursor over plan order finds the next one in amortized O(1).
        self._fresh_cursor = 0
        self._counts = {s: 0 for s in BatchState}
        self._epoch_total: dict[int, int] = {}
        self._epoch_committed: dict[int, int] = {}
        self._slots: dict[tuple[Owner, int], int] = {}  # (target, slot) -> PRODUCED batch
        self._produced: dict[int, None] = {}  # PRODUCED ids, insertion = produce order
        self._history: list[int] = []  # committed ids in commit order
        self._static_cache: dict[str, np.ndarray] | None = None

    # ---- planning -------------------------------------------------------------------

    def add_epoch(self, batches: Iterable[PlannedBatch]) -> None:
        """Append planned batches (PENDING, served in the given order after older ones).

        Raises DataError on a batch id already in the ledger (or repeated); adds nothing.
        """
        batches = list(batches)
        seen: set[int] = set()
        for b in batches:
            if b.batch_id in self._entries or b.batch_id in seen:
                raise DataError(
                    f"add_epoch: batch id {b.batch_id} (epoch {b.epoch}) is already in the "
                    f"ledger; plan each epoch with first_batch_id after the previous one"
                )
            seen.add(b.batch_id)
        for b in batches:
            entry = LedgerEntry(batch=b, seq=len(self._order))
            self._entries[b.batch_id] = entry
            self._order.append(b.batch_id)
            self._counts[BatchState.PENDING] += 1
            self._epoch_total[b.epoch] = self._epoch_total.get(b.epoch, 0) + 1
            self._epoch_committed.setdefault(b.epoch, 0)
        self._static_cache = None

    # ---- queries --------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, batch_id: object) -> bool:
        return batch_id in self._entries

    def entry(self, batch_id: int) -> LedgerEntry:
        """A copy of the entry of ``batch_id`` (ProtocolError if unknown)."""
        return replace(self._get(batch_id, sender="query", op="read"))

    def next_pending(self) -> PlannedBatch | None:
        """The batch the next lease should take (requeued first, oldest first), or None."""
        heap = self._requeued
        while heap:
            _, token, bid = heap[0]
            if self._is_requeued_item(bid, token):
                return self._entries[bid].batch
            heapq.heappop(heap)
        order, entries = self._order, self._entries
        while self._fresh_cursor < len(order):
            entry = entries[order[self._fresh_cursor]]
            if entry.state is BatchState.PENDING and entry.attempts == 0:
                return entry.batch
            self._fresh_cursor += 1
        return None

    def pending_batches(self) -> Iterator[PlannedBatch]:
        """Every PENDING batch in serving order (lazy; do not change the ledger meanwhile)."""
        for _, token, bid in sorted(self._requeued):
            if self._is_requeued_item(bid, token):
                yield self._entries[bid].batch
        for bid in self._order[self._fresh_cursor :]:
            entry = self._entries[bid]
            if entry.state is BatchState.PENDING and entry.attempts == 0:
                yield entry.batch

    def next_produced(self, targets: Iterable[Owner] | None = None) -> int | None:
        """Oldest PRODUCED batch, optionally only among batches of ``targets`` (a node)."""
        allowed = None if targets is None else set(targets)
        for bid in self._produced:
            if allowed is None or self._entries[bid].target in allowed:
                return bid
        return None

    def counts(self) -> dict[BatchState, int]:
        """Number of batches in each state (every state present, zeros included)."""
        return dict(self._counts)

    def is_epoch_done(self, epoch: int) -> bool:
        """True when every batch of ``epoch`` is committed (False for an unknown epoch)."""
        total = self._epoch_total.get(epoch)
        return total is not None and self._epoch_committed[epoch] == total

    def epoch_progress(self) -> list[dict]:
        """Per epoch, in order: {"epoch", "batches", "committed"} (progress bars, ETA)."""
        return [{"epoch": e, "batches": total, "committed": self._epoch_committed[e]}
                for e, total in sorted(self._epoch_total.items())]

    def all_committed(self) -> bool:
        """True when every batch in the ledger is committed (vacuously for an empty one)."""
        return self._counts[BatchState.COMMITTED] == len(self._entries)

    def history(self) -> list[int]:
        """Committed batch ids in commit order."""
        return list(self._history)

    def last_committed_step(self) -> int | None:
        """Step of the latest commit (the checkpoint a restarted drafter group resumes)."""
        return self._entries[self._history[-1]].step if self._history else None

    def audit(self, expected: Mapping[int, Iterable[int] | int]) -> AuditReport:
        """Check the committed history: each expected sample of each epoch exactly once."""
        return audit_history((self._entries[b].batch for b in self._history), expected)

    # ---- transitions ----------------------------------------------------------------

    def lease(self, batch_id: int, target: Owner) -> PlannedBatch:
        """PENDING -> LEASED(target). Any pending batch may be leased, not only the head."""
        entry = self._get(batch_id, sender=f"target {target!r}", op="lease")
        self._expect(entry, BatchState.PENDING, sender=f"target {target!r}", op="lease")
        self._move(entry, BatchState.LEASED)
        entry.target, entry.slot, entry.drafter = target, None, None
        entry.attempts += 1
        return entry.batch

    def take(self, target: Owner) -> PlannedBatch | None:
        """Lease ``next_pending()`` to ``target``; None if nothing is pending."""
        batch = self.next_pending()
        return None if batch is None else self.lease(batch.batch_id, target)

    def produced(self, batch_id: int, target: Owner, slot: int) -> None:
        """LEASED(target) -> PRODUCED(target, slot); the slot must not hold another batch."""
        sender = f"target {target!r}"
        entry = self._get(batch_id, sender=sender, op="report produced")
        self._expect(entry, BatchState.LEASED, sender=sender, op="report produced")
        self._expect_owner(entry, entry.target, target, sender=sender, op="report produced")
        if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
            raise ProtocolError(f"batch {batch_id}: {sender} reported invalid slot {slot!r}")
        holder = self._slots.get((target, slot))
        if holder is not None:
            raise ProtocolError(
                f"batch {batch_id}: {sender} reported slot {slot}, which still holds "
                f"PRODUCED batch {holder}"
            )
        self._move(entry, BatchState.PRODUCED)
        entry.slot = slot
        self._slots[(target, slot)] = batch_id
        self._produced[batch_id] = None

    def consumed(self, batch_id: int, drafter: Owner) -> None:
        """PRODUCED -> CONSUMED(drafter); the target's slot is free again."""
        sender = f"drafter {drafter!r}"
        entry = self._get(batch_id, sender=sender, op="report consumed")
        self._expect(entry, BatchState.PRODUCED, sender=sender, op="report consumed")
        self._release_slot(entry)
        self._move(entry, BatchState.CONSUMED)
        entry.drafter = drafter

    def committed(
        self, batch_ids: Iterable[int], drafter: Owner, step: int,
        *, group: Iterable[Owner] | None = None,
    ) -> None:
        """CONSUMED -> COMMITTED(step) for all ``batch_ids`` or none.

        Each batch must have been consumed by ``drafter``, or, when rank 0 commits for the
        whole drafter group, by a member of ``group``.
        """
        sender = f"drafter {drafter!r}"
        ids = list(batch_ids)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ProtocolError(f"{sender} committed {len(ids)} batches at invalid step {step!r}")
        owners = {drafter} if group is None else set(group) | {drafter}
        if len(set(ids)) != len(ids):
            raise ProtocolError(f"{sender} committed a batch id twice in one commit: {ids}")
        entries = []
        for bid in ids:
            entry = self._get(bid, sender=sender, op="commit")
            self._expect(entry, BatchState.CONSUMED, sender=sender, op="commit")
            if entry.drafter not in owners:
                raise ProtocolError(
                    f"{sender} may not commit batch {bid}: it is CONSUMED by "
                    f"{entry.drafter!r}, not by the committing drafter or its group "
                    f"{sorted(owners, key=str)}"
                )
            entries.append(entry)
        for entry in entries:
            self._move(entry, BatchState.COMMITTED)
            entry.step = step
            self._epoch_committed[entry.batch.epoch] += 1
            self._history.append(entry.batch.batch_id)

    # ---- failures -------------------------------------------------------------------

    def requeue_target(self, target: Owner) -> list[int]:
        """A target died: its LEASED and PRODUCED batches go back to PENDING."""
        return self._requeue(
            lambda e: e.state in (BatchState.LEASED, BatchState.PRODUCED) and e.target == target
        )

    def requeue_drafter(self, drafter: Owner) -> list[int]:
        """A drafter died: the batches it CONSUMED but nobody committed go back to PENDING."""
        return self._requeue(lambda e: e.state is BatchState.CONSUMED and e.drafter == drafter)

    def requeue_all_uncommitted_consumed(self) -> list[int]:
        """The drafter group restarts from its last checkpoint: every CONSUMED -> PENDING."""
        return self._requeue(lambda e: e.state is BatchState.CONSUMED)

    def requeue_uncommitted(self) -> list[int]:
        """Dispatcher-restart rule: every LEASED, PRODUCED, CONSUMED batch -> PENDING."""
        return self._requeue(
            lambda e: e.state in (BatchState.LEASED, BatchState.PRODUCED, BatchState.CONSUMED)
        )

    def _requeue(self, pred) -> list[int]:
        moved = []
        for bid in self._order:
            entry = self._entries[bid]
            if pred(entry):
                if entry.state is BatchState.PRODUCED:
                    self._release_slot(entry)
                self._move(entry, BatchState.PENDING)
                entry.target = entry.slot = entry.drafter = None
                self._push(entry)
                moved.append(bid)
        if moved:
            logger.info("requeued %d batches: %s", len(moved), _short(moved))
        return moved

    # ---- internals ------------------------------------------------------------------

    def _get(self, batch_id: int, *, sender: str, op: str) -> LedgerEntry:
        entry = self._entries.get(batch_id)
        if entry is None:
            raise ProtocolError(f"{sender} may not {op} unknown batch id {batch_id!r}")
        return entry

    @staticmethod
    def _expect(entry: LedgerEntry, state: BatchState, *, sender: str, op: str) -> None:
        if entry.state is not state:
            raise ProtocolError(
                f"{sender} may not {op} batch {entry.batch.batch_id}: it is "
                f"{entry.state.name} (target={entry.target!r}, drafter={entry.drafter!r}), "
                f"expected {state.name}"
            )

    @staticmethod
    def _expect_owner(entry: LedgerEntry, owner, claimant, *, sender: str, op: str) -> None:
        if owner != claimant:
            raise ProtocolError(
                f"{sender} may not {op} batch {entry.batch.batch_id}: it is "
                f"{entry.state.name} owned by {owner!r}"
            )

    def _move(self, entry: LedgerEntry, state: BatchState) -> None:
        self._counts[entry.state] -= 1
        self._counts[state] += 1
        entry.state = state

    def _push(self, entry: LedgerEntry) -> None:
        """Queue a requeued (attempts > 0) PENDING batch."""
        entry.token += 1
        heapq.heappush(self._requeued, (entry.seq, entry.token, entry.batch.batch_id))

    def _is_requeued_item(self, batch_id: int, token: int) -> bool:
        entry = self._entries[batch_id]
        return entry.state is BatchState.PENDING and entry.token == token

    def _release_slot(self, entry: LedgerEntry) -> None:
        self._slots.pop((entry.target, entry.slot), None)
        self._produced.pop(entry.batch.batch_id, None)
        entry.slot = None

    # ---- persistence ----------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write the ledger atomically (temp file in the same dir, fsync, os.replace)."""
        path = os.fspath(path)
        arrays = {**self._static_arrays(), **self._dynamic_arrays()}
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".ledger-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                _write_npz(f, arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        _fsync_dir(directory)

    @classmethod
    def load(cls, path: str | os.PathLike, *, recover: bool = True) -> "Ledger":
        """Read a saved ledger; with ``recover`` apply the dispatcher-restart rule."""
        path = os.fspath(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read ledger {path}: {exc}") from exc
        version = int(data.get("format_version", np.array(-1)))
        if version != FORMAT_VERSION:
            raise DataError(
                f"ledger {path}: format_version {version}, this code reads {FORMAT_VERSION}"
            )
        try:
            ledger = cls._from_arrays(data)
        except (KeyError, IndexError, ValueError, DataError) as exc:
            raise DataError(f"ledger {path} is inconsistent or truncated: {exc!r}") from exc
        if recover:
            moved = ledger.requeue_uncommitted()
            logger.info("loaded ledger %s; %d in-flight batches back to pending", path, len(moved))
        return ledger

    def _static_arrays(self) -> dict[str, np.ndarray]:
        if self._static_cache is None:
            batches = [self._entries[b].batch for b in self._order]
            sizes = np.fromiter((len(b.sample_ids) for b in batches), np.int64, len(batches))
            offsets = np.zeros(len(batches) + 1, dtype=np.int64)
            np.cumsum(sizes, out=offsets[1:])
            flat_ids = np.fromiter(
                (s for b in batches for s in b.sample_ids), np.int64, int(offsets[-1]))
            flat_len = np.fromiter(
                (n for b in batches for n in b.lengths), np.int64, int(offsets[-1]))
            self._static_cache = {
                "format_version": np.array(FORMAT_VERSION, dtype=np.int64),
                "batch_id": np.array([b.batch_id for b in batches], dtype=np.int64),
                "epoch": np.array([b.epoch for b in batches], dtype=np.int64),
                "bucket": np.array([b.bucket for b in batches], dtype=np.int64),
                "padded_len": np.array([b.padded_len for b in batches], dtype=np.int64),
                "offsets": offsets,
                "sample_ids": _narrow(flat_ids),
                "lengths": _narrow(flat_len),
            }
        return self._static_cache

    def _dynamic_arrays(self) -> dict[str, np.ndarray]:
        names: dict[Owner, int] = {}

        def name_index(name: Owner | None) -> int:
            return NO_OWNER if name is None else names.setdefault(name, len(names))

        rows = [self._entries[b] for b in self._order]
        return {
            "state": np.array([int(e.state) for e in rows], dtype=np.int8),
            "target": np.array([name_index(e.target) for e in rows], dtype=np.int32),
            "drafter": np.array([name_index(e.drafter) for e in rows], dtype=np.int32),
            "slot": np.array([_or_none(e.slot) for e in rows], dtype=np.int64),
            "attempts": np.array([e.attempts for e in rows], dtype=np.int64),
            "step": np.array([_or_none(e.step) for e in rows], dtype=np.int64),
            "names": np.array([str(n) for n in names] or [""], dtype=str),
            "name_is_int": np.array([isinstance(n, int) for n in names] or [False]),
            "history": np.array(self._history, dtype=np.int64),
        }

    @classmethod
    def _from_arrays(cls, d: dict[str, np.ndarray]) -> "Ledger":
        ledger = cls()
        offsets, flat_ids, flat_len = d["offsets"], d["sample_ids"].tolist(), d["lengths"].tolist()
        batches = [
            PlannedBatch(
                batch_id=bid, epoch=ep, bucket=bk, padded_len=pl,
                sample_ids=tuple(flat_ids[lo:hi]), lengths=tuple(flat_len[lo:hi]),
            )
            for bid, ep, bk, pl, lo, hi in zip(
                d["batch_id"].tolist(), d["epoch"].tolist(), d["bucket"].tolist(),
                d["padded_len"].tolist(), offsets[:-1].tolist(), offsets[1:].tolist(),
            )
        ]
        ledger.add_epoch(batches)
        names = [int(n) if is_int else n
                 for n, is_int in zip(d["names"].tolist(), d["name_is_int"].tolist())]
        columns = zip(
            d["state"].tolist(), d["target"].tolist(), d["drafter"].tolist(),
            d["slot"].tolist(), d["attempts"].tolist(), d["step"].tolist(),
        )
        for bid, (state, tgt, dft, slot, attempts, step) in zip(ledger._order, columns):
            entry = ledger._entries[bid]
            ledger._move(entry, BatchState(state))
            entry.target = None if tgt == NO_OWNER else names[tgt]
            entry.drafter = None if dft == NO_OWNER else names[dft]
            entry.slot = None if slot == NO_OWNER else slot
            entry.attempts, entry.step = attempts, (None if step == NO_OWNER else step)
            if entry.state is BatchState.PENDING and entry.attempts:
                ledger._push(entry)
            elif entry.state is BatchState.PRODUCED:
                ledger._slots[(entry.target, entry.slot)] = bid
                ledger._produced[bid] = None
            elif entry.state is BatchState.COMMITTED:
                ledger._epoch_committed[entry.batch.epoch] += 1
        ledger._history = d["history"].tolist()
        num_committed = ledger._counts[BatchState.COMMITTED]
        if len(ledger._history) != num_committed or any(
            ledger._entries[b].state is not BatchState.COMMITTED for b in ledger._history
        ):
            raise DataError(
                f"history lists {len(ledger._history)} batches but {num_committed} are COMMITTED"
            )
        return ledger


def _write_npz(f, arrays: dict[str, np.ndarray]) -> None:
    """The one place bytes are written; a test makes it fail to simulate a crash."""
    np.savez(f, **arrays)


def _fsync_dir(directory: str) -> None:
    """Persist the rename itself (POSIX); skipped where directories cannot be fsynced."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _narrow(values: np.ndarray) -> np.ndarray:
    """Smallest of int16/int32/int64 that holds every value: fewer bytes to write and fsync."""
    for dtype in (np.int16, np.int32):
        info = np.iinfo(dtype)
        if values.size == 0 or (values.min() >= info.min and values.max() <= info.max):
            return values.astype(dtype)
    return values


def _or_none(value: int | None) -> int:
    return NO_OWNER if value is None else value


def _short(ids: list[int], limit: int = 8) -> str:
    head = ", ".join(map(str, ids[:limit]))
    return f"[{head}{', ...' if len(ids) > limit else ''}]"
