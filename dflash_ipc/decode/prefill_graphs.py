"""A prefill of a few rows replayed as a CUDA graph, one per (rows bucket, width bucket).

At batch 1 a prefill's time is the host's: through the compiled layers a 200-token prompt of
the Qwen3-1.7B shape took ~22 ms on an H100, of which the GPU needs a few (the compiled
graphs' calls, Dynamo's guards and the dispatch of each layer's ops are the rest:
docs/benchmarks.md, "The prefill through the compiled layers"). With 128 new tokens a prompt
that is ~0.17 ms of every decode step. Captured, a prefill costs one replay.

Shapes: the prompts are left-padded to a width bucket (:func:`width_bucket`) and the rows to a
power of two, as the decode steps' rows are; a padding row has length 0, so all of its tokens
are pads (they write the scratch slot of the first row's cache row and see themselves only, as
any prefill's pads do). Pads change no real token's positions, keys or attention (those are per
token: target.py ``prefill_packed``), only the shapes of the products, which may round the last
bits otherwise (a near-tie between two tokens may then split differently: eval/lossless.py's
rule). Captured are the prefills of at most ``max_tokens`` padded tokens (GRAPH_TOKENS: the
host-bound ones; a larger prefill keeps the GPU busy longer than its dispatch takes, and its
activations would stay in the graphs' pool), at most ``max_graphs`` shapes, the first ones seen;
every other prefill runs as before. A cache's storage is allocated by its first write: where it
is not yet (``ready()``), the prefill runs once uncaptured first, on the caller's stream, so that
no cache is allocated on the capture's side stream (and its writes are repeated by the replay,
the same values).

Each shape's inputs live in one static int64 buffer (target.py ``pack_prompts``: ids, lengths,
cache rows), filled by one copy before the replay; the logits land in the graph's output and
are cloned out. What a caller's ``body`` does besides the
target's forward is captured with it (the speculative decoder's drafter context). The graphs
hold the cache's addresses: a caller that reallocates a cache clears them (:meth:`clear`).
``$DFLASH_DECODE_PREFILL_GRAPHS=off`` runs every prefill uncaptured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from dflash_ipc.decode.graphs import StepGraphs
from dflash_ipc.decode.matvec import cuda_switch
from dflash_ipc.decode.target import pack_prompts, unpack_prompts

log = logging.getLogger(__name__)

PREFILL_GRAPHS_ENV = "DFLASH_DECODE_PREFILL_GRAPHS"
GRAPH_TOKENS = 2048
"""Padded tokens (rows bucket x width bucket) of the largest prefill captured."""
MAX_GRAPHS = 32
"""Shapes captured at most per cache. Each holds its inputs and its logits ``[rows, V]`` (at most
GRAPH_TOKENS / 16 = 128 rows; one row at batch 1); their activations share one memory pool."""
_MIN_WIDTH = 16


def enabled(device) -> bool:
    """Whether prefills on ``device`` may be captured ($DFLASH_DECODE_PREFILL_GRAPHS; CUDA only)."""
    return cuda_switch(PREFILL_GRAPHS_ENV, device)


def width_bucket(n: int) -> int:
    """The padded width of a prompt of ``n`` tokens: a multiple of 16 up to 64, then 2^k or 1.5 x 2^k."""
    if n <= 4 * _MIN_WIDTH:
        return max(_MIN_WIDTH, -(-n // _MIN_WIDTH) * _MIN_WIDTH)
    width = 4 * _MIN_WIDTH
    while width < n:
        width = width * 3 // 2 if width & (width - 1) == 0 else width * 4 // 3
    return width


def rows_bucket(n: int) -> int:
    """The next power of two."""
    return 1 << max(0, n - 1).bit_length()


Body = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``(ids [R, P], lengths [R], rows [R]) -> logits [R, V]``: a prefill from its device inputs."""


class PrefillGraphs:
    """``__call__(rows, prompts)``: ``body``'s logits for the prompts through a captured graph, or
    None where this prefill is not captured (the caller runs it as before); see the module docstring.
    ``ready()``: whether the storage of the caches the body writes exists. ``target`` counts the forward."""

    def __init__(self, target, body: Body, ready: Callable[[], bool], *, enabled: bool,
                 max_tokens: int | None = None, max_graphs: int | None = None) -> None:
        self.target, self.body, self.ready = target, body, ready
        self.max_tokens = GRAPH_TOKENS if max_tokens is None else max_tokens
        self.max_graphs = MAX_GRAPHS if max_graphs is None else max_graphs
        self.graphs = StepGraphs(self._replayed, [], enabled=enabled, name="prefill")
        self._inputs: dict[tuple[int, int], Tensor] = {}
        self._outputs: dict[tuple[int, int], Tensor] = {}
        self.num_replays = 0
        """Prefills this ran (captured or replayed)."""

    @property
    def num_captures(self) -> int:
        return self.graphs.num_captures

    def shape(self, num_rows: int, width: int) -> tuple[int, int] | None:
        """The (rows, width) buckets a prefill of ``num_rows`` prompts of at most ``width`` tokens
        runs as, or None where it is not captured."""
        if not self.graphs.enabled:
            return None
        shape = (rows_bucket(num_rows), width_bucket(width))
        if shape[0] * shape[1] > self.max_tokens:
            return None
        if shape not in self._inputs and len(self._inputs) >= self.max_graphs:
            return None
        return shape

    def __call__(self, rows: Sequence[int], prompts: Sequence[np.ndarray]) -> Tensor | None:
        shape = self.shape(len(prompts), int(max(len(p) for p in prompts)))
        if shape is None:
            return None
        num_rows, width = shape
        host = torch.from_numpy(pack_prompts(prompts, width, [*rows, *[rows[0]] * (num_rows - len(prompts))]))
        inputs = self._inputs.get(shape)
        if inputs is None:
            inputs = self._inputs[shape] = torch.empty(host.shape, dtype=torch.long, device=self.target.device)
            log.debug("decode: prefill graph for %d rows of %d tokens", num_rows, width)
        inputs.copy_(host)
        if not self.ready():  # the storage is allocated here, on this stream, not in the capture's warm-up
            self.body(*unpack_prompts(inputs, num_rows, width))  # (a side stream's); the replay repeats its writes
        self.graphs.run(shape)
        self.target.num_forwards += 1
        self.num_replays += 1
        logits = self._outputs[shape][: len(prompts)].clone()
        if not self.graphs.enabled:  # the capture failed: this prefill ran eagerly, and the next ones run as before
            self._inputs.clear()
            self._outputs.clear()
        return logits

    def _replayed(self, num_rows: int, width: int) -> None:
        """The body over the shape's static inputs (what a graph captures)."""
        inputs = self._inputs[(num_rows, width)]
        self._outputs[(num_rows, width)] = self.body(*unpack_prompts(inputs, num_rows, width))

    def clear(self) -> None:
        """Forget every graph and buffer (the caches they write are about to be replaced)."""
        self.graphs.clear()
        self._inputs.clear()
        self._outputs.clear()
