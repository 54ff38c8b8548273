"""Which backend a device gets: the entry points that pick shared memory or CUDA IPC.

`slots.py` is the interface both backends implement; this module knows both of them, so
neither backend imports it and the interface imports neither:

    pool = create_pool(SlotLayout(8, budget, 5 * hidden, "bfloat16"), "cuda:0", name=f"{run}-t0")
    readers = ReaderCache("cuda:5")                  # a drafter opens each pool once
    hidden = readers.get(descriptor).read(slot, n)   # [n, D] on cuda:5
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dflash_ipc.errors import TransportError
from dflash_ipc.transport.cuda_ipc import CudaIpcSlotPool, CudaIpcSlotReader, check_pair
from dflash_ipc.transport.shm import ShmSlotPool, ShmSlotReader
from dflash_ipc.transport.shm import unlink_segments_with_prefix as unlink_segments  # noqa: F401 (supervisor clean-up)
from dflash_ipc.transport.slots import (
    DEFAULT_READ_TIMEOUT_S,
    SlotLayout,
    SlotPool,
    SlotReader,
    check_publish_sync,
    validate_descriptor,
)

logger = logging.getLogger(__name__)


def as_device(device: torch.device | str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise TransportError(f"bad device {device!r}: expected 'cpu' or 'cuda:N'") from exc
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise TransportError(f"device {device!r}: slot pools live on 'cpu' or 'cuda:N' only")
    return dev


def create_pool(
    layout: SlotLayout, device: torch.device | str, *, name: str,
    publish_sync: str = "ipc_event",
) -> SlotPool:
    """Allocate a pool on ``device``: ``cpu`` gives shared memory, ``cuda:N`` CUDA IPC.

    ``name`` starts with the run's prefix (the supervisor cleans up leftovers by prefix);
    the producer's pid is appended, so a restarted worker never collides with the
    leftovers of the one it replaces. ``publish_sync`` (one of ``PUBLISH_SYNC_MODES``)
    matters on GPUs only: host writes to shared memory are done when ``publish`` runs.
    """
    check_publish_sync(publish_sync)
    dev = as_device(device)
    if dev.type == "cpu":
        return ShmSlotPool(layout, name=name)
    return CudaIpcSlotPool(layout, dev, name=name, publish_sync=publish_sync)


def open_reader(
    descriptor: dict[str, Any],
    device: torch.device | str,
    *,
    timeout_s: float = DEFAULT_READ_TIMEOUT_S,
) -> SlotReader:
    """Open a producer's pool for reading into ``device``; backend from ``descriptor``."""
    backend = validate_descriptor(descriptor)
    dev = as_device(device)
    if backend == "shm":
        return ShmSlotReader(descriptor, dev, timeout_s=timeout_s)
    return CudaIpcSlotReader(descriptor, dev, timeout_s=timeout_s)


class ReaderCache:
    """Opens each producer pool once (opening a CUDA handle costs ~40 ms) and keeps it."""

    def __init__(
        self, device: torch.device | str, *, timeout_s: float = DEFAULT_READ_TIMEOUT_S
    ) -> None:
        self.device = as_device(device)
        self.timeout_s = timeout_s
        self._readers: dict[str, SlotReader] = {}

    def get(self, descriptor: dict[str, Any]) -> SlotReader:
        validate_descriptor(descriptor)
        pool_id = descriptor["pool_id"]
        reader = self._readers.get(pool_id)
        if reader is None:
            reader = open_reader(descriptor, self.device, timeout_s=self.timeout_s)
            self._readers[pool_id] = reader
            logger.info("opened slot pool %s on %s", pool_id, self.device)
        return reader

    def drop(self, pool_id: str) -> None:
        """Close and forget one pool (its producer died or was replaced)."""
        reader = self._readers.pop(pool_id, None)
        if reader is not None:
            reader.close()

    def __len__(self) -> int:
        return len(self._readers)

    def close(self) -> None:
        for pool_id in list(self._readers):
            self.drop(pool_id)


def check_peer_access(target_devices: list[str], drafter_devices: list[str]) -> None:
    """TransportError naming the first (target GPU, drafter GPU) pair without peer access.

    A drafter maps each target's pool into its own device and copies over NVLink/PCIe, so
    every drafter GPU must reach every target GPU. CPU targets (shm) need nothing.
    """
    targets = [as_device(d) for d in target_devices]
    drafters = [as_device(d) for d in drafter_devices]
    for t in targets:
        for d in drafters:
            if t.type == "cpu":
                continue
            if d.type != "cuda":
                raise TransportError(
                    f"target {t} uses CUDA IPC slots but drafter device {d} is not a GPU: "
                    "put targets and drafters both on cuda:N or both on cpu"
                )
            check_pair(t, d)
