"""Microseconds per call of a kernel, timed in one CUDA graph over distinct inputs.

Kernels of a few microseconds are timed without their launch cost, as a captured decode step
runs them: the calls (each on its own copy of the inputs, so that a read misses L2 as it does
in a step that streams the whole model) are captured as one CUDA graph and replayed.
benchmarks/matvec.py and benchmarks/decode_attention.py time their kernels this way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

REPLAYS = 20


def graph_us(fn: Callable, args: Sequence[tuple], replays: int = REPLAYS) -> float:
    """Microseconds per ``fn(*a)`` over every ``a`` of ``args``: two eager calls first (compiles,
    library kernel choices), then all of them captured as one CUDA graph, replayed once untimed
    and ``replays`` times timed between CUDA events."""
    for a in args[:2]:
        fn(*a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in args:
            fn(*a)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return 1e3 * start.elapsed_time(end) / (replays * len(args))
