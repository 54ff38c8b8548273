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
from dflash_ipc.errors import ProtocolError

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
            self.send(identity, p.Consumed(batch_id=msg.batch_id))
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
    with pytest.raises(ProtocolError, match="already registered"):
        d.handle(b"other", p.Register(role="target", rank=0, pid=2, pool=POOL, num_slots=1))
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
    with pytest.raises(ProtocolError, match="was not assigned"):
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
