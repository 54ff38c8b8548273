"""A whole job in one process, one thread: the real `Dispatcher`, a `TargetLoop` on the tiny CPU
target writing into a shared-memory slot pool, and a `DrafterLoop` with the real trainer,
stepped in turn over real links on an ipc:// socket until the epoch is committed.

What it shows that the stepped tests of each part cannot: the three speak one protocol
(registration, credits, Batch/Produced/Assign/Consumed, Committed/CommitDone, EndOfData,
Shutdown), every sample of the epoch is committed exactly once, and the hidden states the
drafter trained on are the ones the target computed, after their trip through the pool.
"""

import contextlib
import os
import time
import uuid

import numpy as np
import pytest
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

NUM_SAMPLES = 24
POLL_S = 0.002     # a waiting link's poll between two pumps of the dispatcher
JOB_BOUND_S = 60   # the passes take ~0.5 s on a busy 2-core machine


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


def test_dispatcher_target_and_drafter_loops_commit_an_epoch_exactly_once(tmp_path, tiny_cache):
    cfg = job_config(tmp_path, tiny_cache)
    dataset = TokenDataset(cfg.data.path)
    epochs = plan_job(cfg, dataset.lengths)
    # More batches than slots: slots are freed by consumption and leased again.
    assert len(epochs[0]) > 2 * cfg.target.num_slots
    address = f"ipc://{tmp_path}/dispatcher.sock"
    with contextlib.ExitStack() as opened:
        server = InprocDispatcher(Dispatcher(epochs, num_targets=1, num_drafters=1),
                                  address)
        opened.callback(server.close)
        # the target: the tiny model on CPU, its pool in shared memory
        capture = FeatureCapture(cfg.target.path, layer_ids=cfg.model.target_layer_ids, dtype="float32",
                                 attn_implementation=cfg.target.attn_implementation, device="cpu")
        pool = ShmSlotPool(SlotLayout(num_slots=cfg.target.num_slots,
                                      max_tokens=SlotLayout.required_max_tokens(cfg.data.token_budget),
                                      feature_dim=capture.feature_dim, dtype="float32"),
                           name=f"dflash-test-inproc-{uuid.uuid4().hex[:8]}")
        opened.callback(pool.close)
        target_link = PumpedLink(address, "target/0", server)
        opened.callback(target_link.close)
        target = TargetLoop(TargetWorker(capture, dataset, pool), target_link, idle_wait_s=0.0,
                            registration=p.Register(role="target", rank=0, pid=os.getpid(), device="cpu",
                                                    pool=pool.descriptor(), num_slots=cfg.target.num_slots),
                            prefetch=cfg.target.prefetch, register_timeout_s=10.0)
        # the drafter: the real trainer on the tiny target's width, a group of one
        model_config = DFlashConfig.from_target_config(
            load_target_config(cfg.target.path), num_draft_layers=cfg.model.num_layers,
            block_size=cfg.model.block_size, mask_token_id=cfg.model.mask_token_id,
            target_layer_ids=cfg.model.target_layer_ids)
        head = FrozenTargetHead.from_pretrained(cfg.target.path, dtype=TORCH_DTYPES["float32"], device="cpu")
        total = estimate_total_steps(dataset, cfg.objective, num_epochs=1, world_size=1)
        trainer = DrafterTrainer(cfg, model_config, head, device="cpu", total_steps=total)
        drafter_link = PumpedLink(address, "drafter/0", server)
        opened.callback(drafter_link.close)
        readers = ReaderCache("cpu")
        opened.callback(readers.close)
        queue = RecordingQueue(dataset, max_anchors_per_seq=cfg.objective.max_anchors_per_seq)
        drafter = DrafterLoop(cfg, 0, trainer=trainer, queue=queue, readers=readers, link=drafter_link,
                              group=SoloGroup(), store=CheckpointStore(cfg.files.checkpoints))

        target.register()
        registered = drafter_link.request(p.Register(role="drafter", rank=0, pid=os.getpid(), device="cpu"),
                                          timeout_s=10.0)
        assert isinstance(registered, p.Registered) and drafter.resume(registered) == -1
        # Turn about, until the drafter is drained and the target told to stop (the commit of
        # the last samples ends the job: it may come in a pass or in the closing checkpoint).
        deadline = time.monotonic() + JOB_BOUND_S
        serving = True
        while drafter.pass_once():
            serving = serving and target.pass_once()
            assert time.monotonic() < deadline, server.dispatcher.status()
        drafter.finish()  # returns on the Shutdown that follows the last commit
        while serving:
            serving = target.pass_once()
            assert time.monotonic() < deadline, server.dispatcher.status()
        assert target.shutdown_reason == "job finished"

    ledger = server.dispatcher.ledger
    report = ledger.audit({0: range(NUM_SAMPLES)})
    assert report.ok and report.num_commit_records == NUM_SAMPLES, report.summary()
    # Committed sample by sample over several checkpoints, the last one the closing checkpoint's.
    assert server.dispatcher.finished and ledger.committed_steps()[-1] == trainer.step_count
    assert len(ledger.committed_steps()) >= 2
    assert drafter.store.latest() == drafter.store.path(trainer.step_count)
    assert target.batches == len(epochs[0]) and target.tokens == int(dataset.lengths.sum())
    # The hidden states arrived: each copy holds what the target computes for its samples.
    assert sorted(s for ids, _ in queue.arrived for s in ids) == list(range(NUM_SAMPLES))
    worker = target.worker
    for sample_ids, features in queue.arrived:
        padded = int(max(dataset.lengths[s] for s in sample_ids))
        expected = torch.zeros(features.shape)
        capture.forward_into(*worker.batch_tokens(sample_ids, padded), expected)
        torch.testing.assert_close(features, expected)
        assert features.abs().sum() > 0
    assert drafter.queue.trained_tokens == int(dataset.lengths.sum())  # every token through a step, once
