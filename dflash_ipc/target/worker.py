"""The target worker: pulls batches, runs the frozen target, fills hidden-state slots.

`TargetWorker` computes one batch into its slot; `TargetLoop` (loop.py) is the busy loop
around it (register, queue, compute, report, shutdown), stepped by tests with fakes;
`run_target` is the process: it loads the model, creates the pool, connects the link and
runs the loop until `Shutdown` (`serve`: again on a fresh loop after a dispatcher restart).
The pool is closed (its segment unlinked) on every way out.

With `target.gpus_per_worker` K > 1 the worker is K processes (`--tp-rank 0..K-1`) holding one
tensor-parallel model (target/tensor_parallel.py): rank 0, the leader, runs the loop above and
hands each batch to the followers just before computing it (worker_group.py); a follower
(`follow`) runs the same forward passes and writes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import numpy as np
import torch

from dflash_ipc.wire import protocol as p
from dflash_ipc.config.schema import JobConfig
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.target.fit import check_pool_fits, probe_target_batch
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.wire.link import DispatcherLink
from dflash_ipc.obs.timelines import TimelineWriter
from dflash_ipc.obs.profiling import IterationProfiler
from dflash_ipc.config.machine import require_device
from dflash_ipc.wire.security import read_job_secret
from dflash_ipc.run.child_env import replaced_pids
from dflash_ipc.target.capture import FeatureCapture
from dflash_ipc.target.loop import TargetLoop, serve
from dflash_ipc.target.worker_group import WorkerGroup
from dflash_ipc.transport.backends import create_pool
from dflash_ipc.transport.slots import SlotLayout, SlotPool

log = logging.getLogger(__name__)


class TargetWorker:
    def __init__(self, capture: FeatureCapture, dataset: TokenDataset, pool: SlotPool | None,
                 group: WorkerGroup | None = None) -> None:
        self.capture = capture
        self.dataset = dataset
        self.pool = pool
        self.group = group  # a tensor-parallel worker's group: this process is its leader
        self.device = capture.device

    def batch_tokens(self, sample_ids: list[int], padded_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded input ids [B, padded_len] and lengths [B], read from the memmap."""
        ids = np.zeros((len(sample_ids), padded_len), dtype=np.int64)
        lengths = np.zeros(len(sample_ids), dtype=np.int64)
        for row, sample_id in enumerate(sample_ids):
            tokens, _ = self.dataset.sample(sample_id)
            ids[row, :len(tokens)] = tokens
            lengths[row] = len(tokens)
        if ids.size and (ids.min() < 0 or ids.max() >= self.capture.vocab_size):
            # An id past the embedding is an index error on CPU and a device-side assert on a GPU.
            row = int(np.argmax((ids < 0).any(axis=1) | (ids >= self.capture.vocab_size).any(axis=1)))
            raise DataError(f"{self.dataset.path}: sample {sample_ids[row]} holds token ids outside "
                            f"[0, {self.capture.vocab_size}), the target's vocabulary; re-run prepare")
        pin = self.device.type == "cuda"
        ids_t, lengths_t = torch.from_numpy(ids), torch.from_numpy(lengths)
        if pin:
            ids_t, lengths_t = ids_t.pin_memory(), lengths_t.pin_memory()
        return (ids_t.to(self.device, non_blocking=True), lengths_t.to(self.device, non_blocking=True))

    def produce(self, batch: p.Batch) -> p.Produced:
        start = time.perf_counter()
        if self.group is not None:
            self.group.announce(batch.sample_ids, batch.padded_len)  # the followers run it with us
        input_ids, lengths = self.batch_tokens(batch.sample_ids, batch.padded_len)
        num_tokens = int(sum(self.dataset.lengths[i] for i in batch.sample_ids))
        view = self.pool.write_view(batch.slot, num_tokens)  # [T, F]
        self.capture.forward_into(input_ids, lengths, view)
        self.pool.publish(batch.slot)
        return p.Produced(batch_id=batch.batch_id, slot=batch.slot, num_tokens=num_tokens,
                          compute_s=time.perf_counter() - start)

    def idle(self) -> None:
        """Nothing to compute: the followers hear that their leader lives."""
        if self.group is not None:
            self.group.keepalive()


def load_capture(cfg: JobConfig, device: str) -> FeatureCapture:
    """The job's target on `device` (a tensor-parallel worker: this rank's shard of it)."""
    return FeatureCapture(cfg.target.path, layer_ids=cfg.model.target_layer_ids, dtype=cfg.target.dtype,
                          attn_implementation=cfg.target.attn_implementation, device=device,
                          tensor_parallel=cfg.target.gpus_per_worker, expert_parallel=cfg.target.expert_parallel)


def run_target(cfg: JobConfig, rank: int, tp_rank: int = 0) -> None:
    """Entry point of `dflash-ipc target --rank N [--tp-rank K]`: the worker (its leader, K = 0)
    or, with target.gpus_per_worker > 1, one of its followers."""
    k = cfg.target.gpus_per_worker
    if not 0 <= tp_rank < k:
        raise ConfigError(f"--tp-rank {tp_rank}: target.gpus_per_worker={k} allows 0..{k - 1}")
    device = cfg.target.devices_of(rank)[tp_rank]
    require_device(device, "target.devices")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    group = WorkerGroup.join(cfg, rank, tp_rank, device) if k > 1 else None
    clean = False
    try:
        capture = load_capture(cfg, device)
        dataset = TokenDataset(cfg.data.path)
        if tp_rank == 0:
            _lead(cfg, rank, capture, dataset, device, group)
        else:
            follow(cfg, capture, dataset, group, device)
        clean = True
    finally:
        if group is not None:
            group.close(clean)


def follow(cfg: JobConfig, capture: FeatureCapture, dataset: TokenDataset, group: WorkerGroup, device: str) -> None:
    """A follower rank: the leader's start-up probe, then its batches, until it stops."""
    worker = TargetWorker(capture, dataset, pool=None)
    probe_target_batch(capture, None, cfg.data, device, longest=int(dataset.lengths.max()))
    batches = 0
    while (work := group.next_batch()) is not None:
        input_ids, lengths = worker.batch_tokens(*work)
        capture.forward_into(input_ids, lengths, None)
        batches += 1
    log.info("the leader finished; %d batches run", batches)


def _lead(cfg: JobConfig, rank: int, capture: FeatureCapture, dataset: TokenDataset, device: str,
          group: WorkerGroup | None) -> None:
    layout = SlotLayout(num_slots=cfg.target.num_slots,
                        max_tokens=SlotLayout.required_max_tokens(cfg.data.token_budget),
                        feature_dim=capture.feature_dim, dtype=cfg.target.dtype)
    check_pool_fits(layout, device)
    # Each resource is closed from the moment it exists, in reverse order: a SIGTERM between
    # two of these lines still unlinks the pool's segment.
    with contextlib.ExitStack() as opened:
        pool = create_pool(layout, device, name=cfg.files.pool_name(rank),
                           publish_sync=cfg.publish_sync_of(rank))
        opened.callback(pool.close)
        # the heaviest batch of the plan fits, or a ConfigError
        probe_target_batch(capture, pool, cfg.data, device, longest=int(dataset.lengths.max()))
        link = DispatcherLink.for_job(cfg, f"target/{rank}")
        opened.callback(link.close)
        worker = TargetWorker(capture, dataset, pool, group)
        timeline = TimelineWriter(cfg.files.timeline(f"target/{rank}"), f"target/{rank}")
        opened.callback(timeline.close)

        def new_loop() -> TargetLoop:
            # The secret is read at each registration: a dispatcher restarted after the file was
            # removed made a new one.
            registration = p.Register(role="target", rank=rank, pid=os.getpid(), device=str(worker.device),
                                      node=cfg.node_of("target", rank), pool=pool.descriptor(),
                                      num_slots=cfg.target.num_slots, replaces_pids=replaced_pids(),
                                      secret=read_job_secret(cfg.files.job_secret))
            return TargetLoop(worker, link, registration=registration, prefetch=cfg.target.prefetch,
                              register_timeout_s=cfg.supervise.startup_timeout_s, timeline=timeline,
                              profiler=IterationProfiler(f"target/{rank}", worker.device))

        serve(new_loop)
