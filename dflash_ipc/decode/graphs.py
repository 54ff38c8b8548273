"""CUDA graphs of a step function, one per shape bucket, captured on first use; eager elsewhere.

A decode step of a small batch is hundreds of kernel launches whose GPU time is far below
the Python time that issues them; a graph replays them all for one launch. The step
(engine.py) reads and writes only tensors allocated before capture (the static cache, the
row state), so a replay is the step. Each shape (rows bucket, key-span bucket) is its own
graph; all share one memory pool, which is safe because graphs never run concurrently and
nothing reads a graph's intermediates after its replay.

Capture: one eager warm-up on a side stream first (cuBLAS handles, kernel selection; the
PyTorch recipe), with the row state saved and restored around it, since the warm-up is a
real step (its K/V writes are the ones the replay repeats, at the same positions). A capture
that fails (an op that syncs with the host, an unsupported kernel) logs a warning and turns
graphs off for the rest of the run: the eager step is the same computation. Where the
decode kernels launched with PDL (pdl.py), the capture is tried once more as it was, then with
PDL turned off for the process, before graphs are. Python's garbage collector is held off
during each capture (`collector_held`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from dflash_ipc.decode import pdl

log = logging.getLogger(__name__)


def _first_error(e: BaseException) -> BaseException:
    """The error that broke a capture: the one raised at capture end ("operation failed due to a
    previous error during capture") keeps it as its context."""
    while e.__context__ is not None and "previous error during capture" in str(e):
        e = e.__context__
    return e


@contextlib.contextmanager
def collector_held():
    """Python's cyclic garbage collector held off while a graph is captured.

    A CUDAGraph that dies in a reference cycle (a decoder's graphs hold its bound step method;
    a bench or an eval makes one decoder after another) is freed whenever the collector next runs,
    which is at any allocation. Freed during a capture, its destructor destroys its executable
    graph, which CUDA forbids on a thread that is capturing: torch warns "operation not permitted
    when stream is capturing (function reset)" and the capture is broken ("operation failed due to
    a previous error during capture" at the next launch). torch >= 2.9 no longer collects before
    a capture (``torch.compiler.config.force_cudagraph_gc``), so such graphs can linger until
    then. With the collector held, they are freed after the capture instead. A setting of the
    collector made elsewhere (off) is kept."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class StepGraphs:
    """``run(shape)`` = ``step(*shape)``, through a graph per shape when ``enabled``."""

    def __init__(self, step: Callable[..., None], state: Sequence[Tensor], *, enabled: bool,
                 name: str = "step") -> None:
        self.step, self.name = step, name
        self.state = list(state)
        self.enabled = enabled
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.num_captures = 0
        self._pool = None

    def run(self, shape: tuple) -> None:
        if not self.enabled:
            self.step(*shape)
            return
        graph = self.graphs.get(shape)
        if graph is None:
            graph = self._capture(shape)
            if graph is None:
                self.step(*shape)
                return
        graph.replay()

    def _capture(self, shape: tuple) -> torch.cuda.CUDAGraph | None:
        saved = [t.clone() for t in self.state]
        for attempt in range(3):
            try:
                graph = self._record(shape, saved)
                break
            except Exception as e:  # noqa: BLE001 - any capture failure: the eager step is the same math
                e = _first_error(e)
                torch.cuda.synchronize()
                for t, v in zip(self.state, saved):
                    t.copy_(v)
                device = torch.device("cuda", torch.cuda.current_device())
                if attempt == 0 and pdl.enabled(device):
                    # Once more as it was: an 8B-shaped cycle's first capture failed so in one
                    # process of five, and four others captured with PDL (docs/benchmarks.md, "The
                    # decoding goals in one call"; the likely cause, a graph freed mid-capture, is
                    # what collector_held prevents); PDL stays on where a second capture passes.
                    log.warning("decode: capturing the %s %s as a CUDA graph with overlapped launches failed "
                                "(%s: %s); capturing it once more", self.name, shape, type(e).__name__,
                                str(e)[:300])
                    continue
                if attempt < 2 and pdl.turn_off(device):
                    log.warning("decode: capturing the %s %s as a CUDA graph with overlapped launches failed "
                                "again (%s: %s); capturing with plain launches (decode/pdl.py off in this "
                                "process)", self.name, shape, type(e).__name__, str(e)[:300])
                    continue
                log.warning("decode: capturing the %s %s as a CUDA graph failed (%s: %s); running it eagerly",
                            self.name, shape, type(e).__name__, str(e)[:300])
                self.enabled = False
                self.graphs.clear()
                return None
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[shape] = graph
        self.num_captures += 1
        return graph

    def _record(self, shape: tuple, saved: list[Tensor]) -> torch.cuda.CUDAGraph:
        """One eager warm-up of the step on a side stream, the state put back, then its capture."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(*shape)
        torch.cuda.current_stream().wait_stream(side)
        for t, v in zip(self.state, saved):
            t.copy_(v)
        graph = torch.cuda.CUDAGraph()
        with collector_held(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self.step(*shape)
        return graph

    def clear(self) -> None:
        """Forget every graph (the tensors they hold are about to be replaced)."""
        self.graphs.clear()
        self._pool = None
