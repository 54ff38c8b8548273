"""Where the processes of a multi-process target worker meet: one fresh address per start.

A target worker of `target.gpus_per_worker` K > 1 is K processes in a torch.distributed group
of their own (target/worker_group.py), which they join at `$DFLASH_IPC_TP_ADDRESS`. Every start
of the worker (the first, and each restart of all K) gets a new loopback port: the store of a
group that just died may linger on the old one. The K processes of one start are told the same
address whatever order they are started in, since they all carry the same restart count.
A worker's processes are on one node, so loopback is enough.
"""

from __future__ import annotations

from typing import Callable

from dflash_ipc.supervise.roles import Role
from dflash_ipc.target.worker_group import ADDRESS_ENV


class WorkerAddresses:
    """The rendezvous address of each target worker's current start."""

    def __init__(self, gpus_per_worker: int, pick_port: Callable[[], int]) -> None:
        self.gpus_per_worker = gpus_per_worker
        self.pick_port = pick_port  # a free loopback port
        self._current: dict[int, tuple[int, str]] = {}  # target rank -> (start number, address)

    def env(self, role: Role, start: int) -> dict[str, str]:
        """What to add to the environment of `role` for its `start`-th start (0: the first)."""
        if role.kind != "target" or self.gpus_per_worker == 1:
            return {}
        known = self._current.get(role.rank)
        if known is None or known[0] != start:
            known = self._current[role.rank] = (start, f"tcp://127.0.0.1:{self.pick_port()}")
        return {ADDRESS_ENV: known[1]}
