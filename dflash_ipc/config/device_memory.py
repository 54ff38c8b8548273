"""Device memory as the start-up fit checks count it (`target.fit`, `drafter.fit`)."""

from __future__ import annotations

GIB = 1024**3
USABLE = 0.95  # of a device's capacity: the allocator's fragmentation and the CUDA context


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def device_capacity(device) -> int:
    """Bytes this process can hold on `device`: free memory plus what its allocator holds."""
    import torch
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))
