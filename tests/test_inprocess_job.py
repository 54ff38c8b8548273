"""A whole job in one process, one thread: the real `Dispatcher`, a `TargetLoop` on the tiny CPU
target writing into a shared-memory slot pool, and a `DrafterLoop` with the real trainer,
stepped in turn over real links on an ipc:// socket until the epoch is committed.

What it shows that the stepped tests of each part cannot: the three speak one protocol
(registration, credits, Batch/Produced/Assign/Consumed, Committed/CommitDone, EndOfData,
Shutdown), every sample of the epoch is committed exactly once, also across a drafter
restart, and the hidden states the drafter trained on are the ones the target computed, after
their trip through the pool. About a second of passes each, where a real-process job takes
minutes: the place for the next whole-protocol test.
"""

import contextlib
import os
import time
import uuid

import numpy as np
import torch
import zmq
from transformers import AutoTokenizer

from dflash_ipc.config.dtypes import TORCH_DTYPES
from dflash_ipc.config.load import config_from_dict
from dflash_ipc.data.dataset import DatasetWriter, TokenDataset, tokenizer_fingerprint
from dflash_ipc.dispatch.dispatcher import Dispatcher
from dflash_ipc.dispatch.proc import plan_job
from dflash_ipc.drafter.group import SoloGroup
from dflash_ipc.drafter.loop import DrafterLoop
from dflash_ipc.drafter.model import DFlashConfig
from dflash_ipc.drafter.sequence_queue import SequenceQueue
from dflash_ipc.drafter.trainer import DrafterTrainer, estimate_total_steps
from dflash_ipc.hf.target_config import load_target_config
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.run.checkpoints import CheckpointStore
from dflash_ipc.target.capture import FeatureCapture
from dflash_ipc.target.loop import TargetLoop
from dflash_ipc.target.resolve import resolve_job
from dflash_ipc.target.worker import TargetWorker
from dflash_ipc.transport.backends import ReaderCache
from dflash_ipc.transport.shm import ShmSlotPool
from dflash_ipc.transport.slots import SlotLayout
from dflash_ipc.wire import protocol as p
from dflash_ipc.wire.link import DispatcherLink
from dflash_ipc.wire.security import ensure_job_secret, read_job_secret

NUM_SAMPLES = 24
POLL_S = 0.002     # a waiting link's poll between two pumps of the dispatcher
JOB_BOUND_S = 60   # the passes of one test take ~1 s on a busy 2-core machine


class InprocDispatcher:
    """The dispatcher's logic behind a ROUTER socket, served when a worker waits (`pump`): what
    `dispatch/proc.py` does in its own process, less the ledger files and the refusals (a
    refusal fails this test)."""

    def __init__(self, dispatcher: Dispatcher, address: str) -> None:
        self.dispatcher = dispatcher
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.shutdown_sent = False

    def pump(self) -> None:
        while self.socket.poll(0):
            identity, *body = self.socket.recv_multipart()
            self._send(self.dispatcher.handle(identity, p.decode(body)))
        self._send(self.dispatcher.tick())
        if self.dispatcher.finished and not self.shutdown_sent:
            self.shutdown_sent = True
            seats = [*self.dispatcher.targets.values(), *self.dispatcher.drafters.values()]
            self._send([(s.identity, p.Shutdown(reason="job finished")) for s in seats])

    def _send(self, outgoing) -> None:
        for identity, msg in outgoing:
            self.socket.send_multipart([identity, *p.encode(msg)])

    def close(self) -> None:
        self.socket.close(linger=0)


class PumpedLink(DispatcherLink):
    """The real link; each wait first lets the in-process dispatcher answer what reached it, so
    one thread steps all three (a blocking wait would otherwise wait on nobody)."""

    def __init__(self, address: str, identity: str, server: InprocDispatcher) -> None:
        super().__init__(address, identity=identity, heartbeat_interval_s=0.5, timeout_s=30.0)
        self.server = server

    def recv(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            self.server.pump()
            msg = super().recv(min(POLL_S, max(0.0, deadline - time.monotonic())))
            if msg is not None or time.monotonic() >= deadline:
                return msg


class RecordingQueue(SequenceQueue):
    """The drafter's queue, keeping what each copy brought: (sample ids, features [T, F])."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.arrived: list[tuple[list[int], torch.Tensor]] = []

    def add_copy(self, batch_id, attempt, epoch, sample_ids, features):
        self.arrived.append((list(sample_ids), features.clone()))
        return super().add_copy(batch_id, attempt, epoch, sample_ids, features)


def write_dataset(path: str, tokenizer) -> None:
    """NUM_SAMPLES random samples of 10-40 tokens of the tiny vocabulary, loss on the second half."""
    rng = np.random.default_rng(0)
    with DatasetWriter(path, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer)) as writer:
        for n in rng.integers(10, 41, NUM_SAMPLES):
            writer.add(rng.integers(10, 900, n), np.r_[np.zeros(n // 2), np.ones(n - n // 2)])
        writer.close()


def job_config(tmp_path, tiny_cache):
    target = os.path.join(tiny_cache, "tiny-target")
    write_dataset(str(tmp_path / "data"), AutoTokenizer.from_pretrained(target))
    return resolve_job(config_from_dict({
        "run": {"run_dir": str(tmp_path / "run")},
        "target": {"path": target, "dtype": "float32", "num_slots": 3, "prefetch": 2},
        "data": {"path": str(tmp_path / "data"), "bucket_boundaries": [16, 32, 48], "token_budget": 96,
                 "num_epochs": 1},
        "model": {"num_layers": 1, "target_layer_ids": [1, 2], "block_size": 4},
        "drafter": {"dtype": "float32", "attention": "dense", "fifo_sequences": 8, "prefetch": 2},
        "objective": {"anchors_per_step": 24, "max_anchors_per_seq": 4},
        "checkpoint": {"every_steps": 2}}))


class InprocJob:
    """The three parts of one job in this process, their resources closed by `opened`."""

    def __init__(self, tmp_path, tiny_cache, opened: contextlib.ExitStack) -> None:
        self.cfg = cfg = job_config(tmp_path, tiny_cache)
        self.opened = opened
        self.dataset = TokenDataset(cfg.data.path)
        self.epochs = plan_job(cfg, self.dataset.lengths)
        self.address = f"ipc://{tmp_path}/dispatcher.sock"
        # The job's secret as the dispatcher makes it; each seat's Register carries it, as read by
        # the workers (a Register without it is refused, and a refusal fails the test).
        self.secret = ensure_job_secret(cfg.files.job_secret)
        self.server = InprocDispatcher(Dispatcher(self.epochs, num_targets=1,
                                                  num_drafters=1, secret=self.secret), self.address)
        opened.callback(self.server.close)
        # the target: the tiny model on CPU, its pool in shared memory
        self.capture = FeatureCapture(cfg.target.path, layer_ids=cfg.model.target_layer_ids, dtype="float32",
                                      attn_implementation=cfg.target.attn_implementation, device="cpu")
        pool = ShmSlotPool(SlotLayout(num_slots=cfg.target.num_slots,
                                      max_tokens=SlotLayout.required_max_tokens(cfg.data.token_budget),
                                      feature_dim=self.capture.feature_dim, dtype="float32"),
                           name=f"dflash-test-inproc-{uuid.uuid4().hex[:8]}")
        opened.callback(pool.close)
        self.target = TargetLoop(TargetWorker(self.capture, self.dataset, pool), self._link("target/0"),
                                 registration=p.Register(role="target", rank=0, pid=os.getpid(), device="cpu",
                                                         pool=pool.descriptor(), num_slots=cfg.target.num_slots,
                                                         secret=read_job_secret(cfg.files.job_secret)),
                                 prefetch=cfg.target.prefetch, register_timeout_s=10.0, idle_wait_s=0.0)
        self.target.register()
        self.serving = True
        self.deadline = time.monotonic() + JOB_BOUND_S

    def _link(self, identity: str) -> PumpedLink:
        link = PumpedLink(self.address, identity, self.server)
        self.opened.callback(link.close)
        return link

    def new_drafter(self, identity: str = "drafter/0", replaces_pids=()) -> DrafterLoop:
        """Rank 0 of a drafter group of one, the real trainer on the tiny target's width,
        registered and resumed from the ledger's last commit."""
        cfg = self.cfg
        model_config = DFlashConfig.from_target_config(
            load_target_config(cfg.target.path), num_draft_layers=cfg.model.num_layers,
            block_size=cfg.model.block_size, mask_token_id=cfg.model.mask_token_id,
            target_layer_ids=cfg.model.target_layer_ids)
        head = FrozenTargetHead.from_pretrained(cfg.target.path, dtype=TORCH_DTYPES["float32"], device="cpu")
        total = estimate_total_steps(self.dataset, cfg.objective, num_epochs=1, world_size=1)
        trainer = DrafterTrainer(cfg, model_config, head, device="cpu", total_steps=total)
        readers = ReaderCache("cpu")
        self.opened.callback(readers.close)
        link = self._link(identity)
        drafter = DrafterLoop(cfg, 0, trainer=trainer, link=link, readers=readers, group=SoloGroup(),
                              queue=RecordingQueue(self.dataset, max_anchors_per_seq=cfg.objective.max_anchors_per_seq),
                              store=CheckpointStore(cfg.files.checkpoints))
        registered = link.request(p.Register(role="drafter", rank=0, pid=os.getpid(), device="cpu",
                                             replaces_pids=list(replaces_pids),
                                             secret=read_job_secret(cfg.files.job_secret)), timeout_s=10.0)
        assert isinstance(registered, p.Registered), registered
        drafter.resume(registered)
        return drafter

    def step(self, drafter: DrafterLoop) -> bool:
        """One pass of each, in turn; False once the drafter is drained."""
        assert time.monotonic() < self.deadline, self.server.dispatcher.status()
        going = drafter.pass_once()
        self.serving = self.serving and self.target.pass_once()
        return going

    def finish(self, drafter: DrafterLoop) -> None:
        """The drafter's closing checkpoint; its commit ends the job, and both get `Shutdown`."""
        drafter.finish()
        while self.serving:
            self.serving = self.target.pass_once()
            assert time.monotonic() < self.deadline, self.server.dispatcher.status()
        assert self.target.shutdown_reason == "job finished"

    def check_exactly_once(self) -> None:
        """The ledger's audit: every sample of the epoch committed once, the job finished."""
        ledger = self.server.dispatcher.ledger
        report = ledger.audit({0: range(NUM_SAMPLES)})
        assert report.ok and report.num_commit_records == NUM_SAMPLES, report.summary()
        assert self.server.dispatcher.finished

    def check_features(self, drafter: DrafterLoop) -> None:
        """Each copy the drafter queued holds what the target computes for its samples."""
        for sample_ids, features in drafter.queue.arrived:
            padded = int(max(self.dataset.lengths[s] for s in sample_ids))
            expected = torch.zeros(features.shape)
            self.capture.forward_into(*self.target.worker.batch_tokens(sample_ids, padded), expected)
            torch.testing.assert_close(features, expected)
            assert features.abs().sum() > 0


def test_dispatcher_target_and_drafter_loops_commit_an_epoch_exactly_once(tmp_path, tiny_cache):
    with contextlib.ExitStack() as opened:
        job = InprocJob(tmp_path, tiny_cache, opened)
        # More batches than slots: slots are freed by consumption and leased again.
        assert len(job.epochs[0]) > 2 * job.cfg.target.num_slots
        drafter = job.new_drafter()
        assert drafter.resumed_from == -1
        # Turn about, until the drafter is drained and the target told to stop (the commit of
        # the last samples ends the job: it may come in a pass or in the closing checkpoint).
        while job.step(drafter):
            pass
        job.finish(drafter)

    job.check_exactly_once()
    ledger, step = job.server.dispatcher.ledger, drafter.trainer.step_count
    # Committed sample by sample over several checkpoints, the last one the closing checkpoint's.
    assert len(ledger.committed_steps()) >= 2 and ledger.committed_steps()[-1] == step
    assert drafter.store.latest() == drafter.store.path(step)
    lengths = job.dataset.lengths
    assert job.target.batches == len(job.epochs[0]) and job.target.tokens == int(lengths.sum())
    # The hidden states arrived, every sample's once, as the target computed them.
    assert sorted(s for ids, _ in drafter.queue.arrived for s in ids) == list(range(NUM_SAMPLES))
    job.check_features(drafter)
    assert drafter.queue.trained_tokens == int(lengths.sum())  # every token through a step, once


def test_a_drafter_restarted_after_a_commit_resumes_from_it_and_the_epoch_is_still_committed_once(
        tmp_path, tiny_cache):
    """The old drafter trained past its last commit, then died (it is no longer stepped); its
    successor takes the seat (it names the old pid), resumes from the committed checkpoint, and
    what the old one had not committed is trained again, once."""
    with contextlib.ExitStack() as opened:
        job = InprocJob(tmp_path, tiny_cache, opened)
        old = job.new_drafter("drafter/0")
        every = job.cfg.checkpoint.every_steps
        while old.trainer.step_count < every + 1:  # one commit, and a step after it
            assert job.step(old)
        committed = job.server.dispatcher.ledger.last_committed_step()
        assert committed == every and not job.server.dispatcher.finished
        new = job.new_drafter("drafter/0-successor", replaces_pids=[os.getpid()])
        assert new.resumed_from == committed and new.trainer.step_count == committed
        assert job.server.dispatcher.drafter_generation == 1
        while job.step(new):
            pass
        job.finish(new)

    job.check_exactly_once()
    # The new drafter received what the old one had not committed, each sample once.
    old_committed = {s for r in job.server.dispatcher.ledger.history() if r.step == committed for s in r.sample_ids}
    assert 0 < len(old_committed) < NUM_SAMPLES
    assert sorted(s for ids, _ in new.queue.arrived for s in ids) == sorted(set(range(NUM_SAMPLES)) - old_committed)
    job.check_features(new)
