"""The drafter worker: pulls hidden states, trains in lockstep with the other drafters.

Busy loop, one pass:
  1) take waiting messages: for each `Assign`, copy the slot into local memory (the slot's
     reader is opened once per target and cached), split it into sequences, report
     `Consumed` at once so the target can reuse the slot (if the target died first, the
     batch is skipped, unreported: the dispatcher requeues it); ask for more while the
     local queue is short (`WantHidden`),
  2) agree with the group (one small all-reduce) whether every rank has a full step's
     anchors, or everyone is drained after `EndOfData`, or some rank must stop (SIGTERM,
     SIGINT, or a `Shutdown` before the end of the data),
  3) step (all ranks together) when all are full; every `checkpoint_every_steps`, and at
     the end, checkpoint: rank 0 gathers which batches each rank fully trained, writes the
     checkpoint, then reports them in one `Committed` for the group (a commit is all of a
     checkpoint's batches or none: if rank 0 dies between the two, the group restarts from
     the previous commit and trains those batches again, counted once),
  4) once drained: final checkpoint, wait for the dispatcher's `Shutdown`; on a stop: a
     checkpoint of what was trained so far, its commit confirmed by the dispatcher, exit 0.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_ipc import protocol as p
from dflash_ipc.config import JobConfig
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.device_fit import probe_drafter_step
from dflash_ipc.drafter.model import DFlashConfig
from dflash_ipc.drafter.target_head import FrozenTargetHead
from dflash_ipc.drafter.trainer import (DrafterTrainer, Sequence, eligible_anchor_count,
                                        estimate_total_steps)
from dflash_ipc.errors import ProducerGoneError, WorkerDeadError
from dflash_ipc.link import DispatcherLink
from dflash_ipc.metrics import TimelineWriter, process_memory
from dflash_ipc.profiling import IterationProfiler
from dflash_ipc.dtypes import TORCH_DTYPES
from dflash_ipc.resolve import require_device
from dflash_ipc.target.capture import load_target_config
from dflash_ipc.transport.slots import ReaderCache, check_peer_access

log = logging.getLogger(__name__)

COMMIT_CONFIRM_S = 5.0  # on a stop, how long rank 0 waits for the dispatcher to take its commit


class StopFlag:
    """SIGTERM/SIGINT while serving: finish the step, checkpoint with the group, exit 0.
    Outside the serving loop the signals keep unwinding at once (SystemExit)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        self.reason = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class DrafterWorker:
    """Local queue of sequences and the bookkeeping of which batches are fully trained."""

    def __init__(self, cfg: JobConfig, trainer: DrafterTrainer, dataset: TokenDataset,
                 readers: ReaderCache) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.dataset = dataset
        self.readers = readers
        self.fifo: collections.deque[Sequence] = collections.deque()
        self.fifo_anchors = 0
        self.remaining: dict[int, int] = {}   # batch id -> sequences not yet in a step
        self.trained: list[int] = []          # batch ids fully trained, not yet committed
        self.attempt_of: dict[int, int] = {}  # batch id -> the Assign attempt of our copy
        self.wait_s = 0.0
        # Transport cost, cumulative: wall time inside reads, the copies' own time (GPU-timed
        # on cuda_ipc), and bytes read; read_s - copy_s is handoff overhead, not bandwidth.
        self.read_s = self.copy_s = 0.0
        self.read_bytes = self.reads = 0
        self.trained_tokens = 0   # this rank's tokens that went through a step (status: tok_rate)

    def accept(self, msg: p.Assign) -> None:
        """Copies an assigned slot into local memory and queues its sequences."""
        reader = self.readers.get(msg.pool)
        started = time.perf_counter()
        features = reader.read(msg.slot, msg.num_tokens)  # [T, F] local copy
        self.read_s += time.perf_counter() - started
        self.copy_s += reader.last_copy_s or 0.0
        self.read_bytes += features.numel() * features.element_size()
        self.reads += 1
        self._forget(msg.batch_id)
        self.attempt_of[msg.batch_id] = msg.attempt
        offset = 0
        for sample_id in msg.sample_ids:
            ids, mask = self.dataset.sample(sample_id)
            length = len(ids)
            seq = Sequence(batch_id=msg.batch_id, epoch=msg.epoch, sample_id=sample_id,
                           features=features[offset:offset + length],
                           input_ids=torch.from_numpy(ids.astype("int64")),
                           loss_mask=torch.from_numpy(mask.astype(bool)),
                           num_anchors=eligible_anchor_count(mask, self.cfg.objective.max_anchors_per_seq))
            offset += length
            self.fifo.append(seq)
            self.fifo_anchors += seq.num_anchors
        self.remaining[msg.batch_id] = len(msg.sample_ids)

    def _forget(self, batch_id: int) -> None:
        """A batch assigned again (the dispatcher revoked our earlier copy when its target was
        dropped) replaces what is left of the old copy, so it is counted and committed once."""
        if batch_id in self.remaining:
            stale = [seq for seq in self.fifo if seq.batch_id == batch_id]
            self.fifo = collections.deque(seq for seq in self.fifo if seq.batch_id != batch_id)
            self.fifo_anchors -= sum(seq.num_anchors for seq in stale)
            del self.remaining[batch_id]
        if batch_id in self.trained:
            self.trained.remove(batch_id)

    def train_step(self) -> dict:
        chosen = self.trainer.take(self.fifo)
        self.fifo_anchors -= sum(seq.num_anchors for seq, _ in chosen)
        stats = self.trainer.step(chosen)
        self.trained_tokens += sum(seq.features.shape[0] for seq, _ in chosen)
        for seq, _ in chosen:
            self.remaining[seq.batch_id] -= 1
            if self.remaining[seq.batch_id] == 0:
                del self.remaining[seq.batch_id]
                self.trained.append(seq.batch_id)
        return stats

    @property
    def full(self) -> bool:
        return self.fifo_anchors >= self.cfg.objective.anchors_per_step


def rendezvous_address(generation: int) -> str:
    """Where the drafter group of `generation` meets: MASTER_ADDR:MASTER_PORT + generation
    (the torchrun variables; the supervisor sets them, a multi-node launch passes them). Each
    group restart moves one port up, so a new group never finds the old one's store."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500")) + generation
    return f"tcp://[{addr}]:{port}" if ":" in addr else f"tcp://{addr}:{port}"


def _init_group(cfg: JobConfig, rank: int, device: str, generation: int):
    """The drafter group of every node: NCCL for gradients on GPU (gloo on CPU), plus a gloo
    group for the small per-iteration control all-reduce, which must not touch the GPU stream."""
    world = cfg.total_drafters
    local = cfg.drafter.num_workers
    devices = [cfg.drafter.device_of(r) for r in range(local)]
    # NCCL needs one GPU per rank; drafters sharing a GPU (e.g. 3 on one of 2 GPUs) fall back
    # to gloo, which reduces gradients through host memory (gradients only, never features).
    backend = "nccl" if device.startswith("cuda") and len(set(devices)) == local else "gloo"
    if device.startswith("cuda") and backend == "gloo" and world > 1:
        log.warning("drafters share GPUs %s: gradients are all-reduced with gloo (slower than NCCL)",
                    sorted(set(devices)))
    # A rank that never comes (its node died) must not block the others for torch's default
    # 30 minutes: past this the group fails and the supervisors restart it.
    timeout = timedelta(seconds=max(cfg.supervise.startup_timeout_s, cfg.supervise.drafter_timeout_s))
    address = rendezvous_address(generation)
    log.info("drafter group generation %d: rank %d of %d (%s) at %s", generation, rank, world, backend, address)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world, timeout=timeout,
                            device_id=torch.device(device) if backend == "nccl" else None)
    return dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD


def run_drafter(cfg: JobConfig, rank: int) -> None:
    """Entry point of `dflash-ipc drafter --rank N`."""
    device = cfg.drafter.device_of(rank)
    require_device(device, "drafter.devices")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        # Fail at start, naming the pair, rather than at the first slot this drafter opens.
        check_peer_access([cfg.target.device_of(r) for r in cfg.local_ranks("target")], [device])
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, cfg.drafter.num_workers)))
    link = DispatcherLink(cfg.dispatcher_address, identity=f"drafter/{rank}",
                          heartbeat_interval_s=cfg.dispatch.heartbeat_interval_s,
                          timeout_s=cfg.dispatch.heartbeat_timeout_s)
    try:
        # Register first: the dispatcher says which generation of the group this is (where
        # to meet) and from which committed step it resumes.
        registered = link.request(p.Register(role="drafter", rank=rank, pid=os.getpid(), device=device,
                                             node=cfg.node_of("drafter", rank)),
                                  timeout_s=cfg.supervise.startup_timeout_s)
        if not isinstance(registered, p.Registered):
            raise WorkerDeadError(f"drafter/{rank}: registration refused: {registered}")
        control = _init_group(cfg, rank, device, registered.generation)
        try:
            _build_and_serve(cfg, rank, device, link, control, registered)
        finally:
            dist.destroy_process_group()
    finally:
        link.close()


def _build_and_serve(cfg: JobConfig, rank: int, device: str, link: DispatcherLink, control,
                     registered: p.Registered) -> None:
    dataset = TokenDataset(cfg.data.path)
    target_config = load_target_config(cfg.target.path)
    model_config = DFlashConfig.from_target_config(
        target_config, num_draft_layers=cfg.model.num_layers, block_size=cfg.model.block_size,
        mask_token_id=cfg.model.mask_token_id, target_layer_ids=cfg.model.target_layer_ids)
    head = FrozenTargetHead.from_pretrained(cfg.target.path, dtype=TORCH_DTYPES[cfg.drafter.dtype], device=device)
    total = estimate_total_steps(dataset, cfg.objective, num_epochs=cfg.data.num_epochs,
                                 world_size=cfg.total_drafters)
    trainer = DrafterTrainer(cfg, model_config, head, device=device, total_steps=total)
    probe_drafter_step(trainer, dataset, cfg, TORCH_DTYPES[cfg.target.dtype])  # fits, or a ConfigError
    log.info("drafter: %.1fM trainable parameters, ~%d steps planned, attention %s",
             sum(p.numel() for p in trainer.model.parameters()) / 1e6, total, trainer.backend)
    worker = DrafterWorker(cfg, trainer, dataset, ReaderCache(device))
    try:
        _serve(cfg, rank, worker, link, control, registered)
    finally:
        worker.readers.close()


def _serve(cfg: JobConfig, rank: int, worker: DrafterWorker, link: DispatcherLink, control,
           registered: p.Registered) -> None:
    if registered.resume_step >= 0 and registered.resume_step != worker.trainer.step_count:
        # Every drafter gets the same step: the group resumes together, in lockstep.
        worker.trainer.resume(cfg.files.checkpoints, registered.resume_step)
    # Group set-up and model load happened since the registration reply: the dispatcher was
    # not silent, we were not listening.
    link.last_heard = time.monotonic()
    world = cfg.total_drafters
    metrics_file = open(cfg.files.drafter_metrics, "a") if rank == 0 else None
    outstanding, end_of_data, shutdown = 0, False, False
    profiler = IterationProfiler(f"drafter/{rank}", worker.trainer.device)
    timeline = TimelineWriter(cfg.files.timeline(f"drafter/{rank}"), f"drafter/{rank}")
    last_ckpt_step = worker.trainer.step_count
    stop = StopFlag()
    group_waiting = False  # the last agreement found some rank short of a step
    try:
        stop.__enter__()
        while True:
            # 1) take messages; ask for more while the queue is short
            waited = time.perf_counter()
            msg = link.recv(0.0 if worker.full or end_of_data else 0.02)
            while msg is not None:
                if isinstance(msg, p.Assign):
                    outstanding -= 1  # the credit is spent whether or not the copy succeeds
                    if _accept(worker, msg, rank):
                        link.send(p.Consumed(batch_id=msg.batch_id, attempt=msg.attempt))
                elif isinstance(msg, p.EndOfData):
                    end_of_data = True
                elif isinstance(msg, p.Shutdown):
                    shutdown = True
                    break
                msg = link.recv(0.0)
            if shutdown and not end_of_data and stop.reason is None:
                stop.reason = "Shutdown before the end of data"
            # Below the queue cap, or short of a step's anchors whatever the cap (else a queue
            # full of short sequences would wait for ever in lockstep), or while the group
            # waits on another rank: with several nodes the last batches of an epoch may all be
            # produced on this node, and only taking them (the node's slots bound how many)
            # lets the job reach EndOfData, where the short rank steps with what it has.
            if not end_of_data and (len(worker.fifo) < cfg.drafter.fifo_sequences or not worker.full
                                    or group_waiting):
                want = cfg.drafter.prefetch - outstanding
                if want > 0:
                    link.send(p.WantHidden(credits=want))
                    outstanding += want
            # 2) agree: is everyone full, or is everyone drained, or must the group stop?
            drained = end_of_data and not worker.fifo
            flags = torch.tensor([float(worker.full or (end_of_data and bool(worker.fifo))), float(drained),
                                  float(stop.reason is not None)])
            if world > 1:
                dist.all_reduce(flags, group=control)
            if flags[2].item() > 0:
                # Every rank leaves here together: nobody is left waiting in a collective.
                log.info("stopping (%s): checkpoint at step %d", stop.reason or "a peer stops",
                         worker.trainer.step_count)
                if worker.trainer.step_count != last_ckpt_step or worker.trained:
                    _checkpoint_and_commit(cfg, rank, worker, link, control)
                if rank == 0:
                    _confirm_commit(link)  # this commit, or the scheduled one just before
                # Not 0: the supervisor reads exit 0 as "got Shutdown at the end of the job".
                raise SystemExit(128 + signal.SIGTERM)
            if flags[1].item() == world:
                break
            group_waiting = flags[0].item() + flags[1].item() < world
            if group_waiting:
                worker.wait_s += time.perf_counter() - waited
                timeline.record("wait_hidden", waited, time.perf_counter())
                continue
            # 3) step together; checkpoint and commit on schedule
            # this rank's own counts (stats hold the group's totals)
            before = (time.perf_counter(), len(worker.fifo), worker.fifo_anchors, worker.trained_tokens)
            stats = worker.train_step()
            timeline.record("step", before[0], time.perf_counter(), loss=float(stats["loss"]),
                            sequences=before[1] - len(worker.fifo), anchors=before[2] - worker.fifo_anchors,
                            tokens=worker.trained_tokens - before[3])
            profiler.step()
            stats.update(wait_s=worker.wait_s, fifo=len(worker.fifo), rank=rank, time=time.time(),
                         trained_tokens=worker.trained_tokens, read_s=worker.read_s,
                         copy_s=worker.copy_s, read_bytes=worker.read_bytes, reads=worker.reads)
            link.metrics.update({k: float(v) for k, v in stats.items() if isinstance(v, (int, float))})
            link.metrics.update(process_memory(worker.trainer.device))
            if metrics_file is not None:
                metrics_file.write(json.dumps(stats) + "\n")
                metrics_file.flush()
            if stats["step"] % cfg.checkpoint.every_steps == 0:
                _checkpoint_and_commit(cfg, rank, worker, link, control)
                last_ckpt_step = worker.trainer.step_count
        # 4) drained: final checkpoint, then wait for the dispatcher to close the job
        profiler.finish()
        if worker.trainer.step_count != last_ckpt_step or worker.trained:
            _checkpoint_and_commit(cfg, rank, worker, link, control)
        deadline = time.monotonic() + cfg.dispatch.heartbeat_timeout_s
        stop.__exit__()  # the group is done with collectives: signals unwind again
        while not shutdown and time.monotonic() < deadline:
            msg = link.recv(0.5)
            shutdown = isinstance(msg, p.Shutdown)
        if not shutdown:
            # Exit non-zero: the supervisor treats a clean exit as a worker that got Shutdown.
            raise WorkerDeadError(f"drafter/{rank}: trained everything but the dispatcher did not "
                                  f"close the job within {cfg.dispatch.heartbeat_timeout_s:.0f}s")
    finally:
        stop.__exit__()
        timeline.close()
        if metrics_file is not None:
            metrics_file.close()


def _accept(worker: DrafterWorker, msg: p.Assign, rank: int) -> bool:
    """Copies an assigned batch in; False when its target died before the copy.

    Such a batch is not consumed: no `Consumed` is sent, nothing is queued, and the
    dispatcher returns it to pending when it drops the dead target. The dispatcher spent
    one of our credits on it, as the caller counts it, so the next `WantHidden` asks again.
    """
    try:
        worker.accept(msg)
    except ProducerGoneError as exc:
        log.warning("drafter/%d: batch %d lost with its producer target/%d, left to the "
                    "dispatcher to requeue: %s", rank, msg.batch_id, msg.target, exc)
        worker.readers.drop(str(msg.pool.get("pool_id", "")))
        return False
    return True


def _checkpoint_and_commit(cfg: JobConfig, rank: int, worker: DrafterWorker, link: DispatcherLink,
                           control) -> None:
    """Rank 0 writes the checkpoint, then commits every rank's fully trained batches at once."""
    world = cfg.total_drafters
    mine = [(b, worker.attempt_of.pop(b, 0)) for b in worker.trained]
    per_rank = _gather_trained(mine, world, control)
    worker.trained = []
    if rank != 0:
        return
    batch_ids = [b for pairs in per_rank for b, _ in pairs]
    attempts = [a for pairs in per_rank for _, a in pairs]
    ranks = [r for r, pairs in enumerate(per_rank) for _ in pairs]
    path = worker.trainer.save_checkpoint(cfg.files.checkpoints, extra={"batch_ids": sorted(batch_ids)})
    log.info("checkpoint %s", path)
    # The attempts tell the dispatcher which copy each rank trained: a rank may have been
    # given the batch again since (see Dispatcher._superseded).
    link.send(p.Committed(step=worker.trainer.step_count, batch_ids=batch_ids, ranks=ranks,
                          attempts=attempts))


def _confirm_commit(link: DispatcherLink) -> None:
    """Waits until the dispatcher has handled everything sent before (replies come in
    order): a process that exits right after sending would otherwise drop its commit."""
    link.send(p.StatusRequest())
    deadline = time.monotonic() + COMMIT_CONFIRM_S
    try:
        while time.monotonic() < deadline:
            if isinstance(link.recv(max(0.0, deadline - time.monotonic())), p.StatusReply):
                return
    except WorkerDeadError as exc:
        log.warning("the dispatcher did not confirm the last commit (%s)", exc)
        return
    log.warning("the dispatcher did not confirm the last commit within %.0fs: a rerun trains "
                "those batches again from the previous commit", COMMIT_CONFIRM_S)


def _gather_trained(pairs: list[tuple[int, int]], world: int, group) -> list[list[tuple[int, int]]]:
    """Each rank's (batch id, attempt) pairs, by rank: tensors over the gloo group (no
    pickled objects)."""
    if world == 1:
        return [list(pairs)]
    count = torch.tensor([len(pairs)], dtype=torch.long)
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    width = max(1, max(int(c) for c in counts))
    mine = torch.full((width, 2), -1, dtype=torch.long)  # [width, (batch id, attempt)]
    if pairs:
        mine[:len(pairs)] = torch.tensor(pairs, dtype=torch.long)
    everyone = [torch.empty(width, 2, dtype=torch.long) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [[(int(b), int(a)) for b, a in t.tolist() if b >= 0] for t in everyone]
