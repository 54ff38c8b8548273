"""Host tensors to the GPU in one asynchronous copy, so building a batch never waits for the GPU.

A copy from pageable host memory (``tensor.to("cuda")``) returns only once the stream has
drained: PyTorch synchronizes after it. A step's batch (ids, positions, labels, weights, the
attention layout: eleven tensors) built on the host while the previous step still runs
would wait for that step eleven times. Here the tensors are packed byte for byte into one
pinned buffer and sent by one non-blocking copy; the device tensors are views of its
result. The caching host allocator keeps the pinned buffer until the copy that reads it is
done, so the host may go on at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

ALIGN = 16
"""Byte alignment of each tensor in the packed buffer: every dtype's view of it is aligned."""


def packed_offsets(tensors: Sequence[Tensor]) -> tuple[list[int], int]:
    """(byte offset of each tensor in the packed buffer, the buffer's size in bytes)."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return offsets, total


def pack(tensors: Sequence[Tensor], *, pin: bool) -> Tensor:
    """The bytes of ``tensors`` (host tensors) in one uint8 buffer, each at its
    ``packed_offsets`` offset; pinned if ``pin``."""
    offsets, total = packed_offsets(tensors)
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    for t, start in zip(tensors, offsets):
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[start:start + flat.numel()].copy_(flat)
    return buffer


def unpack(buffer: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``buffer`` (a ``pack`` of tensors shaped and typed as ``like``), wherever it lives."""
    offsets, _ = packed_offsets(like)
    return [buffer[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, start in zip(like, offsets)]


def to_device(tensors: Sequence[Tensor], device: torch.device | str) -> list[Tensor]:
    """``tensors`` on ``device``: on CUDA, the host ones in one pinned, non-blocking copy (ones
    already there are returned as they are); elsewhere ``tensor.to(device)``."""
    device = torch.device(device)
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    host = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
    out = [t if t.device.type == "cpu" else t.to(device) for t in tensors]
    if host:
        like = [tensors[i] for i in host]
        sent = pack(like, pin=True).to(device, non_blocking=True)
        for i, t in zip(host, unpack(sent, like)):
            out[i] = t
    return out
