"""The drafter group's small collectives, behind one interface the loop is written against.

Gradients are all-reduced by the trainer over the gradient group (NCCL when every drafter
has its own GPU, gloo otherwise); the loop's control traffic (the per-iteration agreement,
the checkpoint's trained-sample lists, the resume step) travels over a gloo group, so it
never touches the GPU stream. `SoloGroup` is the world of one (and what unit tests step).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class SoloGroup:
    """A group of one rank: every collective is the identity."""
    rank, world = 0, 1

    def agree(self, flags: list[float]) -> list[float]:
        return list(flags)

    def gather_rows(self, rows: list[tuple[int, ...]], width: int) -> list[list[tuple[int, ...]]]:
        return [list(rows)]

    def broadcast_int(self, value: int) -> int:
        return value


class DistributedGroup:
    """The real group: torch.distributed, control collectives over `control` (gloo)."""

    def __init__(self, rank: int, world: int, control) -> None:
        self.rank, self.world, self.control = rank, world, control

    def agree(self, flags: list[float]) -> list[float]:
        """Sums each flag over the ranks."""
        t = torch.tensor(flags, dtype=torch.float64)
        dist.all_reduce(t, group=self.control)
        return t.tolist()

    def gather_rows(self, rows: list[tuple[int, ...]], width: int) -> list[list[tuple[int, ...]]]:
        """Each rank's rows of `width` ints, by rank (tensors: nothing pickled)."""
        count = torch.tensor([len(rows)], dtype=torch.long)
        counts = [torch.zeros(1, dtype=torch.long) for _ in range(self.world)]
        dist.all_gather(counts, count, group=self.control)
        longest = max(1, max(int(c) for c in counts))
        mine = torch.full((longest, width), -1, dtype=torch.long)
        if rows:
            mine[:len(rows)] = torch.tensor(rows, dtype=torch.long)
        everyone = [torch.empty(longest, width, dtype=torch.long) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.control)
        return [[tuple(int(v) for v in row) for row in t[:int(n)].tolist()] for t, n in zip(everyone, counts)]

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank."""
        t = torch.tensor([value], dtype=torch.long)
        dist.broadcast(t, src=0, group=self.control)
        return int(t.item())


def rendezvous_address(generation: int) -> str:
    """Where the drafter group of `generation` meets: MASTER_ADDR:MASTER_PORT + generation
    (the torchrun variables; the supervisor sets them, a multi-node launch passes them). Each
    group restart moves one port up, so a new group never finds the old one's store."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500")) + generation
    return f"tcp://[{addr}]:{port}" if ":" in addr else f"tcp://{addr}:{port}"


def init_group(cfg, rank: int, device: str, generation: int) -> DistributedGroup | SoloGroup:
    """Joins the drafter group of every node (world 1: no process group at all)."""
    world = cfg.total_drafters
    if world == 1:
        return SoloGroup()
    local = cfg.drafter.num_workers
    devices = [cfg.drafter.device_of(r) for r in range(local)]
    # NCCL needs one GPU per rank; drafters sharing a GPU (e.g. 3 on one of 2 GPUs) fall back
    # to gloo, which reduces gradients through host memory (gradients only, never features).
    backend = "nccl" if device.startswith("cuda") and len(set(devices)) == local else "gloo"
    if device.startswith("cuda") and backend == "gloo":
        log.warning("drafters share GPUs %s: gradients are all-reduced with gloo (slower than NCCL)",
                    sorted(set(devices)))
    # A rank that never comes (its node died) must not block the others for torch's default
    # 30 minutes: past this the group fails and the supervisors restart it.
    sup = cfg.supervise
    timeout = timedelta(seconds=max(sup.startup_timeout_s, sup.drafter_compile_timeout_s,
                                    sup.drafter_checkpoint_timeout_s))
    address = rendezvous_address(generation)
    log.info("drafter group generation %d: rank %d of %d (%s) at %s", generation, rank, world, backend, address)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world, timeout=timeout,
                            device_id=torch.device(device) if backend == "nccl" else None)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    return DistributedGroup(rank, world, control)


def close_group(group) -> None:
    if isinstance(group, DistributedGroup) and dist.is_initialized():
        dist.destroy_process_group()
