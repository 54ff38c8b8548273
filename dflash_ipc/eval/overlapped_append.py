"""The drafter's context appended on a second CUDA stream while the verify pass finishes.

After a speculative cycle's verify pass the drafter appends the context of the verified
positions: the features of the target layers it reads go through its fc and hidden norm, then
through every drafter layer's k|v product, k norm, rotary and cache write (drafter_context.py
``append``). At batch 1 that is a dozen small launches, each bound by its latency, and their
inputs are ready as soon as the last of those target layers has run: at the Qwen3-1.7B shape's
default (layers 1, 7, 13, 19, 25 of 28) two target layers and the head are still to come. In
the cycle's order they add their latency to it; here they run on a stream of their own from that
point (decode/target.py LayerCapture ``on_features``), beside the rest of the verify pass, and
the cycle waits for them before it ends. Nothing else in the cycle reads what they write (the
drafter's cache, which the next cycle's draft reads) or writes what they read (the features, the
positions), and the side stream has split buffers of its own (decode/matvec.py SplitBuffers).
A captured cycle holds both streams in its CUDA graph.

Where: CUDA, greedy cycles, the target's forward eager or compiled per layer (hooks run eagerly
around compiled layers; the ``forward`` scope would trace them). ``$DFLASH_DECODE_APPEND_STREAM``:
``auto`` (the default) or ``off`` (the append after the forward, on the cycle's stream).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from dflash_ipc.decode import matvec
from dflash_ipc.decode.matvec import cuda_switch

APPEND_STREAM_ENV = "DFLASH_DECODE_APPEND_STREAM"


def enabled(device: torch.device, compiled_scope: str | None) -> bool:
    """Whether cycles on ``device`` append beside the verify pass: CUDA, ``$DFLASH_DECODE_APPEND_STREAM``
    not off, the target's forward not compiled whole (``compiled_scope``: its compile scope, None
    where it runs eagerly)."""
    return device.type == "cuda" and compiled_scope != "forward" and cuda_switch(APPEND_STREAM_ENV, device)


@functools.cache
def side_stream(device_index: int) -> torch.cuda.Stream:
    """The side stream of CUDA device ``device_index``, one per process: the decoders of a process
    take turns on their target, never running at once, so they share it and its split buffers."""
    device = torch.device("cuda", device_index)
    # High priority: its few small launches take the SMs as the verify's programs free them.
    stream = torch.cuda.Stream(device, priority=-1)
    matvec.SPLIT_BUFFERS.own(device, stream)  # its split products run beside the verify's
    return stream


class OverlappedAppend:
    """A side stream that work forks onto from the current stream and that the current stream
    joins again (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = side_stream(self.device.index if self.device.index is not None else torch.cuda.current_device())
        self.pending = False
        self.forks = 0
        """Forks so far (a captured cycle forks at its warm-up and capture, not at its replays)."""

    def fork(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the side stream after what the current stream has queued so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.pending = True  # joined even where ``work`` raises after queueing part of itself
        self.forks += 1
        with torch.cuda.stream(self.stream):
            work()

    def join(self) -> None:
        """The current stream waits for the side stream's work (nothing if none was forked)."""
        if self.pending:
            self.pending = False
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
