"""A run's CUDA kernels in the order they ran, and what each added to the run's length.

kernel_profile.py sums kernel time by kind; under programmatic dependent launch (decode/pdl.py)
a kernel's programs start while the kernel before still runs and wait there, so its time
counts that wait and the sums exceed the wall time. What a kernel costs the run is what it
adds to the end of the timeline: its end less the latest end of every kernel before it (zero
for one that ends inside another's span). Those additions sum to the span from the first
kernel's start to the last one's end, so they say where a cycle's time goes, PDL on or off,
gaps between kernels (launch latency, a wait on the host) counted into the kernel after them.

The kernels come from the torch profiler's trace (its Chrome-trace JSON: name, start,
duration and grid of every kernel, CUDA-graph replays included), read with ``json``.
"""

from __future__ import annotations

import json
import os
import tempfile
import typing
from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    end_us: float
    grid: tuple[int, ...] = ()


def kernels_of_trace(trace: dict) -> list[Kernel]:
    """The kernels of a Chrome trace (``traceEvents`` of category ``kernel``), by start."""
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("kernels_of_trace: no traceEvents list in the trace")
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("cat") != "kernel" or e.get("ph") != "X":
            continue
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        grid = (e.get("args") or {}).get("grid") or ()
        out.append(Kernel(str(e.get("name", "?")), start, start + dur, tuple(int(g) for g in grid)))
    return sorted(out, key=lambda k: (k.start_us, k.end_us))


def trace_kernels(run: typing.Callable[[], None]) -> list[Kernel]:
    """The CUDA kernels of one ``run()`` under the torch profiler, by start."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return kernels_of_trace(json.load(f))
    finally:
        os.unlink(path)


def slices(kernels: typing.Sequence[Kernel], last: str) -> list[list[Kernel]]:
    """``kernels`` cut after each one whose name contains ``last`` (a cycle's final kernel); the
    kernels after the final cut are dropped (an unfinished slice)."""
    out, current = [], []
    for k in kernels:
        current.append(k)
        if last in k.name:
            out.append(current)
            current = []
    return out


def added_times(kernels: typing.Sequence[Kernel], before_end_us: float | None = None) -> list[float]:
    """Microseconds each kernel adds to the timeline's end: its end less the latest end before it
    (``before_end_us``, else the first kernel's start, for the first). They sum to the span."""
    out = []
    latest = kernels[0].start_us if before_end_us is None and kernels else before_end_us
    for k in kernels:
        out.append(max(0.0, k.end_us - latest))
        latest = max(latest, k.end_us)
    return out


def format_slice(kernels: typing.Sequence[Kernel], before_end_us: float | None = None, width: int = 70) -> str:
    """One line per kernel: its added time, its own duration, its grid and name; then the sum."""
    added = added_times(kernels, before_end_us)
    lines = [f"{'added us':>9} {'own us':>8}  {'grid':<14} kernel"]
    for k, a in zip(kernels, added):
        grid = "x".join(str(g) for g in k.grid) or "-"
        lines.append(f"{a:9.2f} {k.end_us - k.start_us:8.2f}  {grid:<14} {k.name[:width]}")
    lines.append(f"{sum(added):9.2f} us over {len(kernels)} kernels")
    return "\n".join(lines)


def group_added(kernels: typing.Sequence[Kernel], before_end_us: float | None = None,
                key: typing.Callable[[Kernel], str] = lambda k: k.name) -> dict[str, tuple[float, int]]:
    """(added microseconds, launches) per ``key`` of the kernels, costliest first."""
    totals: dict[str, tuple[float, int]] = {}
    for k, a in zip(kernels, added_times(kernels, before_end_us)):
        us, n = totals.get(key(k), (0.0, 0))
        totals[key(k)] = (us + a, n + 1)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1][0]))
