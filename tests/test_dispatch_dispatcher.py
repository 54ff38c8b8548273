"""The dispatcher's policy, stepped in one process with a simulated clock.

Five targets, one of them five times slower; batches cost time proportional to their
tokens. Pull must give the slow target fewer batches, never leave a target idle while work
is pending, and finish sooner than the round-robin baseline.
"""

import heapq

import numpy as np
import pytest

from dflash_ipc import protocol as p
from dflash_ipc.dispatch.buckets import BucketSpec, plan_epoch
from dflash_ipc.dispatch.dispatcher import Dispatcher
from dflash_ipc.dispatch.ledger import BatchState
from dflash_ipc.errors import ProtocolError, UnregisteredSender

SPEEDS = [1.0, 1.0, 1.0, 1.0, 5.0]  # seconds per 1000 tokens; target 4 is slow
POOL = {"backend": "test"}


def _plan(num_samples=400, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.0, 0.8, num_samples), 8, 1024).astype(np.int64)
    spec = BucketSpec(boundaries=(128, 256, 512, 1024), token_budget=2048)
    return [plan_epoch(lengths, spec, seed=seed, epoch=0)]


class Sim:
    def __init__(self, policy):
        self.now = 0.0
        self.d = Dispatcher(_plan(), policy=policy, num_targets=len(SPEEDS), num_drafters=2,
                            clock=lambda: self.now)
        self.events = []  # (finish time, target rank, batch)
        self.busy = [0.0] * len(SPEEDS)
        self.done = [0] * len(SPEEDS)
        self.idle_with_pending = 0

    def send(self, sender, msg):
        for identity, out in self.d.handle(sender, msg):
            self.deliver(identity, out)

    def deliver(self, identity, msg):
        if isinstance(msg, p.Batch):
            rank = int(identity[1:])
            tokens = sum(self.d.ledger.entry(msg.batch_id).batch.lengths)
            cost = SPEEDS[rank] * tokens / 1000
            start = max([self.now] + [t for t, r, _ in self.events if r == rank])
            self.busy[rank] += cost
            heapq.heappush(self.events, (start + cost, rank, msg))
        elif isinstance(msg, p.Assign):  # drafters copy out at once
            self.send(identity, p.Consumed(batch_id=msg.batch_id, attempt=msg.attempt))
            self.send(identity, p.WantHidden(credits=1))

    def check_nobody_idles(self):
        pending = self.d.ledger.counts()[BatchState.PENDING]
        for seat in self.d.targets.values():
            if seat.credits > 0 and seat.free_slots and pending:
                self.idle_with_pending += 1

    def run(self):
        for r in range(len(SPEEDS)):
            self.send(b"t%d" % r, p.Register(role="target", rank=r, pid=1, pool=POOL, num_slots=2))
        for r in range(2):
            self.send(b"d%d" % r, p.Register(role="drafter", rank=r, pid=1))
            self.send(b"d%d" % r, p.WantHidden(credits=2))
        for r in range(len(SPEEDS)):
            self.send(b"t%d" % r, p.Ready(credits=1))
        while self.events:
            self.now, rank, batch = heapq.heappop(self.events)
            self.done[rank] += 1
            n = self.d.ledger.entry(batch.batch_id).batch.num_tokens
            self.send(b"t%d" % rank, p.Produced(batch_id=batch.batch_id, slot=batch.slot, num_tokens=n,
                                                compute_s=0.0))
            self.send(b"t%d" % rank, p.Ready(credits=1))
            if self.d.policy == "pull":
                self.check_nobody_idles()
        return self.now


def test_pull_spreads_by_speed_and_never_idles():
    sim = Sim("pull")
    makespan = sim.run()
    counts = sim.d.ledger.counts()
    assert counts[BatchState.CONSUMED] == sim.d.num_batches  # every batch went through
    assert sim.idle_with_pending == 0
    assert all(sim.done[4] < sim.done[r] for r in range(4)), sim.done
    ideal = sum(sim.busy) / len(SPEEDS) * len(SPEEDS) / sum(1 / s for s in SPEEDS)
    rr = Sim("round_robin")
    rr_makespan = rr.run()
    assert max(rr.done) - min(rr.done) <= 1  # round-robin ignores speed
    assert makespan < 0.6 * rr_makespan
    assert makespan > 0 and ideal > 0


def test_every_batch_to_exactly_one_target_and_drafter():
    sim = Sim("pull")
    sim.run()
    entries = [sim.d.ledger.entry(b.batch_id) for batches in _plan() for b in batches]
    assert all(e.state is BatchState.CONSUMED for e in entries)
    assert sum(sim.done) == len(entries)
    assert {e.drafter for e in entries} <= {0, 1}


def test_refuses_what_a_sender_may_not_do():
    d = Dispatcher(_plan(), policy="pull", num_targets=2, num_drafters=1)
    with pytest.raises(ProtocolError, match="unregistered"):
        d.handle(b"x", p.Ready(credits=1))
    d.handle(b"t0", p.Register(role="target", rank=0, pid=1, pool=POOL, num_slots=1))
    with pytest.raises(ProtocolError, match="already registered by this sender"):
        d.handle(b"t0", p.Register(role="target", rank=0, pid=1, pool=POOL, num_slots=1))
    with pytest.raises(ProtocolError, match="outside"):
        d.handle(b"t9", p.Register(role="target", rank=9, pid=1, pool=POOL, num_slots=1))
    with pytest.raises(ProtocolError, match="role"):
        d.handle(b"z", p.Register(role="boss", rank=0, pid=1))
    with pytest.raises(ProtocolError, match="not a message a target may send"):
        d.handle(b"t0", p.Consumed(batch_id=0))
    out = d.handle(b"t0", p.Ready(credits=1))
    (identity, batch), = out
    with pytest.raises(ProtocolError):  # a batch it does not own
        d.handle(b"t0", p.Produced(batch_id=batch.batch_id + 1, slot=0, num_tokens=1, compute_s=0))
    d.handle(b"d0", p.Register(role="drafter", rank=0, pid=1))
    with pytest.raises(ProtocolError, match="is not assigned"):
        d.handle(b"d0", p.Consumed(batch_id=batch.batch_id))


def test_dead_target_work_returns_to_pending():
    d = Dispatcher(_plan(), policy="pull", num_targets=2, num_drafters=1)
    d.handle(b"t0", p.Register(role="target", rank=0, pid=1, pool=POOL, num_slots=2))
    (_, batch), = d.handle(b"t0", p.Ready(credits=1))
    d.drop_target(0)
    assert d.ledger.entry(batch.batch_id).state is BatchState.PENDING
    d.handle(b"t1", p.Register(role="target", rank=1, pid=1, pool=POOL, num_slots=2))
    (_, again), = d.handle(b"t1", p.Ready(credits=1))
    assert again.batch_id == batch.batch_id  # requeued work is served first


# --- target faults: restart, hang, late messages ----------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _faulty_setup(clock=None):
    """Target 0 (pid 10) holds leased batches, a produced one and one assigned to drafter 0."""
    d = Dispatcher(_plan(), policy="pull", num_targets=2, num_drafters=1, heartbeat_timeout_s=5.0,
                   clock=clock or Clock())
    d.handle(b"t0/10", p.Register(role="target", rank=0, pid=10, pool={"pool_id": "old"}, num_slots=4))
    d.handle(b"d0/30", p.Register(role="drafter", rank=0, pid=30))
    leased = [m for _, m in d.handle(b"t0/10", p.Ready(credits=4))]
    assert len(leased) == 4
    produced = lambda b: p.Produced(batch_id=b.batch_id, slot=b.slot, num_tokens=1, compute_s=0.0)
    d.handle(b"t0/10", produced(leased[0]))
    d.handle(b"t0/10", produced(leased[1]))
    (_, assign), = d.handle(b"d0/30", p.WantHidden(credits=1))  # leased[0] goes to drafter 0
    assert assign.batch_id == leased[0].batch_id and assign.pool == {"pool_id": "old"}
    return d, leased


def test_second_register_of_a_target_rank_is_a_restart():
    d, leased = _faulty_setup()
    out = d.handle(b"t0/11", p.Register(role="target", rank=0, pid=11, pool={"pool_id": "new"}, num_slots=4))
    assert out[-1] == (b"t0/11", p.Registered(role="target", rank=0, num_batches=d.num_batches,
                                               instance=d.instance))
    # Leased, produced, and produced-and-assigned-but-not-consumed: all back to pending.
    for batch in leased:
        assert d.ledger.entry(batch.batch_id).state is BatchState.PENDING, batch.batch_id
    assert d.in_flight == {} and not d.produced
    status = d.status()
    assert status["targets"]["0"]["pid"] == 11
    assert status["dropped_targets"] == {"10": "replaced by pid 11"}
    # The new process gets the requeued work first, oldest first, in its own pool.
    again = [m for _, m in d.handle(b"t0/11", p.Ready(credits=4))]
    assert [m.batch_id for m in again] == sorted(b.batch_id for b in leased)


def test_late_messages_of_a_replaced_target_and_its_drafter_are_refused():
    d, leased = _faulty_setup()
    d.handle(b"t0/11", p.Register(role="target", rank=0, pid=11, pool={"pool_id": "new"}, num_slots=4))
    with pytest.raises(ProtocolError, match="unregistered"):  # the old process, resumed
        d.handle(b"t0/10", p.Produced(batch_id=leased[2].batch_id, slot=leased[2].slot, num_tokens=1,
                                      compute_s=0.0))
    with pytest.raises(ProtocolError, match="unregistered"):
        d.handle(b"t0/10", p.Heartbeat(metrics={}))
    with pytest.raises(ProtocolError, match="is not assigned"):  # the drafter's copy came too late
        d.handle(b"d0/30", p.Consumed(batch_id=leased[0].batch_id, attempt=1))
    assert d.ledger.entry(leased[2].batch_id).state is BatchState.PENDING


def test_same_identity_may_not_register_twice():
    d = Dispatcher(_plan(), policy="pull", num_targets=1, num_drafters=1)
    d.handle(b"t0/1", p.Register(role="target", rank=0, pid=1, pool=POOL, num_slots=1))
    with pytest.raises(ProtocolError, match="already registered by this sender"):
        d.handle(b"t0/1", p.Register(role="target", rank=0, pid=1, pool=POOL, num_slots=1))
    d.handle(b"d0/2", p.Register(role="drafter", rank=0, pid=2))
    with pytest.raises(ProtocolError, match="drafter/0 is already registered by this sender"):
        d.handle(b"d0/2", p.Register(role="drafter", rank=0, pid=2))
    assert d.drafters[0].identity == b"d0/2" and d.status()["dropped_targets"] == {}


def test_silent_target_is_dropped_and_its_late_produced_refused():
    clock = Clock()
    d, leased = _faulty_setup(clock)
    clock.now = 4.0
    d.handle(b"d0/30", p.Heartbeat(metrics={}))
    assert d.tick() == [] and 0 in d.targets  # 4 s of silence: still within the timeout
    clock.now = 5.5
    d.tick()
    assert 0 not in d.targets
    assert d.status()["dropped_targets"] == {"10": "silent for 5.5s"}
    assert all(d.ledger.entry(b.batch_id).state is BatchState.PENDING for b in leased)
    with pytest.raises(ProtocolError, match="unregistered"):  # SIGCONT: it wakes up and reports
        d.handle(b"t0/10", p.Produced(batch_id=leased[2].batch_id, slot=leased[2].slot, num_tokens=1,
                                      compute_s=0.0))
    # The restarted process registers into the free seat; its pid is no longer "dropped".
    d.handle(b"t0/10", p.Register(role="target", rank=0, pid=10, pool=POOL, num_slots=1))
    assert d.status()["dropped_targets"] == {}


def test_commit_of_a_batch_taken_back_by_a_drop_counts_the_rest():
    """Drafter 0 copied batch A, but its Consumed arrived after A's target was dropped. Its
    Committed lists A with a properly consumed B: B commits, A is served again, and the
    committed history still has every sample once."""
    d, leased = _faulty_setup()
    batch_a = leased[0]
    d.handle(b"t1/20", p.Register(role="target", rank=1, pid=20, pool=POOL, num_slots=4))
    (_, batch_b), = d.handle(b"t1/20", p.Ready(credits=1))
    d.drop_target(0, reason="test")
    with pytest.raises(ProtocolError):
        d.handle(b"d0/30", p.Consumed(batch_id=batch_a.batch_id))
    d.handle(b"t1/20", p.Produced(batch_id=batch_b.batch_id, slot=batch_b.slot, num_tokens=1, compute_s=0.0))
    (_, assign), = d.handle(b"d0/30", p.WantHidden(credits=1))
    assert assign.batch_id == batch_b.batch_id
    d.handle(b"d0/30", p.Consumed(batch_id=batch_b.batch_id, attempt=assign.attempt))
    d.handle(b"d0/30", p.Committed(step=1, batch_ids=[batch_a.batch_id, batch_b.batch_id]))
    assert d.ledger.history() == [batch_b.batch_id]
    assert d.ledger.entry(batch_a.batch_id).state is BatchState.PENDING
    # A goes round again through target 1 and now commits normally.
    (_, again), = d.handle(b"t1/20", p.Ready(credits=1))
    assert again.batch_id == batch_a.batch_id and d.ledger.entry(batch_a.batch_id).target == 1
    d.handle(b"t1/20", p.Produced(batch_id=batch_a.batch_id, slot=again.slot, num_tokens=1, compute_s=0.0))
    (_, assign_a), = d.handle(b"d0/30", p.WantHidden(credits=1))
    d.handle(b"d0/30", p.Consumed(batch_id=batch_a.batch_id, attempt=assign_a.attempt))
    d.handle(b"d0/30", p.Committed(step=2, batch_ids=[batch_a.batch_id]))
    assert d.ledger.history() == [batch_b.batch_id, batch_a.batch_id] and d.revoked == {}


def test_stale_commit_of_a_batch_another_drafter_committed_is_dropped_not_fatal():
    """A target drop revokes batch B from d0 (its Consumed came late); B is produced again and
    d1 commits it first. d0's later commit of its stale copy must not refuse d0's other work."""
    d = Dispatcher(_plan(), policy="pull", num_targets=2, num_drafters=2, heartbeat_timeout_s=5.0, clock=Clock())
    d.handle(b"t0", p.Register(role="target", rank=0, pid=10, pool={"pool_id": "a"}, num_slots=4))
    d.handle(b"d0", p.Register(role="drafter", rank=0, pid=30))
    d.handle(b"d1", p.Register(role="drafter", rank=1, pid=31))
    (_, b), (_, other) = d.handle(b"t0", p.Ready(credits=2))
    for batch in (b, other):
        d.handle(b"t0", p.Produced(batch_id=batch.batch_id, slot=batch.slot, num_tokens=1, compute_s=0))
    d.handle(b"d0", p.WantHidden(credits=1))  # d0 gets b
    d.drop_target(0)  # d0 copied b; its Consumed arrives too late
    with pytest.raises(ProtocolError):
        d.handle(b"d0", p.Consumed(batch_id=b.batch_id))
    d.handle(b"t1", p.Register(role="target", rank=1, pid=11, pool={"pool_id": "b"}, num_slots=4))
    served = [m for _, m in d.handle(b"t1", p.Ready(credits=2))]
    assert {m.batch_id for m in served} == {b.batch_id, other.batch_id}
    for m in served:
        d.handle(b"t1", p.Produced(batch_id=m.batch_id, slot=m.slot, num_tokens=1, compute_s=0))
    (_, first), = d.handle(b"d1", p.WantHidden(credits=1))
    (_, second), = d.handle(b"d0", p.WantHidden(credits=1))
    assert {first.batch_id, second.batch_id} == {b.batch_id, other.batch_id}
    d.handle(b"d1", p.Consumed(batch_id=first.batch_id, attempt=first.attempt))
    d.handle(b"d0", p.Consumed(batch_id=second.batch_id, attempt=second.attempt))
    d.handle(b"d1", p.Committed(step=1, batch_ids=[first.batch_id]))
    # d0 commits its own valid batch together with its stale copy of b (if b went to d1).
    stale = [b.batch_id] if first.batch_id == b.batch_id else []
    d.handle(b"d0", p.Committed(step=1, batch_ids=[second.batch_id, *stale]))
    assert d.ledger.entry(first.batch_id).state is BatchState.COMMITTED
    assert d.ledger.entry(second.batch_id).state is BatchState.COMMITTED
    assert sorted(d.ledger.history()) == sorted({b.batch_id, other.batch_id})


def _produced_by_new_target(d, rank):
    """Target `rank` registers, is served one batch and produces it."""
    tid = b"t%d" % rank
    d.handle(tid, p.Register(role="target", rank=rank, pid=100 + rank, pool={"pool_id": f"p{rank}"}, num_slots=4))
    (_, batch), = d.handle(tid, p.Ready(credits=1))
    d.handle(tid, p.Produced(batch_id=batch.batch_id, slot=batch.slot, num_tokens=1, compute_s=0))
    return batch


def test_group_commit_of_a_superseded_copy_waits_for_the_newer_one():
    """d1 copied batch b, but a target drop took b back before its Consumed. b came round to
    d1 again and d1's new Consumed reached the dispatcher before rank 0's group commit, which
    still lists d1's old copy (gathered before). That copy must not count: d1 trains the
    new one and commits it at the next checkpoint, which must then go through."""
    d = Dispatcher(_plan(), policy="pull", num_targets=2, num_drafters=2, heartbeat_timeout_s=5.0, clock=Clock())
    d.handle(b"d0", p.Register(role="drafter", rank=0, pid=30))
    d.handle(b"d1", p.Register(role="drafter", rank=1, pid=31))
    b = _produced_by_new_target(d, 0)
    (_, old), = d.handle(b"d1", p.WantHidden(credits=1))
    d.drop_target(0)  # d1 copied b; its Consumed arrives too late
    with pytest.raises(ProtocolError, match="is not assigned to drafter/1"):
        d.handle(b"d1", p.Consumed(batch_id=b.batch_id, attempt=old.attempt))
    assert _produced_by_new_target(d, 1).batch_id == b.batch_id
    (_, new), = d.handle(b"d1", p.WantHidden(credits=1))
    assert new.batch_id == b.batch_id and new.attempt != old.attempt
    d.handle(b"d1", p.Consumed(batch_id=b.batch_id, attempt=new.attempt))
    # Rank 0's commit of the old copy: not counted, b stays consumed by d1.
    d.handle(b"d0", p.Committed(step=1, batch_ids=[b.batch_id], ranks=[1], attempts=[old.attempt]))
    assert d.ledger.entry(b.batch_id).state is BatchState.CONSUMED and d.ledger.history() == []
    # The next checkpoint commits the new copy.
    d.handle(b"d0", p.Committed(step=2, batch_ids=[b.batch_id], ranks=[1], attempts=[new.attempt]))
    assert d.ledger.history() == [b.batch_id] and d.ledger.entry(b.batch_id).step == 2
    assert d.consumed_attempt == {} and d.revoked == {}
    with pytest.raises(ProtocolError, match="2 attempts for 1 batch ids"):
        d.handle(b"d0", p.Committed(step=3, batch_ids=[b.batch_id], ranks=[1], attempts=[1, 2]))


@pytest.mark.parametrize("comes_back_to", ["d0", "nobody yet"])
def test_copies_revoked_twice_from_one_drafter_never_commit(comes_back_to):
    """Batch b is revoked from d1 twice (two target drops, each after d1 had copied it). Rank
    0's commits of d1's two stale copies must count for nothing: not commit b early, and not
    refuse the commit of the copy that counts (d0's, here), nor anything else."""
    d = Dispatcher(_plan(), policy="pull", num_targets=3, num_drafters=2, heartbeat_timeout_s=5.0, clock=Clock())
    d.handle(b"d0", p.Register(role="drafter", rank=0, pid=30))
    d.handle(b"d1", p.Register(role="drafter", rank=1, pid=31))
    copies = []
    for target in (0, 1):
        b = _produced_by_new_target(d, target)
        (_, assign), = d.handle(b"d1", p.WantHidden(credits=1))
        assert assign.batch_id == b.batch_id == (copies[0].batch_id if copies else b.batch_id)
        copies.append(assign)
        d.drop_target(target)
        with pytest.raises(ProtocolError, match="is not assigned to drafter/1"):  # d1's comes too late
            d.handle(b"d1", p.Consumed(batch_id=b.batch_id, attempt=assign.attempt))
    batch_id = copies[0].batch_id
    d.handle(b"d0", p.Committed(step=1, batch_ids=[batch_id], ranks=[1], attempts=[copies[0].attempt]))
    if comes_back_to == "d0":
        _produced_by_new_target(d, 2)
        (_, third), = d.handle(b"d0", p.WantHidden(credits=1))
        d.handle(b"d0", p.Consumed(batch_id=batch_id, attempt=third.attempt))
    d.handle(b"d0", p.Committed(step=2, batch_ids=[batch_id], ranks=[1], attempts=[copies[1].attempt]))
    assert d.ledger.history() == []
    if comes_back_to == "d0":
        d.handle(b"d0", p.Committed(step=3, batch_ids=[batch_id], ranks=[0], attempts=[third.attempt]))
        assert d.ledger.history() == [batch_id]
    else:
        assert d.ledger.entry(batch_id).state is BatchState.PENDING


def test_a_group_commit_that_overtakes_the_drafters_consumed_counts():
    """Rank 0's Committed and d1's Consumed travel on two sockets: the commit may come first.
    The trained copy commits and its slot is freed; the late Consumed changes nothing."""
    d = Dispatcher(_plan(), policy="pull", num_targets=1, num_drafters=2, clock=Clock())
    d.handle(b"d0", p.Register(role="drafter", rank=0, pid=30))
    d.handle(b"d1", p.Register(role="drafter", rank=1, pid=31))
    b = _produced_by_new_target(d, 0)
    (_, assign), = d.handle(b"d1", p.WantHidden(credits=1))
    free_before = len(d.targets[0].free_slots)
    d.handle(b"d0", p.Committed(step=1, batch_ids=[b.batch_id], ranks=[1], attempts=[assign.attempt]))
    assert d.ledger.history() == [b.batch_id]
    assert len(d.targets[0].free_slots) == free_before + 1 and d.drafters[1].batches_done == 1
    refusals = d.refusals
    assert d.handle(b"d1", p.Consumed(batch_id=b.batch_id, attempt=assign.attempt)) == []
    assert d.refusals == refusals and d.consumed_by_commit == set()
    assert d.drafters[1].batches_done == 1 and len(d.targets[0].free_slots) == free_before + 1


def test_a_commit_that_frees_several_slots_serves_every_one():
    """Two copies' Consumed overtaken by one group commit free two slots of a target that
    waits with credits: both batches it is then served are sent (a lease never sent is a
    batch nobody computes)."""
    d = Dispatcher(_plan(), policy="pull", num_targets=1, num_drafters=2, clock=Clock())
    d.handle(b"d0", p.Register(role="drafter", rank=0, pid=30))
    d.handle(b"d1", p.Register(role="drafter", rank=1, pid=31))
    d.handle(b"t0", p.Register(role="target", rank=0, pid=10, pool=POOL, num_slots=2))
    first = [m for _, m in d.handle(b"t0", p.Ready(credits=4))]
    assert len(first) == 2  # both slots taken; two credits left, waiting for a slot
    for b in first:
        d.handle(b"t0", p.Produced(batch_id=b.batch_id, slot=b.slot, num_tokens=1, compute_s=0))
    assigns = [m for _, m in d.handle(b"d1", p.WantHidden(credits=2))]
    out = d.handle(b"d0", p.Committed(step=1, batch_ids=[a.batch_id for a in assigns], ranks=[1, 1],
                                      attempts=[a.attempt for a in assigns]))
    served = [m for identity, m in out if identity == b"t0" and isinstance(m, p.Batch)]
    assert len(served) == 2
    assert {d.ledger.entry(m.batch_id).state for m in served} == {BatchState.LEASED}


# --- drafter faults: the group restarts, attempts tell copies apart ---------------------------


def test_a_drafter_registering_again_restarts_the_group_from_the_last_commit():
    d = Dispatcher(_plan(), policy="pull", num_targets=1, num_drafters=2, clock=Clock())
    d.handle(b"t0", p.Register(role="target", rank=0, pid=10, pool=POOL, num_slots=4))
    d.handle(b"d0/1", p.Register(role="drafter", rank=0, pid=1))
    d.handle(b"d1/2", p.Register(role="drafter", rank=1, pid=2))
    batches = [m for _, m in d.handle(b"t0", p.Ready(credits=4))]
    for b in batches:
        d.handle(b"t0", p.Produced(batch_id=b.batch_id, slot=b.slot, num_tokens=1, compute_s=0))
    (_, a0), = d.handle(b"d0/1", p.WantHidden(credits=1))
    (_, a1), (_, a2) = d.handle(b"d1/2", p.WantHidden(credits=2))
    d.handle(b"d0/1", p.Consumed(batch_id=a0.batch_id, attempt=a0.attempt))
    d.handle(b"d1/2", p.Consumed(batch_id=a1.batch_id, attempt=a1.attempt))
    # Rank 0 commits a0 and a1 for the group at step 3; then d1 consumes a2, and dies.
    d.handle(b"d0/1", p.Committed(step=3, batch_ids=[a0.batch_id, a1.batch_id], ranks=[0, 1]))
    d.handle(b"d1/2", p.Consumed(batch_id=a2.batch_id, attempt=a2.attempt))
    assert d.ledger.entry(a2.batch_id).state is BatchState.CONSUMED
    # The new group registers: a2 (consumed, not committed) is pending again, the batch still
    # produced in its slot (never assigned) waits for the new group, everyone resumes at 3.
    out = d.handle(b"d1/20", p.Register(role="drafter", rank=1, pid=20))
    assert out[-1][1].resume_step == 3 and d.drafter_generation == 1
    assert d.ledger.entry(a2.batch_id).state is BatchState.PENDING
    assert list(d.drafters) == [1]
    with pytest.raises(UnregisteredSender):  # the old rank 0 is not part of the new group
        d.handle(b"d0/1", p.WantHidden(credits=1))
    out = d.handle(b"d0/30", p.Register(role="drafter", rank=0, pid=30))
    assert out[-1][1].resume_step == 3 and d.drafter_generation == 1  # one restart, not two
    (_, again), = d.handle(b"d0/30", p.WantHidden(credits=1))
    assert again.batch_id == batches[3].batch_id and again.attempt > a2.attempt
    assert sorted(d.ledger.history()) == sorted([a0.batch_id, a1.batch_id])


def test_assigned_batches_of_a_dead_group_go_to_the_new_one_and_old_consumes_are_refused():
    d = Dispatcher(_plan(), policy="pull", num_targets=1, num_drafters=1, clock=Clock())
    d.handle(b"t0", p.Register(role="target", rank=0, pid=10, pool=POOL, num_slots=2))
    d.handle(b"d0/1", p.Register(role="drafter", rank=0, pid=1))
    (_, b), = d.handle(b"t0", p.Ready(credits=1))
    d.handle(b"t0", p.Produced(batch_id=b.batch_id, slot=b.slot, num_tokens=1, compute_s=0))
    (_, first), = d.handle(b"d0/1", p.WantHidden(credits=1))  # assigned, never consumed: it died
    d.handle(b"d0/2", p.Register(role="drafter", rank=0, pid=2))
    (_, second), = d.handle(b"d0/2", p.WantHidden(credits=1))
    assert second.batch_id == b.batch_id and second.slot == first.slot and second.attempt != first.attempt
    # A Consumed naming the old attempt (a late copy) does not free the slot of the new one.
    with pytest.raises(ProtocolError, match="is not assigned"):
        d.handle(b"d0/2", p.Consumed(batch_id=b.batch_id, attempt=first.attempt))
    assert d.ledger.entry(b.batch_id).state is BatchState.PRODUCED
    d.handle(b"d0/2", p.Consumed(batch_id=b.batch_id, attempt=second.attempt))
    assert d.ledger.entry(b.batch_id).state is BatchState.CONSUMED


def test_group_commit_is_checked_as_a_whole():
    d = Dispatcher(_plan(), policy="pull", num_targets=1, num_drafters=2, clock=Clock())
    d.handle(b"t0", p.Register(role="target", rank=0, pid=10, pool=POOL, num_slots=2))
    d.handle(b"d0", p.Register(role="drafter", rank=0, pid=1))
    (_, b), = d.handle(b"t0", p.Ready(credits=1))
    d.handle(b"t0", p.Produced(batch_id=b.batch_id, slot=b.slot, num_tokens=1, compute_s=0))
    (_, a), = d.handle(b"d0", p.WantHidden(credits=1))
    d.handle(b"d0", p.Consumed(batch_id=a.batch_id, attempt=a.attempt))
    with pytest.raises(ProtocolError, match="ranks for"):
        d.handle(b"d0", p.Committed(step=1, batch_ids=[a.batch_id], ranks=[0, 1]))
    with pytest.raises(ProtocolError, match="not registered"):  # rank 1 never registered
        d.handle(b"d0", p.Committed(step=1, batch_ids=[a.batch_id], ranks=[1]))
    d.handle(b"d0", p.Committed(step=1, batch_ids=[a.batch_id], ranks=[0]))
    assert d.ledger.history() == [a.batch_id]


def test_a_group_restart_after_end_of_data_serves_the_idle_targets_again():
    """Every batch consumed, EndOfData sent, targets idle with credits: a drafter dies before
    the last commit. Its batches are pending again and go out at once, without any new Ready."""
    epochs = [[b for b in _plan()[0]][:3]]
    d = Dispatcher(epochs, policy="pull", num_targets=1, num_drafters=1, clock=Clock())
    d.handle(b"t0", p.Register(role="target", rank=0, pid=10, pool=POOL, num_slots=4))
    d.handle(b"d0/1", p.Register(role="drafter", rank=0, pid=1))
    batches = [m for _, m in d.handle(b"t0", p.Ready(credits=4))]
    assert len(batches) == 3
    for b in batches:
        d.handle(b"t0", p.Produced(batch_id=b.batch_id, slot=b.slot, num_tokens=1, compute_s=0))
    for _, a in d.handle(b"d0/1", p.WantHidden(credits=3)):
        d.handle(b"d0/1", p.Consumed(batch_id=a.batch_id, attempt=a.attempt))
    d.tick()
    assert d.end_sent and d.targets[0].credits == 1  # idle, one credit left
    out = d.handle(b"d0/2", p.Register(role="drafter", rank=0, pid=2))
    served = [m for _, m in out if isinstance(m, p.Batch)]
    assert [m.batch_id for m in served] == [batches[0].batch_id] and not d.end_sent
    d.handle(b"t0", p.Ready(credits=2))
    assert all(d.ledger.entry(b.batch_id).state is BatchState.LEASED for b in batches)
