"""Index vectors ``0 .. n-1`` made once per length and device rather than in every step.

A batch-1 speculative cycle built six of them (a block's position offsets and the row indices,
for the verify, the drafter's block and its context append, the cache's write plan), a plain
decode step two: each a kernel launch of its own in a step whose launches are its cost (the
profile of docs/benchmarks.md, "The greedy choice, the cycle's end and the masks in a launch
each"). Every caller only reads them (offsets added to lengths, indices into a cache).

A vector first asked for while a CUDA graph is being captured is not kept: it lives in the
graph's memory pool (the step's eager warm-up before each capture asks first, so the capture
finds it kept). Inside a torch.compile trace a plain ``arange`` is traced instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

_kept: dict[tuple[int, str, int | None], Tensor] = {}


def arange(n: int, device: torch.device | str) -> Tensor:
    """``torch.arange(n, device=device)`` (int64), the same tensor on every call: read it, never write it."""
    device = torch.device(device)
    if torch.compiler.is_compiling():
        return torch.arange(n, device=device)
    index = device.index if device.type != "cuda" or device.index is not None else torch.cuda.current_device()
    key = (n, device.type, index)
    kept = _kept.get(key)
    if kept is not None:
        return kept
    made = torch.arange(n, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _kept[key] = made
    return made
