"""The K processes of one tensor-parallel target worker: their group, and the leader's batches.

    group = WorkerGroup.join(cfg, rank, tp_rank, device)   # each process of target rank `rank`
    leader (tp_rank 0):  group.announce(sample_ids, padded_len) before it computes a batch,
                         group.keepalive() while idle, group.close(clean) at the end (its
                         end_of_work: the followers' next_batch returns None)
    follower:            while (work := group.next_batch()) is not None: the same forward

The leader is the worker to everyone else: it registers, pulls, owns the slot pool and writes
the features. A follower only needs to run the leader's forward passes in the same order, so
what travels is a batch's sample ids and padded length (int64 tensors, nothing pickled); every
rank reads the token ids from its own map of the dataset.

The group is its processes' default torch.distributed group (transformers' tensor-parallel
mesh is built on it): NCCL on GPUs, gloo on CPU. The batch broadcasts go over gloo (a second
group on GPUs), so a follower waiting for work holds no GPU stream. It waits by polling an
asynchronous broadcast, not in a blocking call, so SIGTERM reaches its Python handler. The
leader sends a keepalive when idle, so a follower that hears nothing for `control_timeout_s`
knows its leader is gone (gloo also fails the wait at once when the leader's process closes its
sockets). Where they meet: `$DFLASH_IPC_TP_ADDRESS`, a fresh address per start of the group,
set by the supervisor (supervise/target_groups.py).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_ipc.errors import ConfigError, WorkerDeadError

log = logging.getLogger(__name__)

ADDRESS_ENV = "DFLASH_IPC_TP_ADDRESS"
KEEPALIVE_S = 1.0       # the idle leader broadcasts at least this often
# A waiting follower checks its broadcast after 0.2 ms, doubling up to 5 ms: back-to-back
# batches are seen at once, and an idle follower costs no core.
POLL_S = (0.0002, 0.005)
BATCH, KEEPALIVE, STOP, ABORT = 1, 2, 3, 4


def control_timeout_s(cfg) -> float:
    """Longest silence of the leader: registration (up to the startup timeout, twice after a
    dispatcher restart) and a dispatcher heartbeat timeout; idle, it sends keepalives."""
    return 2 * cfg.supervise.startup_timeout_s + cfg.dispatch.heartbeat_timeout_s


class WorkerGroup:
    """One process's end of its target worker's group."""

    def __init__(self, tp_rank: int, size: int, control) -> None:
        self.tp_rank, self.size, self.control = tp_rank, size, control
        self._last_sent = time.monotonic()

    @classmethod
    def join(cls, cfg, rank: int, tp_rank: int, device: str) -> "WorkerGroup":
        """Meets the other `target.gpus_per_worker - 1` processes of target rank `rank`."""
        address = os.environ.get(ADDRESS_ENV)
        if not address:
            raise ConfigError(f"target/{rank}: target.gpus_per_worker={cfg.target.gpus_per_worker} needs "
                              f"${ADDRESS_ENV} (tcp://HOST:PORT where its processes meet); the supervisor sets it")
        size = cfg.target.gpus_per_worker
        backend = "nccl" if device.startswith("cuda") else "gloo"
        timeout = timedelta(seconds=control_timeout_s(cfg))
        log.info("target/%d: rank %d of a %d-process worker (%s) at %s", rank, tp_rank, size, backend, address)
        dist.init_process_group(backend, init_method=address, rank=tp_rank, world_size=size, timeout=timeout,
                                device_id=torch.device(device) if backend == "nccl" else None)
        control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
        return cls(tp_rank, size, control)

    # --- leader ------------------------------------------------------------------------------

    def _send(self, kind: int, sample_ids=(), padded_len: int = 0) -> None:
        dist.broadcast(torch.tensor([kind, padded_len, len(sample_ids)], dtype=torch.long), src=0, group=self.control)
        if kind == BATCH and sample_ids:
            dist.broadcast(torch.tensor(list(sample_ids), dtype=torch.long), src=0, group=self.control)
        self._last_sent = time.monotonic()

    def announce(self, sample_ids: list[int], padded_len: int) -> None:
        """The followers run this batch with the leader (called right before its forward)."""
        self._send(BATCH, sample_ids, padded_len)

    def keepalive(self) -> None:
        """Called while idle: tells the followers their leader lives (at most every KEEPALIVE_S)."""
        if time.monotonic() - self._last_sent >= KEEPALIVE_S:
            self._send(KEEPALIVE)

    # --- follower ----------------------------------------------------------------------------

    def _receive(self, tensor: torch.Tensor) -> torch.Tensor:
        work = dist.broadcast(tensor, src=0, group=self.control, async_op=True)
        delay = POLL_S[0]
        while not work.is_completed():
            time.sleep(delay)  # Python runs between sleeps: SIGTERM unwinds the follower
            delay = min(2 * delay, POLL_S[1])
        work.wait()  # raises if the broadcast failed (the leader's process is gone)
        return tensor

    def next_batch(self) -> tuple[list[int], int] | None:
        """The leader's next batch (sample ids, padded length), or None when it finished."""
        while True:
            kind, padded_len, count = self._receive(torch.zeros(3, dtype=torch.long)).tolist()
            if kind == BATCH:
                ids = self._receive(torch.zeros(count, dtype=torch.long)).tolist() if count else []
                return ids, int(padded_len)
            if kind == STOP:
                return None
            if kind == ABORT:
                raise WorkerDeadError(f"target rank {self.tp_rank}: the leader of the worker stopped on an error")

    # --- the end -----------------------------------------------------------------------------

    def end_of_work(self, clean: bool = True) -> None:
        """The leader: no more batches; the followers' `next_batch` returns None (`clean`) or
        raises (the leader stops on an error)."""
        if self.tp_rank == 0:
            self._send(STOP if clean else ABORT)

    def close(self, clean: bool) -> None:
        """The leader ends the followers' work (they exit 0 when `clean`, else non-zero); then
        every process leaves the group."""
        try:
            self.end_of_work(clean)
        except Exception as exc:  # a follower already gone: nothing to tell
            log.warning("could not tell the followers to stop: %s", exc)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
