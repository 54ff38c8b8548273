"""The ledger: state machine, per-sample commits, failures, rollback, persistence, audit."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from dflash_ipc.dispatch import ledger_file
from dflash_ipc.dispatch.buckets import BucketSpec, PlannedBatch, plan_epochs
from dflash_ipc.dispatch.audit import audit_samples
from dflash_ipc.dispatch.ledger import BatchState, Ledger, TrainedCopy
from dflash_ipc.dispatch.ledger_file import load_ledger, save_ledger
from dflash_ipc.errors import DataError, ProtocolError

S = BatchState


def make_batches(num: int, *, epoch: int = 0, first_id: int = 0, per_batch: int = 2):
    """``num`` batches covering samples 0..num*per_batch-1 of ``epoch``, 5 tokens each."""
    return [PlannedBatch(batch_id=first_id + i, epoch=epoch, bucket=i % 3,
                         sample_ids=tuple(range(i * per_batch, (i + 1) * per_batch)),
                         lengths=(5,) * per_batch, padded_len=8)
            for i in range(num)]


POOL_SLOTS = 64
OWNERS = (0, 1, 2, 4, 5, 7, "t", "t0", "t1", "t-x")


def snapshot(led: Ledger):
    """Everything observable about a ledger, for 'nothing changed' checks."""
    return (led.counts(), [led.entry(b) for b in range(len(led))], [b.batch_id for b in led.pending_batches()],
            led.history(), led.produced_batches(), led.next_attempt, led.epoch_progress(),
            {t: led.free_slots(t) for t in OWNERS if led.has_pool(t)})


def pooled(led: Ledger, *targets, num_slots: int = POOL_SLOTS) -> Ledger:
    for t in targets:
        led.open_pool(t, num_slots)
    return led


def whole(led: Ledger, b: int, drafter=0, attempt=None) -> TrainedCopy:
    entry = led.entry(b)
    return TrainedCopy(b, drafter, entry.attempt if attempt is None else attempt, entry.remaining()[0])


def run_to(led: Ledger, b: int, state: BatchState, *, target=0, drafter=0, step=1) -> int:
    """Drive a PENDING batch forward to ``state`` (opening ``target``'s pool if need be);
    returns its attempt (0 before ASSIGNED)."""
    if state is S.PENDING:
        return 0
    if not led.has_pool(target):
        led.open_pool(target, POOL_SLOTS)
    work = led.lease(b, target)
    if state is S.LEASED:
        return 0
    assert led.produced(b, target, work.slot)
    if state is S.PRODUCED:
        return 0
    attempt = led.assign(b, drafter)
    if state is S.ASSIGNED:
        return attempt
    led.consumed(b, drafter, attempt)
    if state is S.COMMITTED:
        led.commit(step, [whole(led, b, drafter)])
    return attempt


def test_happy_path_two_epochs_and_the_audit():
    led = pooled(Ledger(), "t0", num_slots=1)
    led.add_epoch(make_batches(4, epoch=0))
    led.add_epoch(make_batches(3, epoch=1, first_id=4))
    step = 0
    while (batch := led.next_pending()) is not None:
        work = led.lease(batch.batch_id, "t0")
        assert work.sample_ids == batch.sample_ids and work.num_tokens == 10 and work.slot == 0
        assert led.free_slots("t0") == 0 and led.entry(batch.batch_id).slot == 0
        if (other := led.next_pending()) is not None:
            with pytest.raises(ProtocolError, match="no free slot"):
                led.lease(other.batch_id, "t0")
        assert led.produced(batch.batch_id, "t0", 0, num_tokens=10)
        assert led.produced_batches() == [batch.batch_id]
        attempt = led.assign(batch.batch_id, "d1")
        assert led.entry(batch.batch_id).state is S.ASSIGNED and led.free_slots("t0") == 0
        consumption = led.consumed(batch.batch_id, "d1", attempt)
        assert consumption.tokens == 10 and led.free_slots("t0") == 1  # the copy is out: slot free
        step += 1
        result = led.commit(step, [whole(led, batch.batch_id, "d1")])
        assert result.completed == [batch.batch_id] and result.tokens == 10
        entry = led.entry(batch.batch_id)
        assert (entry.state, entry.target, entry.slot, entry.drafter, entry.step, entry.leases) == (
            S.COMMITTED, "t0", None, "d1", step, 1)
    assert led.all_committed() and led.last_committed_step() == 7 and led.committed_steps() == list(range(1, 8))
    assert led.committed_tokens_by_epoch() == {0: 40, 1: 30}
    assert led.audit({0: 8, 1: range(6)}).ok
    assert led.audit().summary() == {"ok": True, "committed_samples": 14, "missing": 0, "missing_samples": {},
                                     "duplicated": 0, "duplicated_samples": {}, "unexpected": 0,
                                     "unexpected_samples": {}}


def test_a_checkpoint_straddling_a_batch_commits_it_in_two_parts():
    """Sequences of one copy trained before and after a checkpoint: the first commit holds
    only the first part, the batch stays the drafter's, the second commit completes it."""
    led = Ledger()
    led.add_epoch(make_batches(2, per_batch=3))
    attempt = run_to(led, 0, S.CONSUMED, drafter=1)
    first = led.commit(10, [TrainedCopy(0, 1, attempt, (0, 2))])
    assert first.completed == [] and first.tokens == 10
    entry = led.entry(0)
    assert entry.state is S.CONSUMED and entry.done == {0, 2} and entry.remaining()[0] == (1,)
    audit = led.audit()  # against the plan: batch 1 and sample 1 of batch 0 not committed yet
    assert audit.missing == {0: [1, 3, 4, 5]} and audit.summary(listed=2)["missing_samples"] == {"0": [1, 3]}
    assert led.commit(20, [TrainedCopy(0, 1, attempt, (1,))]).completed == [0]
    assert [(r.step, r.sample_ids) for r in led.history()] == [(10, (0, 2)), (20, (1,))]
    with pytest.raises(ProtocolError, match="it is COMMITTED"):
        led.commit(30, [TrainedCopy(0, 1, attempt, (1,))])


def test_a_partly_committed_batch_that_returns_to_pending_is_leased_with_its_rest_only():
    led = Ledger()
    led.add_epoch(make_batches(2, per_batch=4))
    attempt = run_to(led, 0, S.CONSUMED)
    led.commit(5, [TrainedCopy(0, 0, attempt, (1, 2))])
    requeued, again = led.restart_drafters()  # the group resumes from step 5: the rest is lost
    assert requeued == [0] and again == []
    work = pooled(led, "t1").lease(0, "t1")
    assert work.sample_ids == (0, 3) and work.lengths == (5, 5) and work.padded_len == 8
    led.produced(0, "t1", work.slot)
    attempt = led.assign(0, 2)
    assert led.consumed(0, 2, attempt).tokens == 10
    assert led.commit(6, [TrainedCopy(0, 2, attempt, (0, 3))]).completed == [0]
    assert led.audit({0: range(4)}).ok and led.committed_tokens_by_epoch() == {0: 20}


def test_a_group_commit_that_overtakes_its_consumed_frees_the_slot_and_the_late_consumed_is_a_no_op():
    led = pooled(Ledger(), "t", num_slots=4)
    led.add_epoch(make_batches(2))
    attempt = run_to(led, 0, S.ASSIGNED, target="t", drafter=1)
    assert led.free_slots("t") == 3
    result = led.commit(4, [whole(led, 0, 1)])
    assert result.completed == [0] and led.free_slots("t") == 4
    assert led.consumed(0, 1, attempt) is None and led.free_slots("t") == 4
    with pytest.raises(ProtocolError):  # another attempt number is not that copy
        led.consumed(0, 1, attempt + 1)


def test_a_dropped_target_keeps_its_assigned_batches_with_their_drafters():
    """The drafter may have copied the slot before the target died: its Consumed makes the
    copy count (no slot is freed: the pool is gone), its Lost sends the batch back."""
    led = pooled(Ledger(), 0, 1, num_slots=4)
    led.add_epoch(make_batches(6))
    run_to(led, 0, S.LEASED, target=0)
    run_to(led, 1, S.PRODUCED, target=0)
    a2 = run_to(led, 2, S.ASSIGNED, target=0, drafter=5)
    a3 = run_to(led, 3, S.ASSIGNED, target=0, drafter=5)
    run_to(led, 4, S.PRODUCED, target=1)
    slot2 = led.entry(2).slot
    assert led.drop_target(0) == [0, 1] and not led.has_pool(0) and led.free_slots(0) == 0
    assert led.entry(2).state is S.ASSIGNED and led.entry(2).orphaned
    with pytest.raises(ProtocolError, match="no slot pool"):
        led.lease(0, 0)
    led.open_pool(0, 4)  # its successor's pool: all four slots free, slot2 too
    led.lease(0, 0)
    led.lease(5, 0)
    led.lease(1, 0)
    assert led.entry(1).slot == slot2 and led.free_slots(0) == 1
    led.consumed(2, 5, a2)  # the old pool's slot: it frees nothing in the new one
    assert led.lost(3, 5, a3) is None and led.entry(3).state is S.PENDING and led.free_slots(0) == 1
    assert led.entry(4).state is S.PRODUCED
    assert [b.batch_id for b in led.pending_batches()] == [3]


def test_a_drafter_group_restart_requeues_consumed_and_reassigns_assigned():
    led = Ledger()
    led.add_epoch(make_batches(6))
    run_to(led, 0, S.COMMITTED)
    run_to(led, 1, S.CONSUMED)
    a2 = run_to(led, 2, S.ASSIGNED, drafter=1)
    slot2 = led.entry(2).slot
    run_to(led, 3, S.ASSIGNED, target=7)
    led.drop_target(7)  # 3's pool is gone: it cannot be assigned again
    free = led.free_slots(0)
    requeued, again = led.restart_drafters()
    assert requeued == [1, 3] and again == [2] and led.free_slots(0) == free  # 2 still holds its slot
    assert led.entry(2).state is S.PRODUCED and led.entry(2).slot == slot2 and led.produced_batches() == [2]
    with pytest.raises(ProtocolError):  # the old group's late Consumed
        led.consumed(2, 1, a2)
    assert led.assign(2, 0) > a2


def test_rollback_undoes_the_commits_after_an_older_checkpoint():
    led = Ledger()
    led.add_epoch(make_batches(4, per_batch=2))
    run_to(led, 0, S.COMMITTED, step=10)
    a1 = run_to(led, 1, S.CONSUMED)
    led.commit(20, [TrainedCopy(1, 0, a1, (2,))])
    run_to(led, 2, S.COMMITTED, step=30)
    led.restart_drafters()
    run_to(led, 1, S.PRODUCED, target=4)  # its rest, leased again before the rollback
    with pytest.raises(ProtocolError, match="hold copies"):
        bad = Ledger()
        bad.add_epoch(make_batches(1))
        run_to(bad, 0, S.CONSUMED)
        bad.rollback_to(-1)
    assert led.free_slots(4) == POOL_SLOTS - 1
    assert led.rollback_to(10) == [1, 2]
    assert led.free_slots(4) == POOL_SLOTS  # the produced rest's slot is free again
    assert led.last_committed_step() == 10 and led.committed_steps() == [10]
    assert led.entry(2).state is S.PENDING and led.entry(2).step is None and not led.entry(2).done
    assert led.entry(1).state is S.PENDING and led.lease(1, 0).sample_ids == (2, 3)
    assert led.epoch_progress() == [{"epoch": 0, "batches": 4, "committed": 1, "tokens": 40}]
    assert led.audit({0: range(8)}).missing == {0: [2, 3, 4, 5, 6, 7]}


def test_a_lease_taken_back_by_a_rollback_keeps_its_slot_until_its_target_reports_it():
    """The target computes into the slot whatever the ledger decides: the slot is free only
    once it reports the batch produced, and that report moves nothing else."""
    led = pooled(Ledger(), "t", num_slots=2)
    led.add_epoch(make_batches(3))
    a0 = run_to(led, 0, S.CONSUMED, target="t")
    led.commit(3, [TrainedCopy(0, 0, a0, (0,))])
    led.restart_drafters()
    rest = led.lease(0, "t")  # sample 1 only
    led.rollback_to(-1)
    assert led.entry(0).state is S.PENDING and led.free_slots("t") == 1
    again = led.lease(0, "t")  # the whole batch, in the other slot
    assert again.sample_ids == (0, 1) and again.slot != rest.slot and led.free_slots("t") == 0
    before = snapshot(led)
    with pytest.raises(ProtocolError, match="was not given"):  # another batch in that slot
        led.produced(1, "t", rest.slot)
    assert snapshot(led) == before
    assert led.produced(0, "t", rest.slot) is False  # the old lease's report
    assert led.free_slots("t") == 1 and led.entry(0).state is S.LEASED and led.entry(0).slot == again.slot
    with pytest.raises(ProtocolError, match="was not given"):  # only once
        led.produced(0, "t", rest.slot)
    assert led.produced(0, "t", again.slot, num_tokens=10) is True


ILLEGAL = [
    # (setup: batch id -> state to drive to, operation, expected message fragment)
    ({}, lambda l, a: l.lease(99, 0), "unknown batch id 99"),
    ({0: S.LEASED}, lambda l, a: l.lease(0, 1), "batch 0: it is LEASED"),
    ({0: S.COMMITTED}, lambda l, a: l.lease(0, 0), "it is COMMITTED"),
    ({}, lambda l, a: l.produced(0, 0, 0), "batch PENDING"),
    ({0: S.LEASED}, lambda l, a: l.produced(0, 1, 0), "target=0"),
    ({0: S.LEASED}, lambda l, a: l.produced(0, 0, -1), "slot -1: that lease was not given"),
    ({0: S.LEASED}, lambda l, a: l.produced(0, 0, 0, num_tokens=11), "batch 0 has 10 tokens, reported 11"),
    ({0: S.PRODUCED, 1: S.LEASED}, lambda l, a: l.produced(1, 0, 0), "slot 0: that lease was not given"),
    ({0: S.PRODUCED}, lambda l, a: l.produced(0, 0, 0), "batch PRODUCED"),
    ({0: S.LEASED}, lambda l, a: l.lease(1, 9), "no slot pool"),
    ({0: S.LEASED}, lambda l, a: l.open_pool(0, 2), "already has an open slot pool"),
    ({0: S.LEASED}, lambda l, a: l.assign(0, 0), "it is LEASED"),
    ({0: S.PRODUCED}, lambda l, a: l.consumed(0, 0, 1), "it is PRODUCED"),
    ({0: S.ASSIGNED}, lambda l, a: l.consumed(0, 1, a[0]), "drafter=0"),
    ({0: S.ASSIGNED}, lambda l, a: l.consumed(0, 0, a[0] + 1), "attempt"),
    ({0: S.ASSIGNED}, lambda l, a: l.lost(0, 1, a[0]), "drafter=0"),
    ({}, lambda l, a: l.consumed(42, 0, 1), "unknown batch id 42"),
    ({0: S.PRODUCED}, lambda l, a: l.commit(1, [TrainedCopy(0, 0, 1, (0,))]), "it is PRODUCED"),
    ({0: S.CONSUMED}, lambda l, a: l.commit(1, [TrainedCopy(0, 1, a[0], (0,))]), "drafter=0"),
    ({0: S.CONSUMED}, lambda l, a: l.commit(1, [TrainedCopy(0, 0, a[0], (0,)), TrainedCopy(2, 0, 1, (4,))]),
     "batch 2 attempt 1: it is PENDING"),
    ({0: S.CONSUMED}, lambda l, a: l.commit(1, [TrainedCopy(0, 0, a[0], (0,))] * 2), "twice"),
    ({0: S.CONSUMED}, lambda l, a: l.commit(-3, [TrainedCopy(0, 0, a[0], (0,))]), "invalid step"),
    ({0: S.CONSUMED}, lambda l, a: l.commit(1, [TrainedCopy(0, 0, a[0], (0, 9))]), "not uncommitted samples"),
    ({0: S.CONSUMED}, lambda l, a: l.commit(1, [TrainedCopy(0, 0, a[0], (0, 0))]), "not uncommitted samples"),
    ({0: S.CONSUMED}, lambda l, a: l.commit(1, [TrainedCopy(0, 0, a[0], ())]), "no samples"),
    ({0: S.CONSUMED}, lambda l, a: l.commit(1, [TrainedCopy(7, 0, 1, (0,))]), "unknown batch id 7"),
]


@pytest.mark.parametrize("setup,op,fragment", ILLEGAL)
def test_illegal_transitions_are_refused_without_change(setup, op, fragment):
    led = Ledger()
    led.add_epoch(make_batches(4))
    attempts = {b: run_to(led, b, state) for b, state in setup.items()}
    before = snapshot(led)
    with pytest.raises(ProtocolError, match=fragment):
        op(led, attempts)
    assert snapshot(led) == before


def test_add_epoch_refuses_duplicate_ids_atomically():
    led = Ledger()
    led.add_epoch(make_batches(3))
    with pytest.raises(DataError, match="batch id 2"):
        led.add_epoch(make_batches(3, first_id=2))
    with pytest.raises(DataError, match="batch id 5"):
        led.add_epoch(make_batches(1, first_id=5) * 2)
    assert len(led) == 3


def test_lease_out_of_order_then_requeue_keeps_queue_consistent():
    led = pooled(Ledger(), 0, 1)
    led.add_epoch(make_batches(5))
    led.lease(3, 0)  # not the head (round robin does this)
    assert led.next_pending().batch_id == 0
    led.drop_target(0)
    led.lease(3, 1)
    led.drop_target(1)
    led.open_pool(0, 8)
    served = []
    while (b := led.next_pending()) is not None:
        served.append(led.lease(b.batch_id, 0).batch_id)
    assert served == [3, 0, 1, 2, 4]


# --- persistence ----------------------------------------------------------------------------


def populated_ledger() -> Ledger:
    led = Ledger()
    lengths = np.random.default_rng(0).integers(1, 300, size=200)
    spec = BucketSpec(boundaries=(64, 128, 256, 512), token_budget=1024)
    for batches in plan_epochs(lengths, spec, seed=1, num_epochs=2):
        led.add_epoch(batches)
    attempts = {b: run_to(led, b, S.CONSUMED, target=b % 2, drafter="d0" if b % 3 else 1) for b in range(12)}
    led.commit(4, [whole(led, b, 1) for b in (0, 3, 6, 9)])
    part = led.entry(1).batch.sample_ids[:1]
    led.commit(5, [whole(led, 2, "d0"), TrainedCopy(1, "d0", attempts[1], part)])
    run_to(led, 20, S.LEASED, target="t-x")
    run_to(led, 21, S.PRODUCED, target=1)
    run_to(led, 22, S.ASSIGNED, target=0)
    led.drop_target(0)
    return led


def test_save_load_round_trip_exact(tmp_path):
    led = populated_ledger()
    path = tmp_path / "ledger.npz"
    save_ledger(led, path)
    back = load_ledger(path, recover=False)
    # Pools are live processes' and do not persist; the batches' slots do.
    assert snapshot(back)[:-1] == snapshot(led)[:-1] and snapshot(back)[-1] == {}
    assert back.last_committed_step() == 5 and back.history() == led.history()
    back.open_pool("t-x", 1)
    with pytest.raises(ProtocolError, match="was not given"):  # the slot bookkeeping came back too
        back.produced(21, "t-x", back.entry(20).slot)
    assert back.produced(20, "t-x", back.entry(20).slot)
    assert os.listdir(tmp_path) == ["ledger.npz"]


def test_load_with_recover_keeps_only_commits(tmp_path):
    led = populated_ledger()
    save_ledger(led, tmp_path / "l")
    back = pooled(load_ledger(tmp_path / "l"), 0)
    counts = back.counts()
    assert counts[S.COMMITTED] == 5 and counts[S.PENDING] == len(back) - 5
    assert back.history() == led.history() and back.entry(1).done == set(led.entry(1).batch.sample_ids[:1])
    assert back.lease(1, 0).sample_ids == led.entry(1).batch.sample_ids[1:]


def test_a_version_1_ledger_still_loads(tmp_path):
    led = Ledger()
    led.add_epoch(make_batches(3))
    run_to(led, 1, S.COMMITTED, step=7)
    cols = ledger_file.to_columns(led)
    cols.update(format_version=np.array(1), attempts=cols.pop("leases"), history=np.array([1]))
    for name in ("attempt", "orphaned", "next_attempt", "hist_batch", "hist_step", "hist_offsets", "hist_samples"):
        cols.pop(name)
    np.savez(tmp_path / "v1.npz", **cols)
    back = load_ledger(tmp_path / "v1.npz")
    assert back.entry(1).state is S.COMMITTED and back.last_committed_step() == 7
    assert back.audit({0: [2, 3]}).ok


def test_crash_mid_save_leaves_previous_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "ledger.npz"
    led = populated_ledger()
    save_ledger(led, path)
    before = path.read_bytes()
    led.commit(9, [whole(led, 4, "d0")])

    def crash(f, arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(ledger_file, "_write_npz", crash)
    with pytest.raises(OSError, match="disk full"):
        save_ledger(led, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ledger.npz"]
    assert load_ledger(path, recover=False).last_committed_step() == 5


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "bit flip":
        data[len(data) // 3] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "text":
        path.write_text("state,target\n0,1\n")
    elif how == "foreign npz":
        np.savez(path, format_version=np.array(0))


@pytest.mark.parametrize("how, needle", [
    ("truncated", "is unreadable"), ("bit flip", "ledger"), ("empty", "is empty (0 bytes)"),
    ("text", "is not a ledger file"), ("foreign npz", "format_version 0"),
])
def test_a_damaged_ledger_is_one_clear_data_error(tmp_path, how, needle):
    path = tmp_path / "ledger.npz"
    save_ledger(populated_ledger(), path)
    _damage(path, how)
    with pytest.raises(DataError) as info:
        load_ledger(path)
    message = str(info.value)
    assert needle in message and str(path) in message and "\n" not in message
    assert "allow_pickle" not in message


def _mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    how = rng.randrange(4)
    pos = rng.randrange(len(out))
    if how == 0:
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] = rng.randrange(256)
    elif how == 1:
        del out[pos:]
    elif how == 2:
        out[pos:pos] = rng.randbytes(rng.randint(1, 50))
    else:
        del out[pos:pos + rng.randint(1, 100)]
    return bytes(out)


def test_fuzzed_ledger_files_are_a_clear_error_or_the_same_ledger(tmp_path):
    """400 random byte flips, cuts, insertions and deletions (fixed seed): each load is one
    DataError line naming the file, or (a change in bytes nobody reads) the very same ledger."""
    path = tmp_path / "ledger.npz"
    save_ledger(populated_ledger(), path)
    good = path.read_bytes()
    want = ledger_file.to_columns(load_ledger(path, recover=False))
    rng = random.Random(15)
    same = 0
    for _ in range(400):
        path.write_bytes(_mutate(good, rng))
        try:
            got = ledger_file.to_columns(load_ledger(path, recover=False))
        except DataError as exc:
            assert str(path) in str(exc) and "\n" not in str(exc) and "allow_pickle" not in str(exc)
            continue
        assert all(np.array_equal(got[k], want[k]) for k in want)
        same += 1
    assert same < 100  # nearly every change is caught (zip CRCs, sizes, headers)


def _rewrite(path, **columns):
    """Each column replaced by its function of the saved one."""
    data = dict(np.load(path))
    data.update({name: change(data[name]) for name, change in columns.items()})
    np.savez(path, **data)


def _huge_header(path):
    """The archive with an offsets member whose header promises 10^13 int64 entries."""
    import io
    import zipfile
    data = dict(np.load(path))
    with zipfile.ZipFile(path, "w") as z:
        for name, array in data.items():
            buf = io.BytesIO()
            if name == "offsets":
                np.lib.format.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False,
                                                           "shape": (10**13,)})
                buf.write(array.tobytes())
            else:
                np.lib.format.write_array(buf, array)
            z.writestr(name + ".npy", buf.getvalue())


@pytest.mark.parametrize("craft, needle", [
    (lambda p: np.savez_compressed(p, **dict(np.load(p))), "is not a stored .npy array"),
    (lambda p: _rewrite(p, state=lambda a: np.array([{"x": 1}] * len(a), dtype=object)),
     "member state.npy holds Python objects"),
    (lambda p: _rewrite(p, target=lambda a: np.full_like(a, -3)), "column target names owners outside"),
    (lambda p: _rewrite(p, drafter=lambda a: np.full_like(a, 99)), "column drafter names owners outside"),
    (lambda p: _rewrite(p, hist_step=lambda a: np.full_like(a, -7)), "column hist_step holds -7"),
    (lambda p: _rewrite(p, leases=lambda a: np.full_like(a, -2)), "column leases holds -2"),
    (lambda p: _huge_header(p), "member offsets.npy claims 80000000000000 bytes of data in"),
])
def test_a_crafted_ledger_is_refused_before_it_costs_memory(tmp_path, craft, needle):
    """A compressed member could inflate without bound, a header could promise 10^13 entries, an
    object array would need pickle, and out-of-range columns would be taken without a word."""
    path = tmp_path / "ledger.npz"
    save_ledger(populated_ledger(), path)
    craft(path)
    with pytest.raises(DataError, match=needle) as info:
        load_ledger(path)
    assert "\n" not in str(info.value)


def test_audit_reports_missing_duplicated_and_unexpected():
    committed = [(0, 0), (0, 1), (0, 1), (0, 2), (1, 0), (1, 9), (2, 5)]
    report = audit_samples(committed, {0: 4, 1: [0, 1]})
    assert not report.ok
    assert report.missing == {0: [3], 1: [1]} and report.duplicated == {0: {1: 2}}
    assert report.unexpected == {1: [9], 2: [5]} and report.num_commit_records == 7
    assert audit_samples(committed[:2], {0: [0, 1]}).ok
    summary = report.summary()
    assert (summary["missing"], summary["duplicated"], summary["unexpected"]) == (2, 1, 2) and not summary["ok"]
    assert summary["duplicated_samples"] == {"0": [1]} and summary["unexpected_samples"] == {"1": [9], "2": [5]}


# --- the specification, written the obvious way, against random operations ---------------------


class Model:
    def __init__(self, batches: list[PlannedBatch]):
        self.batches = {b.batch_id: b for b in batches}
        self.rows = {b.batch_id: dict(state=S.PENDING, target=None, slot=None, drafter=None, attempt=0,
                                      leases=0, done=set(), orphaned=False) for b in batches}
        self.history: list[tuple[int, int, tuple]] = []
        self.next_attempt = 1
        self.pools: dict = {}  # target -> free slots, in the order they came free
        self.holds: dict = {}  # (target, slot) -> batch

    def rest(self, b):
        return tuple(s for s in self.batches[b].sample_ids if s not in self.rows[b]["done"])

    def pending_order(self) -> list[int]:
        pend = [b for b, r in self.rows.items() if r["state"] is S.PENDING]
        fresh = [b for b in pend if self.rows[b]["leases"] == 0 and not self.rows[b]["done"]]
        return [b for b in pend if b not in fresh] + fresh

    def release(self, b, r):
        key = (r["target"], r["slot"])
        if r["slot"] is not None and self.holds.get(key) == b:
            del self.holds[key]
            if key[0] in self.pools:
                self.pools[key[0]].append(key[1])
        r["slot"] = None

    def to_pending(self, r):
        r.update(state=S.PENDING, target=None, slot=None, drafter=None, orphaned=False)

    def apply(self, op, args):
        """The expected result, or ProtocolError if the op must be refused."""
        rows = self.rows
        if op in ("lease", "produced", "assign", "consumed", "lost") and args[0] not in rows:
            return ProtocolError
        if op == "open_pool":
            t, n = args
            if t in self.pools:
                return ProtocolError
            self.pools[t] = list(range(n))
            return None
        if op == "lease":
            b, t = args
            if rows[b]["state"] is not S.PENDING or not self.pools.get(t):
                return ProtocolError
            slot = self.pools[t].pop(0)
            self.holds[(t, slot)] = b
            rows[b].update(state=S.LEASED, target=t, slot=slot, drafter=None, leases=rows[b]["leases"] + 1)
            return self.rest(b), slot
        if op == "produced":
            b, t, slot = args
            r = rows[b]
            if r["state"] is S.LEASED and (r["target"], r["slot"]) == (t, slot):
                r["state"] = S.PRODUCED
                return True
            if self.holds.get((t, slot)) == b and (r["target"], r["slot"]) != (t, slot) and t in self.pools:
                del self.holds[(t, slot)]  # a lease taken back: its slot only
                self.pools[t].append(slot)
                return False
            return ProtocolError
        if op == "assign":
            b, d = args
            if rows[b]["state"] is not S.PRODUCED:
                return ProtocolError
            rows[b].update(state=S.ASSIGNED, drafter=d, attempt=self.next_attempt)
            self.next_attempt += 1
            return rows[b]["attempt"]
        if op in ("consumed", "lost"):
            b, d, a = args
            r = rows[b]
            if op == "consumed" and (r["drafter"], r["attempt"]) == (d, a) and r["state"] in (S.CONSUMED, S.COMMITTED):
                return None
            if r["state"] is not S.ASSIGNED or (r["drafter"], r["attempt"]) != (d, a):
                return ProtocolError
            self.release(b, r)
            if op == "lost":
                self.to_pending(r)
                return None
            tokens = sum(n for s, n in zip(self.batches[b].sample_ids, self.batches[b].lengths) if s not in r["done"])
            r.update(state=S.CONSUMED, orphaned=False)
            return tokens
        if op == "commit":
            step, copies = args
            ids = [c.batch_id for c in copies]
            if step < 0 or len(set(ids)) != len(ids):
                return ProtocolError
            for c in copies:
                r = rows.get(c.batch_id)
                if r is None or r["state"] not in (S.CONSUMED, S.ASSIGNED) or (r["drafter"], r["attempt"]) != (
                        c.drafter, c.attempt):
                    return ProtocolError
                if not c.sample_ids or len(set(c.sample_ids)) != len(c.sample_ids) or not set(c.sample_ids) <= set(self.rest(c.batch_id)):
                    return ProtocolError
            completed = []
            for c in copies:
                r = rows[c.batch_id]
                if r["state"] is S.ASSIGNED:
                    self.release(c.batch_id, r)
                    r["state"] = S.CONSUMED
                r["done"] = r["done"] | set(c.sample_ids)
                self.history.append((c.batch_id, step, tuple(c.sample_ids)))
                if r["done"] == set(self.batches[c.batch_id].sample_ids):
                    r["state"] = S.COMMITTED
                    completed.append(c.batch_id)
            return completed
        if op == "drop_target":
            (t,) = args
            self.pools.pop(t, None)
            self.holds = {k: b for k, b in self.holds.items() if k[0] != t}
            moved = []
            for b, r in sorted(rows.items()):
                if r["target"] == t and r["state"] in (S.LEASED, S.PRODUCED):
                    self.to_pending(r)
                    moved.append(b)
                elif r["target"] == t and r["state"] is S.ASSIGNED:
                    r.update(orphaned=True, slot=None)
            return moved
        if op == "restart_drafters":
            requeued, again = [], []
            for b, r in sorted(rows.items()):
                if r["state"] is S.CONSUMED or (r["state"] is S.ASSIGNED and r["orphaned"]):
                    self.release(b, r)
                    self.to_pending(r)
                    requeued.append(b)
                elif r["state"] is S.ASSIGNED:
                    r.update(state=S.PRODUCED, drafter=None)
                    again.append(b)
            return requeued, again
        if op == "requeue_uncommitted":
            moved = [b for b, r in sorted(rows.items()) if r["state"] not in (S.PENDING, S.COMMITTED)]
            for b in moved:
                self.release(b, rows[b])
                self.to_pending(rows[b])
            return moved
        if op == "rollback_to":
            (step,) = args
            if any(r["state"] in (S.ASSIGNED, S.CONSUMED) for r in rows.values()):
                return ProtocolError
            touched = set()
            for b, st, samples in [h for h in self.history if h[1] > step]:
                r = rows[b]
                touched.add(b)
                if r["state"] is S.PRODUCED:
                    self.release(b, r)
                if r["state"] is not S.PENDING:  # a leased one keeps its slot held
                    self.to_pending(r)
                r["done"] = r["done"] - set(samples)
            self.history = [h for h in self.history if h[1] <= step]
            return sorted(touched)
        raise AssertionError(op)


def random_op(rng: random.Random, model: Model, num: int):
    """Mostly plausible operations (so batches get far), some wrong ones (to be refused)."""
    pick = lambda: rng.randrange(num + 1)  # noqa: E731  (id num is unknown)
    in_state = lambda s: [b for b, r in model.rows.items() if r["state"] is s]  # noqa: E731
    plausible = rng.random() < 0.85
    roll = rng.random()
    if roll < 0.04:
        return "open_pool", (rng.randrange(3), rng.randrange(1, 5))
    if roll < 0.2:
        pending = model.pending_order()
        return "lease", (pending[0] if pending and plausible else pick(), rng.randrange(3))
    if roll < 0.38:
        leased = in_state(S.LEASED)
        stale = [(k, b) for k, b in model.holds.items() if (model.rows[b]["target"], model.rows[b]["slot"]) != k]
        if stale and rng.random() < 0.3:
            (t, slot), b = rng.choice(stale)
            return "produced", (b, t, slot)
        if leased and plausible:
            b = rng.choice(leased)
            return "produced", (b, model.rows[b]["target"], model.rows[b]["slot"])
        return "produced", (pick(), rng.randrange(3), rng.randrange(-1, 4))
    if roll < 0.5:
        produced = in_state(S.PRODUCED)
        return "assign", (rng.choice(produced) if produced and plausible else pick(), rng.randrange(2))
    if roll < 0.66:
        assigned = in_state(S.ASSIGNED) + in_state(S.CONSUMED)
        b = rng.choice(assigned) if assigned and plausible else pick()
        r = model.rows.get(b, {})
        op = "lost" if rng.random() < 0.15 else "consumed"
        return op, (b, r.get("drafter") if plausible else rng.randrange(2), r.get("attempt", 0) or 1)
    if roll < 0.8:
        held = in_state(S.CONSUMED) + in_state(S.ASSIGNED)
        copies = []
        for b in rng.sample(held, min(len(held), rng.randrange(1, 3))):
            rest = model.rest(b)
            take = tuple(rng.sample(rest, rng.randrange(1, len(rest) + 1))) if rest else (0,)
            copies.append(TrainedCopy(b, model.rows[b]["drafter"], model.rows[b]["attempt"], take))
        if not plausible and copies:
            copies.append(copies[0])
        last = max((h[1] for h in model.history), default=0)
        return "commit", (last + rng.randrange(0, 3) if plausible else rng.randrange(-1, 3), copies)
    op = rng.choice(["drop_target", "restart_drafters", "requeue_uncommitted", "rollback_to"])
    steps = sorted({h[1] for h in model.history})
    args = {"drop_target": (rng.randrange(3),), "rollback_to": (rng.choice(steps + [-1]),)}
    return op, args.get(op, ())


def _normalise(op, result):
    if op == "lease":
        return result.sample_ids, result.slot
    if op == "consumed" and result is not None:
        return result.tokens
    if op == "commit":
        return result.completed
    return result


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_state_machine_matches_the_model_under_random_operations(seed, tmp_path):
    rng = random.Random(seed)
    num = 30
    batches = make_batches(num, per_batch=3)
    led, model = Ledger(), Model(batches)
    led.add_epoch(batches)
    for t in range(3):
        led.open_pool(t, 4)
        model.apply("open_pool", (t, 4))
    lengths = {b.batch_id: dict(zip(b.sample_ids, b.lengths)) for b in batches}
    for i in range(1500):
        op, args = random_op(rng, model, num)
        expected = model.apply(op, args)
        if expected is ProtocolError:
            before = snapshot(led)
            with pytest.raises(ProtocolError):
                getattr(led, op)(*args)
            assert snapshot(led) == before, (i, op, args)
        else:
            assert _normalise(op, getattr(led, op)(*args)) == expected, (i, op, args)
        for b, row in model.rows.items():
            e = led.entry(b)
            assert (e.state, e.target, e.slot, e.drafter, e.leases, set(e.done), e.orphaned) == (
                row["state"], row["target"], row["slot"], row["drafter"], row["leases"], row["done"],
                row["orphaned"]), (i, op)
        assert [b.batch_id for b in led.pending_batches()] == model.pending_order()
        assert [(r.batch_id, r.step, r.sample_ids) for r in led.history()] == model.history
        # The running totals a status reads agree with the history they summarise.
        assert led.committed_tokens_by_epoch() == {0: sum(lengths[b][s] for b, _, samples in model.history
                                                          for s in samples)}
        assert led.committed_steps() == sorted({h[1] for h in model.history})
        assert led.last_committed_step() == max((h[1] for h in model.history), default=None)
        assert {t: led.free_slots(t) for t in range(3)} == {t: len(model.pools.get(t, ())) for t in range(3)}
        if i % 300 == 299:  # persistence must not perturb anything (pools are the live targets')
            save_ledger(led, tmp_path / "l.npz")
            led = load_ledger(tmp_path / "l.npz", recover=False)
            for t in model.pools:  # the same targets register again: their free slots in order
                led.open_pool(t, 4)
                model.pools[t] = [slot for slot in range(4) if (t, slot) not in model.holds]
    # Finish the run through the failures: exactly once, sample by sample.
    led.requeue_uncommitted()
    led.open_pool("t", 1)
    step = (led.last_committed_step() or 0) + 1
    while (b := led.next_pending()) is not None:
        work = led.lease(b.batch_id, "t")
        led.produced(b.batch_id, "t", work.slot)
        attempt = led.assign(b.batch_id, "d")
        led.consumed(b.batch_id, "d", attempt)
        led.commit(step, [whole(led, b.batch_id, "d")])
    assert led.all_committed() and led.audit({0: num * 3}).ok



def test_epoch_progress_gives_each_epochs_planned_tokens():
    led = Ledger()
    led.add_epoch(make_batches(3))
    led.add_epoch(make_batches(2, epoch=1, first_id=3, per_batch=3))
    run_to(led, 0, S.COMMITTED)
    assert led.epoch_progress() == [{"epoch": 0, "batches": 3, "committed": 1, "tokens": 30},
                                    {"epoch": 1, "batches": 2, "committed": 0, "tokens": 30}]
