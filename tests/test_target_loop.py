"""The target loop stepped in one process: a fake link, a fake capture (features that name
their token), the real `TargetWorker` and a real shared-memory slot pool read back through a
real reader."""

import collections
import os
import uuid

import pytest
import torch

from dflash_ipc.data.dataset import DatasetWriter, TokenDataset
from dflash_ipc.errors import DispatcherRestarted, WorkerDeadError
from dflash_ipc.target.loop import TargetLoop, serve
from dflash_ipc.target.worker import TargetWorker
from dflash_ipc.transport.shm import ShmSlotPool, ShmSlotReader
from dflash_ipc.transport.slots import SlotLayout
from dflash_ipc.wire import protocol as p

SAMPLES = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
FEATURES = 2


class FakeCapture:
    """Token t's features are [t, 10 t]: a slot read back shows which tokens went where."""
    device = torch.device("cpu")
    vocab_size = 64

    def forward_into(self, input_ids, lengths, out):
        rows = torch.cat([input_ids[b, :n] for b, n in enumerate(lengths.tolist())]).float()
        out[:len(rows)] = torch.stack([rows, 10 * rows], dim=1)
        return len(rows)


class FakeLink:
    """Replies queued by the test; everything sent is kept. The `restart_at`-th wait raises as
    the real link does when it hears from a restarted dispatcher."""

    def __init__(self, reply=None):
        self.inbox: collections.deque = collections.deque()
        self.sent: list = []
        self.metrics: dict = {}
        self.reply = reply or (lambda msg: p.Registered(role="target", rank=msg.rank, num_batches=4))
        self.restart_at = None
        self.waits: list[float] = []

    def send(self, msg):
        self.sent.append(msg)

    def request(self, msg, timeout_s):
        self.send(msg)
        return self.reply(msg)

    def recv(self, timeout_s):
        self.waits.append(timeout_s)
        if len(self.waits) == self.restart_at:
            raise DispatcherRestarted("the dispatcher restarted")
        return self.inbox.popleft() if self.inbox else None

    def of(self, kind):
        return [m for m in self.sent if isinstance(m, kind)]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        self.now += 0.5  # every reading is half a second after the last
        return self.now


class Timeline:
    def __init__(self):
        self.intervals = []

    def record(self, state, t0, t1, **extra):
        self.intervals.append((state, t1 - t0, extra))


class Group:
    """A tensor-parallel worker's group, as the leader sees it."""

    def __init__(self):
        self.announced, self.keepalives = [], 0

    def announce(self, sample_ids, padded_len):
        self.announced.append((list(sample_ids), padded_len))

    def keepalive(self):
        self.keepalives += 1


@pytest.fixture
def pool():
    pool = ShmSlotPool(SlotLayout(num_slots=2, max_tokens=16, feature_dim=FEATURES, dtype="float32"),
                       name=f"dflash-test-loop-{uuid.uuid4().hex[:8]}")
    yield pool
    pool.close()


def build(tmp_path, pool, link=None, **kw):
    with DatasetWriter(str(tmp_path / "data"), tokenizer_fingerprint="sha256:test") as writer:
        for ids in SAMPLES:
            writer.add(ids, [1] * len(ids))
        writer.close()
    group = Group()
    worker = TargetWorker(FakeCapture(), TokenDataset(str(tmp_path / "data")), pool, group)
    link = link or FakeLink()
    registration = p.Register(role="target", rank=3, pid=os.getpid(), device="cpu", node=0,
                              pool=pool.descriptor(), num_slots=2)
    loop = TargetLoop(worker, link, registration=registration, prefetch=2, register_timeout_s=5.0,
                      clock=Clock(), **kw)
    return loop, link, group


def batch(batch_id, samples, slot):
    return p.Batch(batch_id=batch_id, epoch=0, slot=slot, sample_ids=samples,
                   padded_len=max(len(SAMPLES[s]) for s in samples))


def test_registration_takes_the_seat_then_asks_for_prefetch_batches(tmp_path, pool):
    loop, link, _ = build(tmp_path, pool)
    assert isinstance(loop.register(), p.Registered)
    (register,) = link.of(p.Register)
    assert register.rank == 3 and register.pool == pool.descriptor() and register.num_slots == 2
    assert link.sent[1:] == [p.Ready(credits=2)]


def test_a_refused_registration_is_a_dead_worker(tmp_path, pool):
    loop, link, _ = build(tmp_path, pool, FakeLink(reply=lambda msg: p.Refused(reason="held by live pid 7")))
    with pytest.raises(WorkerDeadError, match="target/3: registration refused.*held by live pid 7"):
        loop.register()
    assert not link.of(p.Ready)


def test_batches_are_computed_oldest_first_one_a_pass_into_their_slots(tmp_path, pool):
    timeline = Timeline()
    loop, link, group = build(tmp_path, pool, timeline=timeline)
    loop.register()
    link.sent.clear()
    link.inbox.extend([batch(7, [0, 1], slot=1), p.Heartbeat(metrics={}), batch(8, [2], slot=0)])
    assert loop.pass_once()
    # The first pass took both batches and computed the older one; the next pass does not block.
    assert link.sent == [p.Produced(batch_id=7, slot=1, num_tokens=5, compute_s=link.sent[0].compute_s),
                         p.Ready(credits=1)]
    assert [b.batch_id for b in loop.queue] == [8] and group.announced == [([0, 1], 3)]
    waits = len(link.waits)
    assert loop.pass_once()
    assert [m.batch_id for m in link.of(p.Produced)] == [7, 8] and link.waits[waits] == 0.0
    reader = ShmSlotReader(pool.descriptor(), "cpu")
    try:
        # What the drafter reads is what was computed: the batch's tokens, packed in order.
        assert reader.read(1, 5)[:, 0].tolist() == [3, 4, 5, 6, 7]
        assert reader.read(0, 4).tolist() == [[t, 10 * t] for t in (8, 9, 10, 11)]
    finally:
        reader.close()
    assert link.metrics["batches"] == 2 and link.metrics["tokens"] == 9
    assert "rss_mib" in link.metrics
    # Each pass: the wait for work (the fake clock's 0.5 s), then the batch's busy interval.
    assert timeline.intervals == [("wait_work", 0.5, {}), ("busy", 0.5, {"tokens": 5, "batch": 7}),
                                  ("wait_work", 0.5, {}), ("busy", 0.5, {"tokens": 4, "batch": 8})]
    assert loop.busy_s == 1.0 and link.metrics["busy_s"] == 1.0


def test_an_idle_pass_blocks_for_work_times_the_wait_and_keeps_followers_alive(tmp_path, pool):
    loop, link, group = build(tmp_path, pool, idle_wait_s=0.25)
    loop.register()
    link.sent.clear()
    assert loop.pass_once() and loop.pass_once()
    assert link.waits[-2:] == [0.25, 0.25] and not link.sent and group.keepalives == 2
    # The fake clock moves 0.5 s a reading: each idle pass counts the time between its two.
    assert loop.wait_s == pytest.approx(1.0) and link.metrics == {"busy_s": 0.0, "wait_s": 1.0, "batches": 0,
                                                                  "tokens": 0}


def test_shutdown_ends_the_loop_and_what_follows_it_is_not_read(tmp_path, pool):
    loop, link, _ = build(tmp_path, pool)
    loop.register()
    link.sent.clear()
    link.inbox.extend([p.EndOfData(), batch(1, [3], slot=0), p.Shutdown(reason="job finished"),
                       batch(2, [0], slot=1)])
    assert not loop.pass_once()
    assert loop.shutdown_reason == "job finished" and not link.sent  # the queued batch is left
    assert [b.batch_id for b in loop.queue] == [1] and [m.batch_id for m in link.inbox] == [2]


def test_after_a_dispatcher_restart_a_fresh_loop_registers_again(tmp_path, pool):
    link = FakeLink()
    loops = []

    def new_loop():
        loop, _, _ = build(tmp_path / str(len(loops)), pool, link)
        loops.append(loop)
        if len(loops) == 1:
            link.inbox.append(batch(1, [0], slot=0))
            link.restart_at = 3  # 1-2: the first pass takes batch 1; 3: the second pass's wait
        else:
            link.inbox.append(p.Shutdown(reason="job finished"))
        return loop

    assert serve(new_loop) is loops[1]
    assert len(link.of(p.Register)) == 2 and link.of(p.Ready) == [p.Ready(credits=2), p.Ready(credits=1),
                                                                   p.Ready(credits=2)]
    # The new dispatcher knows nothing of the old one's counts: the new loop starts from zero.
    assert [m.batch_id for m in link.of(p.Produced)] == [1]
    assert (loops[0].batches, loops[1].batches) == (1, 0) and loops[1].shutdown_reason == "job finished"


def test_the_loop_checks_what_it_is_given(tmp_path, pool):
    loop, link, _ = build(tmp_path, pool)
    with pytest.raises(ValueError, match=r"prefetch must be in \[1, num_slots=2\], got 3"):
        TargetLoop(loop.worker, link, registration=loop.registration, prefetch=3, register_timeout_s=1.0)
    drafter = p.Register(role="drafter", rank=0, pid=1, device="cpu")
    with pytest.raises(ValueError, match="registration.role must be 'target', got 'drafter'"):
        TargetLoop(loop.worker, link, registration=drafter, prefetch=1, register_timeout_s=1.0)
