"""The dispatcher's policy, stepped in one process with a simulated clock.

Five targets, one of them five times slower; batches cost time proportional to their
tokens. Pull must give the slow target fewer batches, never leave a target idle while work
is pending, and finish sooner than the round-robin baseline.
"""

import heapq

import numpy as np
import pytest

from dflash_ipc.wire import protocol as p
from dflash_ipc.dispatch.buckets import BucketSpec, plan_epoch
from dflash_ipc.dispatch.dispatcher import Dispatcher
from dflash_ipc.dispatch.ledger import BatchState
from dflash_ipc.errors import BatchKeepsGettingLost, ConfigError, ProtocolError, UnregisteredSender

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
        self.consumed = 0

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
            self.consumed += 1
            self.send(identity, p.WantHidden(credits=1))

    def check_nobody_idles(self):
        pending = self.d.ledger.counts()[BatchState.PENDING]
        for seat in self.d.targets.values():
            if seat.credits > 0 and self.d.ledger.free_slots(seat.rank) and pending:
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
            if self.d.policy.name == "pull":
                self.check_nobody_idles()
        return self.now


def test_pull_spreads_by_speed_and_never_idles():
    sim = Sim("pull")
    makespan = sim.run()
    counts = sim.d.ledger.counts()
    assert counts[BatchState.CONSUMED] == sim.d.num_batches == sim.consumed  # every batch went through
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
    for bad, needle in [(dict(rank=9), "outside"), (dict(num_slots=5_000_000), "num_slots"),
                        (dict(num_slots=0), "num_slots"), (dict(pool={}), "slot pool"), (dict(node=3), "node 3")]:
        with pytest.raises(ProtocolError, match=needle):
            d.handle(b"t9", p.Register(**{**dict(role="target", rank=1, pid=1, pool=POOL, num_slots=1), **bad}))
    with pytest.raises(ProtocolError, match="role"):
        d.handle(b"z", p.Register(role="boss", rank=0, pid=1))
    with pytest.raises(ProtocolError, match="not a message a target may send"):
        d.handle(b"t0", p.Consumed(batch_id=0))
    with pytest.raises(ProtocolError, match="credits must be in"):
        d.handle(b"t0", p.Ready(credits=5))
    (identity, batch), = d.handle(b"t0", p.Ready(credits=1))
    tokens = d.ledger.entry(batch.batch_id).batch.num_tokens
    with pytest.raises(ProtocolError, match="was not given"):  # a batch, or a slot, it was not given
        d.handle(b"t0", p.Produced(batch_id=batch.batch_id + 1, slot=0, num_tokens=1, compute_s=0))
    with pytest.raises(ProtocolError, match="was not given"):
        d.handle(b"t0", p.Produced(batch_id=batch.batch_id, slot=7, num_tokens=tokens, compute_s=0))
    with pytest.raises(ProtocolError, match=f"has {tokens} tokens"):
        d.handle(b"t0", p.Produced(batch_id=batch.batch_id, slot=0, num_tokens=tokens + 1, compute_s=0))
    with pytest.raises(ProtocolError, match="compute_s"):
        d.handle(b"t0", p.Produced(batch_id=batch.batch_id, slot=0, num_tokens=tokens, compute_s=-1.0))
    assert d.ledger.entry(batch.batch_id).state is BatchState.LEASED
    assert d.ledger.free_slots(0) == 0  # the lease keeps its slot: nothing changed
    d.handle(b"d0", p.Register(role="drafter", rank=0, pid=1))
    with pytest.raises(ProtocolError, match="may not report consumed"):
        d.handle(b"d0", p.Consumed(batch_id=batch.batch_id))
    status = d.status()
    plain = status.to_json()
    assert all(v >= 0 for v in plain["tokens"].values()) and all(v >= 0 for v in plain["rates"].values())


def produce(d, tid, batch):
    n = d.ledger.entry(batch.batch_id).remaining_tokens
    return d.handle(tid, p.Produced(batch_id=batch.batch_id, slot=batch.slot, num_tokens=n, compute_s=0.0))


def test_dead_target_work_returns_to_pending():
    d = Dispatcher(_plan(), policy="pull", num_targets=2, num_drafters=1)
    d.handle(b"t0", p.Register(role="target", rank=0, pid=1, pool=POOL, num_slots=2))
    (_, batch), = d.handle(b"t0", p.Ready(credits=1))
    d.drop_target(0)
    assert d.ledger.entry(batch.batch_id).state is BatchState.PENDING
    d.handle(b"t1", p.Register(role="target", rank=1, pid=1, pool=POOL, num_slots=2))
    (_, again), = d.handle(b"t1", p.Ready(credits=1))
    assert again.batch_id == batch.batch_id  # requeued work is served first


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _faulty_setup(clock=None):
    """Target 0 (pid 10) holds two leased batches, a produced one and one assigned to drafter 0."""
    d = Dispatcher(_plan(), policy="pull", num_targets=2, num_drafters=1, heartbeat_timeout_s=5.0,
                   clock=clock or Clock())
    d.handle(b"t0/10", p.Register(role="target", rank=0, pid=10, pool={"pool_id": "old"}, num_slots=4))
    d.handle(b"d0/30", p.Register(role="drafter", rank=0, pid=30))
    leased = [m for _, m in d.handle(b"t0/10", p.Ready(credits=4))]
    assert len(leased) == 4
    produce(d, b"t0/10", leased[0])
    produce(d, b"t0/10", leased[1])
    (_, assign), = d.handle(b"d0/30", p.WantHidden(credits=1))  # leased[0] goes to drafter 0
    assert assign.batch_id == leased[0].batch_id and assign.pool == {"pool_id": "old"}
    return d, leased, assign


def test_a_restarted_target_takes_its_seat_and_the_drafters_copy_still_counts():
    d, leased, assign = _faulty_setup()
    out = d.handle(b"t0/11", p.Register(role="target", rank=0, pid=11, pool={"pool_id": "new"}, num_slots=4,
                                        replaces_pids=[10]))
    assert isinstance(out[-1][1], p.Registered) and d.status().targets["0"].pid == 11
    assert d.status().dropped_targets == {"10": "replaced by pid 11"}
    states = [d.ledger.entry(b.batch_id).state for b in leased]
    assert states == [BatchState.ASSIGNED] + [BatchState.PENDING] * 3
    again = [m for _, m in d.handle(b"t0/11", p.Ready(credits=4))]
    assert [m.batch_id for m in again][:3] == sorted(b.batch_id for b in leased[1:])  # requeued first
    # The drafter had copied the slot before the old target died: it counts, freeing nothing.
    free = d.ledger.free_slots(0)
    d.handle(b"d0/30", p.Consumed(batch_id=assign.batch_id, attempt=assign.attempt))
    assert d.ledger.entry(assign.batch_id).state is BatchState.CONSUMED and d.ledger.free_slots(0) == free
    with pytest.raises(ProtocolError, match="unregistered"):  # the old process, resumed
        d.handle(b"t0/10", p.Heartbeat(metrics={}))


def test_a_copy_lost_with_its_target_goes_back_to_pending():
    d, leased, assign = _faulty_setup()
    d.drop_target(0, reason="test")
    d.handle(b"d0/30", p.Lost(batch_id=assign.batch_id, attempt=assign.attempt, reason="producer gone"))
    assert d.ledger.entry(assign.batch_id).state is BatchState.PENDING
    d.handle(b"t1", p.Register(role="target", rank=1, pid=20, pool=POOL, num_slots=4))
    served = [m.batch_id for _, m in d.handle(b"t1", p.Ready(credits=4))]
    assert assign.batch_id in served


def test_a_batch_lost_again_and_again_stops_the_dispatcher_with_its_reason():
    """A copy that fails whatever target produced it (drafters that take live targets for dead
    ones) is reported at the limit, not requeued for ever; losses of other batches count apart."""
    d = Dispatcher(_plan(), policy="pull", num_targets=1, num_drafters=1, clock=Clock(), max_batch_losses=3)
    d.handle(b"t0", p.Register(role="target", rank=0, pid=10, pool=POOL, num_slots=4))
    d.handle(b"d0", p.Register(role="drafter", rank=0, pid=30))
    first = None
    for loss in range(1, 4):
        leased = [m for _, m in d.handle(b"t0", p.Ready(credits=1))]
        if first is None:
            first = leased[0].batch_id
        assert [b.batch_id for b in leased] == [first]  # the lost batch is served first again
        produce(d, b"t0", leased[0])
        (_, assign), = d.handle(b"d0", p.WantHidden(credits=1))
        lost = p.Lost(batch_id=first, attempt=assign.attempt, reason="producer pid 10 is gone")
        if loss < 3:
            d.handle(b"d0", lost)
            assert d.ledger.entry(first).state is BatchState.PENDING and d.losses[first] == loss
            continue
        with pytest.raises(BatchKeepsGettingLost, match=rf"batch {first} was lost 3 times \(dispatch.max_batch_losses=3\), "
                           r"the last by drafter/0: producer pid 10 is gone"):
            d.handle(b"d0", lost)
    assert d.ledger.entry(first).state is BatchState.PENDING  # as a restarted dispatcher finds it


def test_dispatch_max_batch_losses_is_checked():
    from dflash_ipc.config.schema import DispatchConfig
    with pytest.raises(ConfigError, match=r"dispatch.max_batch_losses.*\[1, 1000000\]"):
        DispatchConfig(max_batch_losses=0).check()


def test_a_stray_registration_for_a_live_seat_is_refused():
    """A second `drafter --rank 0` started by hand must not tear down the running group, nor
    a stray target take a live target's seat; the holder's successor (named in replaces_pids,
    as its supervisor starts it) or any process once the holder is silent may."""
    clock = Clock()
    d, leased, assign = _faulty_setup(clock)
    for role, pid in (("drafter", 30), ("target", 10)):
        with pytest.raises(ProtocolError, match=f"held by live pid {pid}"):
            d.handle(b"stray", p.Register(role=role, rank=0, pid=99, pool=POOL, num_slots=1))
    assert d.drafter_generation == 0 and d.drafters[0].pid == 30 and d.targets[0].pid == 10
    d.handle(b"d0/31", p.Register(role="drafter", rank=0, pid=31, replaces_pids=[7, 30]))
    assert d.drafter_generation == 1 and d.drafters[0].pid == 31
    clock.now = 10.0  # target 0 silent past the 5 s timeout: anyone may take the seat
    d.handle(b"t0/12", p.Register(role="target", rank=0, pid=12, pool=POOL, num_slots=1))
    assert d.targets[0].pid == 12


def test_silent_target_is_dropped_and_its_late_produced_refused():
    clock = Clock()
    d, leased, _ = _faulty_setup(clock)
    clock.now = 4.0
    d.handle(b"d0/30", p.Heartbeat(metrics={}))
    assert d.tick() == [] and 0 in d.targets  # 4 s of silence: still within the timeout
    clock.now = 5.5
    d.tick()
    assert 0 not in d.targets and d.status().dropped_targets == {"10": "silent for 5.5s"}
    with pytest.raises(ProtocolError, match="unregistered"):  # SIGCONT: it wakes up and reports
        produce(d, b"t0/10", leased[2])
    d.handle(b"t0/10", p.Register(role="target", rank=0, pid=10, pool=POOL, num_slots=1))
    assert d.status().dropped_targets == {}


def test_a_group_commit_that_overtakes_the_drafters_consumed_counts():
    """Rank 0's Committed and d1's Consumed travel on two sockets: the commit may come first.
    The trained copy commits and its slot is freed; the late Consumed changes nothing."""
    d = Dispatcher(_plan(), policy="pull", num_targets=1, num_drafters=2, clock=Clock())
    d.handle(b"d0", p.Register(role="drafter", rank=0, pid=30))
    d.handle(b"d1", p.Register(role="drafter", rank=1, pid=31))
    d.handle(b"t0", p.Register(role="target", rank=0, pid=10, pool=POOL, num_slots=4))
    (_, b), = d.handle(b"t0", p.Ready(credits=1))
    produce(d, b"t0", b)
    (_, assign), = d.handle(b"d1", p.WantHidden(credits=1))
    free_before = d.ledger.free_slots(0)
    out = d.handle(b"d0", p.Committed(step=1, batch_ids=[b.batch_id], ranks=[1], attempts=[assign.attempt],
                                      samples=[assign.sample_ids]))
    assert (b"d0", p.CommitDone(step=1)) in out
    assert d.ledger.entry(b.batch_id).state is BatchState.COMMITTED
    assert d.ledger.free_slots(0) == free_before + 1
    refusals = d.refusals
    assert d.handle(b"d1", p.Consumed(batch_id=b.batch_id, attempt=assign.attempt)) == []
    assert d.refusals == refusals and d.ledger.free_slots(0) == free_before + 1


def test_a_commit_that_frees_several_slots_serves_every_one():
    d = Dispatcher(_plan(), policy="pull", num_targets=1, num_drafters=2, clock=Clock())
    d.handle(b"d0", p.Register(role="drafter", rank=0, pid=30))
    d.handle(b"d1", p.Register(role="drafter", rank=1, pid=31))
    d.handle(b"t0", p.Register(role="target", rank=0, pid=10, pool=POOL, num_slots=2))
    first = [m for _, m in d.handle(b"t0", p.Ready(credits=2))]
    d.handle(b"t0", p.Ready(credits=2))  # credits waiting for a slot
    for b in first:
        produce(d, b"t0", b)
    assigns = [m for _, m in d.handle(b"d1", p.WantHidden(credits=2))]
    out = d.handle(b"d0", p.Committed(step=1, batch_ids=[a.batch_id for a in assigns], ranks=[1, 1],
                                      attempts=[a.attempt for a in assigns], samples=[a.sample_ids for a in assigns]))
    served = [m for identity, m in out if identity == b"t0" and isinstance(m, p.Batch)]
    assert len(served) == 2 and {d.ledger.entry(m.batch_id).state for m in served} == {BatchState.LEASED}


def _group(num_drafters=2, num_slots=4, epochs=None):
    d = Dispatcher(epochs or _plan(), policy="pull", num_targets=1, num_drafters=num_drafters, clock=Clock())
    d.handle(b"t0", p.Register(role="target", rank=0, pid=10, pool=POOL, num_slots=num_slots))
    for r in range(num_drafters):
        d.handle(b"d%d/1" % r, p.Register(role="drafter", rank=r, pid=100 + r))
    return d


def test_a_drafter_registering_again_restarts_the_group_from_the_last_commit():
    d = _group()
    batches = [m for _, m in d.handle(b"t0", p.Ready(credits=4))]
    for b in batches:
        produce(d, b"t0", b)
    (_, a0), = d.handle(b"d0/1", p.WantHidden(credits=1))
    (_, a1), (_, a2) = d.handle(b"d1/1", p.WantHidden(credits=2))
    for sender, a in ((b"d0/1", a0), (b"d1/1", a1), (b"d1/1", a2)):
        d.handle(sender, p.Consumed(batch_id=a.batch_id, attempt=a.attempt))
    # Rank 0 commits a0, a1 and half of a2 at step 3; then d1 dies.
    half = a2.sample_ids[: len(a2.sample_ids) // 2]
    d.handle(b"d0/1", p.Committed(step=3, batch_ids=[a0.batch_id, a1.batch_id, a2.batch_id], ranks=[0, 1, 1],
                                  attempts=[a0.attempt, a1.attempt, a2.attempt],
                                  samples=[a0.sample_ids, a1.sample_ids, half]))
    out = d.handle(b"d1/2", p.Register(role="drafter", rank=1, pid=20, replaces_pids=[101]))
    registered = out[-1][1]
    assert registered.resume_step == 3 and registered.committed_steps == [3] and d.drafter_generation == 1
    assert d.ledger.entry(a2.batch_id).state is BatchState.PENDING and list(d.drafters) == [1]
    with pytest.raises(UnregisteredSender):  # the old rank 0 is not part of the new group
        d.handle(b"d0/1", p.WantHidden(credits=1))
    d.handle(b"d0/2", p.Register(role="drafter", rank=0, pid=30, replaces_pids=[100]))
    assert d.drafter_generation == 1  # one restart, not two
    assert d.handle(b"d0/2", p.Resumed(step=3)) == [(b"d0/2", p.Resumed(step=3))] + []
    (_, again), = d.handle(b"d0/2", p.WantHidden(credits=1))
    assert again.batch_id == batches[3].batch_id and again.attempt > a2.attempt  # still in its slot
    (_, rest), = d.handle(b"t0", p.Ready(credits=1))
    assert rest.batch_id == a2.batch_id and rest.sample_ids == list(a2.sample_ids[len(half):])


def test_resuming_from_an_older_checkpoint_undoes_the_later_commits():
    d = _group(num_drafters=1)
    batches = [m for _, m in d.handle(b"t0", p.Ready(credits=2))]
    for step, b in zip((5, 9), batches):
        produce(d, b"t0", b)
        (_, a), = d.handle(b"d0/1", p.WantHidden(credits=1))
        d.handle(b"d0/1", p.Consumed(batch_id=a.batch_id, attempt=a.attempt))
        d.handle(b"d0/1", p.Committed(step=step, batch_ids=[a.batch_id], ranks=[0], attempts=[a.attempt],
                                      samples=[a.sample_ids]))
    d.handle(b"d0/2", p.Register(role="drafter", rank=0, pid=2, replaces_pids=[100]))
    with pytest.raises(ProtocolError, match="not a committed checkpoint"):
        d.handle(b"d0/2", p.Resumed(step=7))
    d.handle(b"d0/2", p.Resumed(step=5))  # step 9's checkpoint was unreadable
    assert d.ledger.last_committed_step() == 5
    assert d.ledger.entry(batches[1].batch_id).state is BatchState.PENDING
    assert d.ledger.audit({0: batches[0].sample_ids}).ok


def test_a_lease_taken_back_by_a_rollback_frees_its_slot_when_produced():
    d = _group(num_drafters=1, num_slots=2)
    (_, first), = d.handle(b"t0", p.Ready(credits=1))
    produce(d, b"t0", first)
    (_, a), = d.handle(b"d0/1", p.WantHidden(credits=1))
    d.handle(b"d0/1", p.Consumed(batch_id=a.batch_id, attempt=a.attempt))
    part = a.sample_ids[:1]
    d.handle(b"d0/1", p.Committed(step=2, batch_ids=[a.batch_id], ranks=[0], attempts=[a.attempt], samples=[part]))
    d.handle(b"d0/2", p.Register(role="drafter", rank=0, pid=2, replaces_pids=[100]))
    (_, rest), = d.handle(b"t0", p.Ready(credits=1))  # its rest, leased before the group resumed
    assert rest.batch_id == a.batch_id
    d.handle(b"d0/2", p.Resumed(step=-1))  # no checkpoint readable: everything is undone
    assert d.ledger.entry(a.batch_id).state is BatchState.PENDING
    assert d.ledger.free_slots(0) == 1  # the old lease's slot: its target still writes into it
    out = d.handle(b"t0", p.Ready(credits=2))
    (_, whole), = out  # the whole batch again, in the one free slot
    assert whole.sample_ids == list(a.sample_ids) and whole.slot != rest.slot
    # ... then the Produced of the old lease: its slot comes back and serves the waiting credit
    out = d.handle(b"t0", p.Produced(batch_id=rest.batch_id, slot=rest.slot, num_tokens=len(rest.sample_ids),
                                     compute_s=0.0))
    assert d.ledger.entry(a.batch_id).state is BatchState.LEASED and d.ledger.entry(a.batch_id).slot == whole.slot
    (_, next_batch), = out
    assert next_batch.slot == rest.slot and next_batch.batch_id != a.batch_id
    assert d.targets[0].batches_done == 1  # the stale report counted nothing


def test_group_commit_is_checked_as_a_whole():
    d = _group()
    (_, b), = d.handle(b"t0", p.Ready(credits=1))
    produce(d, b"t0", b)
    (_, a), = d.handle(b"d0/1", p.WantHidden(credits=1))
    d.handle(b"d0/1", p.Consumed(batch_id=a.batch_id, attempt=a.attempt))
    good = dict(step=1, batch_ids=[a.batch_id], ranks=[0], attempts=[a.attempt], samples=[a.sample_ids])
    with pytest.raises(ProtocolError, match="2 ranks"):
        d.handle(b"d0/1", p.Committed(**{**good, "ranks": [0, 1]}))
    with pytest.raises(ProtocolError, match="not registered"):
        d.handle(b"d0/1", p.Committed(**{**good, "ranks": [5]}))
    with pytest.raises(ProtocolError, match="only rank 0 commits"):
        d.handle(b"d1/1", p.Committed(**good))  # a copy of rank 0's: only rank 0 commits it
    d.handle(b"d0/1", p.Committed(**good))
    assert [r.batch_id for r in d.ledger.history()] == [a.batch_id]


def test_a_group_restart_after_end_of_data_serves_the_idle_targets_again():
    """Every batch consumed, EndOfData sent, targets idle with credits: a drafter dies before
    the last commit. Its batches are pending again and go out at once, without any new Ready."""
    d = _group(num_drafters=1, epochs=[[b for b in _plan()[0]][:3]])
    batches = [m for _, m in d.handle(b"t0", p.Ready(credits=4))]
    assert len(batches) == 3
    for b in batches:
        produce(d, b"t0", b)
    for _, a in d.handle(b"d0/1", p.WantHidden(credits=3)):
        d.handle(b"d0/1", p.Consumed(batch_id=a.batch_id, attempt=a.attempt))
    d.tick()
    assert d.end_sent and d.targets[0].credits == 1  # idle, one credit left
    out = d.handle(b"d0/2", p.Register(role="drafter", rank=0, pid=2, replaces_pids=[100]))
    served = [m for _, m in out if isinstance(m, p.Batch)]
    assert [m.batch_id for m in served] == [batches[0].batch_id] and not d.end_sent
    d.handle(b"t0", p.Ready(credits=2))
    assert all(d.ledger.entry(b.batch_id).state is BatchState.LEASED for b in batches)


def test_a_drafter_reporting_negative_trained_tokens_cannot_make_rates_negative():
    d = _group(num_drafters=1)
    for value in (100.0, -1e18, 50.0, -3.0):
        d.handle(b"d0/1", p.Heartbeat(metrics={"trained_tokens": value}))
        d.clock.now += 5.0
        d.tick()
        status = d.status()
        assert status.tokens.trained >= 0 and all(r >= 0 for r in status.to_json()["rates"].values())


def test_with_a_secret_every_seat_needs_it_and_observers_do_not():
    """A Register for a seat without the job's secret is refused (a free seat, a held one, a
    successor naming the holder's pid); the secret's holder registers as before."""
    secret = b"k" * 32
    d = Dispatcher(_plan(40), policy="pull", num_targets=1, num_drafters=1, secret=secret)
    for given in (b"", b"k" * 31, b"k" * 31 + b"j", b"k" * 33):
        with pytest.raises(ProtocolError, match="without the job's secret"):
            d.handle(b"t0", p.Register(role="target", rank=0, pid=1, pool=POOL, num_slots=1, secret=given))
    assert not d.targets and not d.holds_seat(b"t0")
    d.handle(b"t0", p.Register(role="target", rank=0, pid=1, pool=POOL, num_slots=1, secret=secret))
    assert d.holds_seat(b"t0")
    with pytest.raises(ProtocolError, match="without the job's secret"):
        d.handle(b"evil", p.Register(role="target", rank=0, pid=2, pool=POOL, num_slots=1, replaces_pids=[1]))
    assert d.targets[0].identity == b"t0"
    d.handle(b"obs", p.Register(role="observer", rank=0, pid=3))  # an observer holds nothing
    assert not d.holds_seat(b"obs")


# --- committed tokens: the ledger's, through rollbacks and restarts ---------------------------


def _committed_sum(d):
    return sum(d.ledger.committed_tokens_by_epoch().values())


def _run_one(d, drafter, step):
    """One batch leased, produced, assigned, consumed and committed at `step`; its tokens."""
    (_, b), = [m for m in d.handle(b"t0", p.Ready(credits=1)) if isinstance(m[1], p.Batch)]
    produce(d, b"t0", b)
    (_, a), = d.handle(drafter, p.WantHidden(credits=1))
    d.handle(drafter, p.Consumed(batch_id=a.batch_id, attempt=a.attempt))
    d.handle(drafter, p.Committed(step=step, batch_ids=[a.batch_id], ranks=[0], attempts=[a.attempt],
                                  samples=[a.sample_ids]))
    return a.num_tokens


def test_a_rollback_takes_the_undone_commits_out_of_the_status_tokens():
    """Resumed from step 5 undoes step 9's commit: status and ledger say the same."""
    from dflash_ipc.obs.status_line import estimate_eta_s
    d = _group(num_drafters=1)
    first = _run_one(d, b"d0/1", 5)
    _run_one(d, b"d0/1", 9)
    d.handle(b"d0/2", p.Register(role="drafter", rank=0, pid=2, replaces_pids=[100]))
    d.handle(b"d0/2", p.Resumed(step=5))
    status = d.status()
    assert status.tokens.committed == _committed_sum(d) == first
    # The ETA counts from what the checkpoints hold: the rest of the job at the trained rate.
    status.rates.tok_rate = 100.0
    assert estimate_eta_s(status) == pytest.approx((d.tokens_planned - first) / 100.0)


def test_a_restarted_dispatcher_counts_on_from_the_ledger(tmp_path):
    """A dispatcher started on the saved ledger (a dispatcher restart, or a rerun of the
    job): tokens.committed and the status line's trained share start from the ledger's."""
    from dflash_ipc.dispatch.ledger_file import load_ledger, save_ledger
    from dflash_ipc.obs.status_line import StatusLine
    d = _group(num_drafters=1)
    committed = sum(_run_one(d, b"d0/1", step) for step in (1, 2, 3))
    save_ledger(d.ledger, tmp_path / "ledger.npz")
    again = Dispatcher(_plan(), policy="pull", num_targets=1, num_drafters=1, clock=Clock(),
                       ledger=load_ledger(tmp_path / "ledger.npz"))
    status = again.status()
    assert status.tokens.committed == _committed_sum(again) == committed > 0
    share = int(100 * committed / again.tokens_planned)
    assert f"] {share:3d}% of " in StatusLine().lines(status)[1]


# --- trained progress: batches in drafters, tokens through resumes ----------------------------


def test_the_bar_moves_with_the_trained_tokens_before_any_commit():
    """The status carries each epoch's planned tokens: the bar places the drafters' trained
    tokens in them, so it moves with every step, not only at checkpoints."""
    from dflash_ipc.obs.status_line import format_progress
    d = _group(num_drafters=1)
    status = d.status()
    assert [e.tokens for e in status.epochs] == [d.tokens_planned] and d.tokens_planned > 0
    d.handle(b"d0/1", p.Resumed(step=-1))
    d.handle(b"d0/1", p.Heartbeat(metrics={"trained_tokens": d.tokens_planned / 4}))
    status = d.status()
    assert status.batches.committed == 0
    assert "]  25% of " in format_progress(status, width=8)


def test_trained_tokens_are_the_commits_before_the_group_plus_its_own_counts(tmp_path):
    """A resumed job (a dispatcher on the saved ledger, a new drafter group counting from 0):
    its trained tokens start at the committed ones and grow with the group's steps; a group
    that resumes from an older checkpoint starts from what that checkpoint holds."""
    from dflash_ipc.dispatch.ledger_file import load_ledger, save_ledger
    d = _group(num_drafters=1)
    first = _run_one(d, b"d0/1", 5)
    second = _run_one(d, b"d0/1", 9)
    save_ledger(d.ledger, tmp_path / "ledger.npz")
    again = Dispatcher(_plan(), policy="pull", num_targets=1, num_drafters=1, clock=Clock(),
                       ledger=load_ledger(tmp_path / "ledger.npz"))
    again.handle(b"t0", p.Register(role="target", rank=0, pid=10, pool=POOL, num_slots=4))
    again.handle(b"d0/1", p.Register(role="drafter", rank=0, pid=100))
    assert again.status().tokens.trained == first + second
    again.handle(b"d0/1", p.Resumed(step=9))
    again.handle(b"d0/1", p.Heartbeat(metrics={"trained_tokens": 70.0}))
    assert again.status().tokens.trained == first + second + 70
    # the next group resumes from step 5 (step 9's checkpoint unreadable): step 9 is undone
    again.handle(b"d0/2", p.Register(role="drafter", rank=0, pid=101, replaces_pids=[100]))
    again.handle(b"d0/2", p.Resumed(step=5))
    assert again.status().tokens.trained == first == again.status().tokens.committed
    again.handle(b"d0/2", p.Heartbeat(metrics={"trained_tokens": 30.0}))
    assert again.status().tokens.trained == first + 30
