"""Tests for dflash_ipc.dispatch.ledger: state machine, requeue, persistence, audit."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from dflash_ipc.dispatch import ledger as ledger_mod
from dflash_ipc.dispatch.buckets import BucketSpec, PlannedBatch, plan_epochs
from dflash_ipc.dispatch.ledger import BatchState, Ledger, audit_history
from dflash_ipc.errors import DataError, ProtocolError

S = BatchState


def make_batches(num: int, *, epoch: int = 0, first_id: int = 0, per_batch: int = 2):
    """``num`` batches covering samples 0..num*per_batch-1 of ``epoch``."""
    return [
        PlannedBatch(
            batch_id=first_id + i, epoch=epoch, bucket=i % 3,
            sample_ids=tuple(range(i * per_batch, (i + 1) * per_batch)),
            lengths=(5,) * per_batch, padded_len=8,
        )
        for i in range(num)
    ]


def snapshot(led: Ledger):
    """Everything observable about a ledger, for 'nothing changed' checks."""
    return (
        led.counts(),
        [led.entry(b) for b in sorted(led._entries)],
        [b.batch_id for b in led.pending_batches()],
        led.history(),
        led.next_produced(),
    )


def run_to(led: Ledger, batch_id: int, state: BatchState, *, target=0, slot=None, drafter=0):
    """Drive a PENDING batch forward to ``state``."""
    if state >= S.LEASED:
        led.lease(batch_id, target)
    if state >= S.PRODUCED:
        led.produced(batch_id, target, batch_id if slot is None else slot)
    if state >= S.CONSUMED:
        led.consumed(batch_id, drafter)
    if state >= S.COMMITTED:
        led.committed([batch_id], drafter, step=1)


def test_happy_path_two_epochs():
    led = Ledger()
    led.add_epoch(make_batches(4, epoch=0))
    led.add_epoch(make_batches(3, epoch=1, first_id=4))
    assert led.counts()[S.PENDING] == 7 and not led.is_epoch_done(0)
    step = 0
    while (batch := led.take(target="t0")) is not None:
        assert led.entry(batch.batch_id).state is S.LEASED
        led.produced(batch.batch_id, "t0", slot=0)
        assert led.next_produced() == batch.batch_id
        led.consumed(batch.batch_id, "d1")
        step += 1
        led.committed([batch.batch_id], "d1", step=step)
        entry = led.entry(batch.batch_id)
        assert (entry.state, entry.target, entry.slot, entry.drafter, entry.step, entry.attempts) == (
            S.COMMITTED, "t0", None, "d1", step, 1)
    assert led.is_epoch_done(0) and led.is_epoch_done(1) and not led.is_epoch_done(2)
    assert led.all_committed() and led.history() == list(range(7))
    assert led.last_committed_step() == 7
    assert led.counts() == {S.PENDING: 0, S.LEASED: 0, S.PRODUCED: 0, S.CONSUMED: 0, S.COMMITTED: 7}
    assert led.audit({0: 8, 1: range(6)}).ok


def test_committed_applies_many_ids_and_group_commit():
    led = Ledger()
    led.add_epoch(make_batches(4))
    for b, drafter in zip(range(4), [0, 1, 2, 0]):
        run_to(led, b, S.CONSUMED, drafter=drafter)
    with pytest.raises(ProtocolError, match="batch 1.*CONSUMED by 1"):
        led.committed([0, 1], 0, step=5)
    assert led.counts()[S.COMMITTED] == 0
    led.committed([0, 1, 2], 0, step=5, group=[0, 1, 2])
    assert led.history() == [0, 1, 2] and led.counts()[S.CONSUMED] == 1


ILLEGAL = [
    # (setup: batch id -> state to drive to, operation, expected message fragment)
    ({}, lambda l: l.lease(99, 0), "unknown batch id 99"),
    ({0: S.LEASED}, lambda l: l.lease(0, 1), "batch 0: it is LEASED"),
    ({0: S.COMMITTED}, lambda l: l.lease(0, 0), "it is COMMITTED"),
    ({}, lambda l: l.produced(0, 0, 0), "it is PENDING"),
    ({0: S.LEASED}, lambda l: l.produced(0, 1, 0), "LEASED owned by 0"),
    ({0: S.LEASED}, lambda l: l.produced(0, 0, -1), "invalid slot"),
    ({0: S.PRODUCED, 1: S.LEASED}, lambda l: l.produced(1, 0, 0), "slot 0, which still holds"),
    ({0: S.PRODUCED}, lambda l: l.produced(0, 0, 1), "it is PRODUCED"),
    ({0: S.LEASED}, lambda l: l.consumed(0, 0), "it is LEASED"),
    ({0: S.CONSUMED}, lambda l: l.consumed(0, 1), "it is CONSUMED"),
    ({}, lambda l: l.consumed(42, 0), "unknown batch id 42"),
    ({0: S.PRODUCED}, lambda l: l.committed([0], 0, 1), "it is PRODUCED"),
    ({0: S.CONSUMED}, lambda l: l.committed([0], 1, 1), "CONSUMED by 0"),
    ({0: S.CONSUMED, 1: S.CONSUMED}, lambda l: l.committed([0, 1, 2], 0, 1), "batch 2: it is PENDING"),
    ({0: S.CONSUMED}, lambda l: l.committed([0, 0], 0, 1), "twice"),
    ({0: S.CONSUMED}, lambda l: l.committed([0], 0, -3), "invalid step"),
    ({0: S.COMMITTED}, lambda l: l.committed([0], 0, 2), "it is COMMITTED"),
    ({0: S.CONSUMED}, lambda l: l.committed([0, 7], 0, 1), "unknown batch id 7"),
]


@pytest.mark.parametrize("setup,op,fragment", ILLEGAL)
def test_illegal_transitions_are_refused_without_change(setup, op, fragment):
    led = Ledger()
    led.add_epoch(make_batches(4))
    for batch_id, state in setup.items():
        run_to(led, batch_id, state, slot=0 if batch_id == 0 else 1)
    before = snapshot(led)
    with pytest.raises(ProtocolError, match=fragment):
        op(led)
    assert snapshot(led) == before


def test_add_epoch_refuses_duplicate_ids_atomically():
    led = Ledger()
    led.add_epoch(make_batches(3))
    with pytest.raises(DataError, match="batch id 2"):
        led.add_epoch(make_batches(3, first_id=2))
    with pytest.raises(DataError, match="batch id 5"):
        led.add_epoch(make_batches(1, first_id=5) * 2)
    assert len(led) == 3


def test_requeue_target_returns_leased_and_produced_only_of_that_target():
    led = Ledger()
    led.add_epoch(make_batches(8))
    run_to(led, 0, S.LEASED, target=0)
    run_to(led, 1, S.PRODUCED, target=0, slot=3)
    run_to(led, 2, S.CONSUMED, target=0, slot=4)  # already copied: survives the target
    run_to(led, 3, S.PRODUCED, target=1, slot=3)
    run_to(led, 4, S.LEASED, target=1)
    assert led.requeue_target(0) == [0, 1]
    assert led.entry(1).slot is None and led.entry(1).attempts == 1
    assert led.entry(2).state is S.CONSUMED and led.entry(3).state is S.PRODUCED
    # The dead target's late report is refused; its old slot number is free again.
    with pytest.raises(ProtocolError):
        led.produced(0, 0, 3)
    # Requeued batches come first, oldest first; then untouched ones in plan order.
    assert [b.batch_id for b in led.pending_batches()] == [0, 1, 5, 6, 7]
    assert led.take(2).batch_id == 0 and led.entry(0).attempts == 2
    led.produced(0, 2, 3)
    assert led.next_produced() == 3 and led.next_produced(targets=[2]) == 0
    assert led.next_produced(targets=[9]) is None


def test_requeue_drafter_and_group_restart():
    led = Ledger()
    led.add_epoch(make_batches(6))
    for b, drafter in zip(range(5), [0, 1, 0, 1, 0]):
        run_to(led, b, S.CONSUMED, drafter=drafter)
    led.committed([0], 0, step=1)
    assert led.requeue_drafter(0) == [2, 4]
    assert led.entry(0).state is S.COMMITTED
    assert led.requeue_all_uncommitted_consumed() == [1, 3]
    assert led.next_pending().batch_id == 1
    assert [b.batch_id for b in led.pending_batches()] == [1, 2, 3, 4, 5]
    with pytest.raises(ProtocolError):  # a late commit from a drafter declared dead
        led.committed([2], 0, step=2)
    assert led.requeue_drafter(5) == [] and led.requeue_target("nobody") == []


def test_lease_out_of_order_then_requeue_keeps_queue_consistent():
    led = Ledger()
    led.add_epoch(make_batches(5))
    led.lease(3, 0)  # not the head
    assert led.next_pending().batch_id == 0
    led.requeue_target(0)
    led.lease(3, 1)
    led.requeue_target(1)
    served = [led.take(0).batch_id for _ in range(5)]
    assert served == [3, 0, 1, 2, 4] and led.take(0) is None


def populated_ledger() -> Ledger:
    led = Ledger()
    lengths = np.random.default_rng(0).integers(1, 300, size=200)
    spec = BucketSpec(boundaries=(64, 128, 256, 512), token_budget=1024)
    for batches in plan_epochs(lengths, spec, seed=1, num_epochs=2):
        led.add_epoch(batches)
    for b in range(12):
        run_to(led, b, S.CONSUMED, target=b % 2, drafter="d0" if b % 3 else 1)
    led.committed([0, 3, 6, 9], 1, step=4)
    led.committed([1, 2], "d0", step=5)
    run_to(led, 20, S.LEASED, target="t-x")
    run_to(led, 21, S.PRODUCED, target=1, slot=40)
    run_to(led, 22, S.PRODUCED, target=0, slot=41)
    led.requeue_target(0)  # 22 and the leased ones of target 0 go back: attempts > 0
    return led


def test_save_load_round_trip_exact(tmp_path):
    led = populated_ledger()
    path = tmp_path / "ledger.npz"
    led.save(path)
    back = Ledger.load(path, recover=False)
    assert snapshot(back) == snapshot(led)
    assert back.last_committed_step() == 5 and back.history() == led.history()
    # The restored ledger keeps working, including the slot bookkeeping.
    with pytest.raises(ProtocolError, match="still holds"):
        back.produced(back.take(1).batch_id, 1, 40)
    assert os.listdir(tmp_path) == ["ledger.npz"]


def test_load_with_recover_keeps_only_committed(tmp_path):
    led = populated_ledger()
    led.save(tmp_path / "l")
    back = Ledger.load(tmp_path / "l")
    counts = back.counts()
    assert counts[S.COMMITTED] == 6 and counts[S.PENDING] == len(back) - 6
    assert back.history() == led.history()
    served = [back.take(0).batch_id for _ in range(len(back) - 6)]
    assert sorted(served) == sorted(set(range(len(back))) - set(led.history()))


def test_crash_mid_save_leaves_previous_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "ledger.npz"
    led = populated_ledger()
    led.save(path)
    before = path.read_bytes()
    led.committed([4, 5], "d0", step=9)

    def crash(f, arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(ledger_mod, "_write_npz", crash)
    with pytest.raises(OSError, match="disk full"):
        led.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ledger.npz"]
    assert Ledger.load(path, recover=False).last_committed_step() == 5


def test_load_rejects_corrupt_and_foreign_files(tmp_path):
    (tmp_path / "junk").write_bytes(b"not a ledger")
    with pytest.raises(DataError, match="junk"):
        Ledger.load(tmp_path / "junk")
    np.savez(tmp_path / "old.npz", format_version=np.array(0))
    with pytest.raises(DataError, match="format_version 0"):
        Ledger.load(tmp_path / "old.npz")


def test_audit_reports_missing_duplicated_and_unexpected():
    b = lambda bid, epoch, ids: PlannedBatch(  # noqa: E731
        batch_id=bid, epoch=epoch, bucket=0, sample_ids=ids, lengths=(1,) * len(ids), padded_len=8)
    history = [b(0, 0, (0, 1)), b(1, 0, (1, 2)), b(2, 1, (0, 9)), b(3, 2, (5,))]
    report = audit_history(history, {0: 4, 1: [0, 1]})
    assert not report.ok
    assert report.missing == {0: [3], 1: [1]}
    assert report.duplicated == {0: {1: 2}}
    assert report.unexpected == {1: [9], 2: [5]}
    assert report.num_committed_batches == 4
    assert audit_history(history[:1], {0: [0, 1]}).ok


def test_ledger_audit_sees_uncommitted_samples_as_missing():
    led = Ledger()
    led.add_epoch(make_batches(3))
    run_to(led, 0, S.COMMITTED)
    run_to(led, 2, S.CONSUMED)
    report = led.audit({0: 6})
    assert report.missing == {0: [2, 3, 4, 5]} and not report.duplicated


class Model:
    """The specification, written the obvious way: a dict of states and a sort."""

    def __init__(self, num: int):
        self.rows = {b: dict(state=S.PENDING, target=None, slot=None, drafter=None,
                             attempts=0, seq=b) for b in range(num)}
        self.history: list[int] = []

    def pending_order(self) -> list[int]:
        rows = [(r["attempts"] == 0, r["seq"], b) for b, r in self.rows.items()
                if r["state"] is S.PENDING]
        return [b for _, _, b in sorted(rows)]

    def apply(self, op: str, args: tuple):
        """Returns the expected result, or ProtocolError if the op must be refused."""
        rows = self.rows
        if op in ("lease", "produced", "consumed") and args[0] not in rows:
            return ProtocolError
        if op == "lease":
            b, t = args
            if rows[b]["state"] is not S.PENDING:
                return ProtocolError
            rows[b].update(state=S.LEASED, target=t, attempts=rows[b]["attempts"] + 1)
            return b
        elif op == "produced":
            b, t, slot = args
            busy = any(r["state"] is S.PRODUCED and (r["target"], r["slot"]) == (t, slot)
                       for r in rows.values())
            if rows[b]["state"] is not S.LEASED or rows[b]["target"] != t or busy:
                return ProtocolError
            rows[b].update(state=S.PRODUCED, slot=slot)
        elif op == "consumed":
            b, d = args
            if rows[b]["state"] is not S.PRODUCED:
                return ProtocolError
            rows[b].update(state=S.CONSUMED, drafter=d, slot=None)
        elif op == "committed":
            ids, d, step = args
            if len(set(ids)) != len(ids) or any(
                    b not in rows or rows[b]["state"] is not S.CONSUMED or rows[b]["drafter"] != d
                    for b in ids):
                return ProtocolError
            for b in ids:
                rows[b].update(state=S.COMMITTED, step=step)
            self.history += ids
        else:
            states = {"requeue_target": (S.LEASED, S.PRODUCED), "requeue_drafter": (S.CONSUMED,),
                      "requeue_all_uncommitted_consumed": (S.CONSUMED,),
                      "requeue_uncommitted": (S.LEASED, S.PRODUCED, S.CONSUMED)}[op]
            key = {"requeue_target": "target", "requeue_drafter": "drafter"}.get(op)
            moved = [b for b, r in sorted(rows.items()) if r["state"] in states
                     and (key is None or r[key] == args[0])]
            for b in moved:
                rows[b].update(state=S.PENDING, target=None, slot=None, drafter=None)
            return moved
        return None


def random_op(rng: random.Random, model: Model, num: int):
    """Mostly plausible operations (so batches get far), some wrong ones (to be refused)."""
    pick = lambda: rng.randrange(num + 2)  # noqa: E731  (ids num, num+1 are unknown)
    in_state = lambda s: [b for b, r in model.rows.items() if r["state"] is s]  # noqa: E731
    plausible = rng.random() < 0.8
    roll = rng.random()
    if roll < 0.25:
        pending = model.pending_order()
        b = pending[0] if pending and plausible else pick()
        return "lease", (b, rng.randrange(3))
    if roll < 0.5:
        leased = in_state(S.LEASED)
        if leased and plausible:
            b = rng.choice(leased)
            return "produced", (b, model.rows[b]["target"], rng.randrange(4))
        return "produced", (pick(), rng.randrange(3), rng.randrange(-1, 4))
    if roll < 0.72:
        produced = in_state(S.PRODUCED)
        b = rng.choice(produced) if produced and plausible else pick()
        return "consumed", (b, rng.randrange(2))
    if roll < 0.8:
        drafter = rng.randrange(2)
        mine = [b for b in in_state(S.CONSUMED) if model.rows[b]["drafter"] == drafter]
        ids = rng.sample(mine, min(len(mine), rng.randrange(1, 4)))
        if not plausible:
            ids.append(pick())
        return "committed", (ids, drafter, rng.randrange(100))
    op = rng.choice(["requeue_target", "requeue_drafter", "requeue_all_uncommitted_consumed",
                     "requeue_uncommitted"])
    args = {"requeue_target": (rng.randrange(3),), "requeue_drafter": (rng.randrange(2),)}
    return op, args.get(op, ())


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_state_machine_matches_model_under_random_operations(seed, tmp_path):
    rng = random.Random(seed)
    num = 40
    led, model = Ledger(), Model(num)
    led.add_epoch(make_batches(num))
    for i in range(1500):
        op, args = random_op(rng, model, num)
        expected = model.apply(op, args)
        if expected is ProtocolError:
            before = snapshot(led)
            with pytest.raises(ProtocolError):
                getattr(led, op)(*args)
            assert snapshot(led) == before, (i, op, args)
        else:
            result = getattr(led, op)(*args)
            if isinstance(result, PlannedBatch):
                result = result.batch_id
            assert result == expected, (i, op, args)
        for b, row in model.rows.items():
            e = led.entry(b)
            assert (e.state, e.target, e.slot, e.drafter, e.attempts) == (
                row["state"], row["target"], row["slot"], row["drafter"], row["attempts"]), (i, op)
        assert [b.batch_id for b in led.pending_batches()] == model.pending_order()
        assert led.history() == model.history
        if i % 300 == 299:  # persistence must not perturb anything
            led.save(tmp_path / "l.npz")
            led = Ledger.load(tmp_path / "l.npz", recover=False)
    # Finish the run through the failures; exactly-once must hold.
    led.requeue_uncommitted()
    while (batch := led.take("t")) is not None:
        run_to_after_lease(led, batch.batch_id)
    assert led.all_committed() and led.audit({0: num * 2}).ok


def run_to_after_lease(led: Ledger, batch_id: int) -> None:
    led.produced(batch_id, "t", 0)
    led.consumed(batch_id, "d")
    led.committed([batch_id], "d", step=1000)
