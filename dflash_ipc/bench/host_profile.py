"""Where the host's time goes in a training step: Python functions by self time, and the garbage collector.

The kernel profile (kernel_profile.py) says what the GPU runs; when a step's wall time is far
above its kernel time (docs/benchmarks.md: a fresh process under ``drafter.compile:
reduce-overhead`` took ~100 ms a step on the host against 19 ms of kernels), the host is the
question. :func:`profile_host` runs steps under cProfile (deterministic: every Python call
counted, its overhead included, so read the ranking and the large entries, not small
absolute times) and times the garbage collector's passes through ``gc.callbacks`` (a full
collection walks the whole heap, and a process that has just compiled holds millions of
objects). :func:`format_host_profile` prints ms per step.
"""

from __future__ import annotations

import cProfile
import gc
import os
import pstats
import time
import typing


def profile_host(run_step: typing.Callable[[], None], steps: int, *, top: int = 15) -> dict:
    """``steps`` calls of ``run_step`` under cProfile and a collector clock: the ``top``
    functions by self time as (where, ms per step, calls per step, cumulative ms per step),
    the wall ms per step, and the collector's passes per step by generation and their ms."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    passes = {0: 0, 1: 0, 2: 0}
    gc_s = [0.0]
    started_at = [0.0]

    def clock(phase: str, info: dict) -> None:
        if phase == "start":
            started_at[0] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - started_at[0]
            passes[info["generation"]] += 1

    profiler = cProfile.Profile()
    gc.callbacks.append(clock)
    started = time.perf_counter()
    try:
        profiler.enable()
        for _ in range(steps):
            run_step()
    finally:  # a step that raised leaves neither hook behind
        profiler.disable()
        gc.callbacks.remove(clock)
    wall_s = time.perf_counter() - started
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (prim calls, calls, self s, cum s, callers)}
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return {
        "steps": steps,
        "wall_ms": wall_s * 1e3 / steps,
        "functions": [(_where(key), self_s * 1e3 / steps, calls / steps, cum_s * 1e3 / steps)
                      for key, (_, calls, self_s, cum_s, _) in rows],
        "gc_passes": {generation: count / steps for generation, count in passes.items()},
        "gc_ms": gc_s[0] * 1e3 / steps,
    }


def _where(key: tuple[str, int, str]) -> str:
    """``file:line(function)`` with the file shortened to its last two parts (``~`` for builtins)."""
    file, line, name = key
    if file == "~":
        return name
    return f"{os.path.join(*file.split(os.sep)[-2:])}:{line}({name})"


def format_host_profile(summary: dict, *, label: str) -> str:
    """The report's host section: wall and collector ms per step, then the functions."""
    passes = ", ".join(f"gen{g} {n:.1f}" for g, n in summary["gc_passes"].items())
    lines = [f"host time per step ({label}, {summary['steps']} steps under cProfile): {summary['wall_ms']:.1f} ms "
             f"wall; garbage collector {summary['gc_ms']:.1f} ms ({passes} passes per step)",
             "  self ms  cum ms   calls  function (per step)"]
    lines += [f"  {self_ms:7.2f} {cum_ms:7.1f} {calls:7.1f}  {where}"
              for where, self_ms, calls, cum_ms in summary["functions"]]
    return "\n".join(lines)
