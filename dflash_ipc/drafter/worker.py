"""The drafter process (`dflash-ipc drafter --rank N`): builds a rank and runs its loop.

    register -> join the group (MASTER_PORT + the dispatcher's generation) -> build the model,
    trainer and queue -> DrafterLoop.resume -> pass_once until drained -> finish

The loop itself (`loop.py`) knows nothing of sockets or torch.distributed beyond the link
and group objects built here. SIGTERM/SIGINT while it runs set its stop reason: the group
finishes the step, checkpoints together and exits (code 143); outside the loop they unwind
at once (SystemExit).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Callable

import torch

from dflash_ipc.wire import protocol as p
from dflash_ipc.config.schema import JobConfig
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.run.checkpoints import CheckpointStore
from dflash_ipc.run.compile_workers import compile_in_process
from dflash_ipc.drafter.group import close_group, init_group
from dflash_ipc.drafter.loop import DrafterLoop
from dflash_ipc.drafter.faults import SlowSteps
from dflash_ipc.drafter.fit import probe_drafter_step
from dflash_ipc.drafter.model import DFlashConfig
from dflash_ipc.drafter.sequence_queue import SequenceQueue
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.drafter.trainer import DrafterTrainer, estimate_total_steps
from dflash_ipc.config.dtypes import TORCH_DTYPES
from dflash_ipc.errors import WorkerDeadError
from dflash_ipc.wire.link import DispatcherLink
from dflash_ipc.run.liveness import Beacon
from dflash_ipc.obs.timelines import TimelineWriter
from dflash_ipc.obs.profiling import IterationProfiler
from dflash_ipc.config.machine import require_device
from dflash_ipc.wire.security import read_job_secret
from dflash_ipc.run.child_env import replaced_pids, supervisor_pid
from dflash_ipc.hf.target_config import load_target_config
from dflash_ipc.transport.backends import ReaderCache, check_peer_access

log = logging.getLogger(__name__)


class StopOnSignal:
    """While entered, SIGTERM/SIGINT set `loop.stop_reason` instead of unwinding: the group
    leaves together after a closing checkpoint. A signal that comes because the supervisor
    died (the parent-death signal) unwinds at once: nobody is left to commit a checkpoint.
    It unwinds once: later signals (`ParentWatch` sends another) are ignored from then on, on
    leaving too, so they cannot cut the unwinding short."""

    def __init__(self, loop: DrafterLoop) -> None:
        self.loop = loop
        self._previous: dict = {}
        self._parent = supervisor_pid() or os.getppid()
        self._unwinding = False

    def __enter__(self) -> "StopOnSignal":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if os.getppid() != self._parent:
            self._unwinding = True
            for sig in self._previous:
                signal.signal(sig, signal.SIG_IGN)
            raise SystemExit(128 + signum)
        self.loop.stop_reason = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        if self._unwinding:
            return  # keep ignoring: the handlers before us would raise again
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_drafter(cfg: JobConfig, rank: int, *,
                validator_factory: Callable[[JobConfig, str], Callable] | None = None) -> None:
    """Entry point of `dflash-ipc drafter --rank N`. `validator_factory(cfg, device)`: rank 0's
    held-out validator when validation.prompts > 0 (the command passes eval's: this package
    sits below it)."""
    device = cfg.drafter.device_of(rank)
    require_device(device, "drafter.devices")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        # Fail at start, naming the pair, rather than at the first slot this drafter opens.
        check_peer_access([cfg.target.device_of(r) for r in cfg.local_ranks("target")], [device])
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, cfg.drafter.num_workers)))
    compile_in_process()  # no compile-worker pool starving this process's host work (run/compile_workers.py)
    slow_steps = SlowSteps.from_env()  # a fault test's injection, or None (checked before anything starts)
    beacon = Beacon(cfg.files.beacon(f"drafter/{rank}"))
    link = DispatcherLink.for_job(cfg, f"drafter/{rank}")
    try:
        # Register first: the dispatcher says which generation of the group this is (where
        # to meet) and from which committed step it resumes.
        registered = link.request(p.Register(role="drafter", rank=rank, pid=os.getpid(), device=device,
                                             node=cfg.node_of("drafter", rank), replaces_pids=replaced_pids(),
                                             secret=read_job_secret(cfg.files.job_secret)),
                                  timeout_s=cfg.supervise.startup_timeout_s)
        if not isinstance(registered, p.Registered):
            raise WorkerDeadError(f"drafter/{rank}: registration refused: {registered}")
        group = init_group(cfg, rank, device, registered.generation)
        try:
            validator = (validator_factory(cfg, device) if validator_factory is not None and rank == 0
                         and cfg.validation.prompts else None)
            _build_and_run(cfg, rank, device, link, group, beacon, registered, slow_steps, validator)
        finally:
            close_group(group)
    finally:
        link.close()
        beacon.close()


def _build_and_run(cfg: JobConfig, rank: int, device: str, link: DispatcherLink, group, beacon: Beacon,
                   registered: p.Registered, slow_steps: SlowSteps | None = None, validator=None) -> None:
    dataset = TokenDataset(cfg.data.path)
    model_config = DFlashConfig.from_target_config(
        load_target_config(cfg.target.path), num_draft_layers=cfg.model.num_layers, block_size=cfg.model.block_size,
        mask_token_id=cfg.model.mask_token_id, target_layer_ids=cfg.model.target_layer_ids,
        layer_types=cfg.model.layer_types, sliding_window=cfg.model.sliding_window)
    head = FrozenTargetHead.from_pretrained(cfg.target.path, dtype=TORCH_DTYPES[cfg.drafter.dtype], device=device)
    total = estimate_total_steps(dataset, cfg.objective, num_epochs=cfg.data.num_epochs, world_size=cfg.total_drafters)
    trainer = DrafterTrainer(cfg, model_config, head, device=device, total_steps=total)
    probe_drafter_step(trainer, dataset, cfg, TORCH_DTYPES[cfg.target.dtype])  # fits, or a ConfigError
    log.info("drafter: %.1fM trainable parameters, ~%d steps planned, attention %s",
             sum(x.numel() for x in trainer.model.parameters()) / 1e6, total, trainer.backend)
    readers = ReaderCache(device)
    timeline = TimelineWriter(cfg.files.timeline(f"drafter/{rank}"), f"drafter/{rank}")
    step_log = open(cfg.files.drafter_metrics, "a") if rank == 0 else None
    loop = DrafterLoop(cfg, rank, trainer=trainer, queue=SequenceQueue(dataset,
                       max_anchors_per_seq=cfg.objective.max_anchors_per_seq), readers=readers, link=link,
                       group=group, store=CheckpointStore(cfg.files.checkpoints), beacon=beacon, timeline=timeline,
                       step_log=step_log, after_step=slow_steps, validator=validator)
    profiler = IterationProfiler(f"drafter/{rank}", trainer.device)
    try:
        loop.resume(registered)
        # Group set-up, model load and resume happened since the registration reply: the
        # dispatcher was not silent, we were not listening.
        link.last_heard = time.monotonic()
        with StopOnSignal(loop):
            step = trainer.step_count
            while loop.pass_once():
                if trainer.step_count != step:
                    step = trainer.step_count
                    profiler.step()
        profiler.finish()
        loop.finish()  # the group is done with collectives: signals unwind again
    finally:
        readers.close()
        timeline.close()
        if step_log is not None:
            step_log.close()
