"""torch.compile of the target's decode forward: its small kernels fused (an option, off by default).

A captured decode step (graphs.py) removes the launch overhead but not the kernels: a
transformers decoder layer is dozens of them (each RMS norm is a cast, a square, a mean, an
rsqrt, two multiplies; rotary is slices, a concat and four element-wise ops), and at batch 1
their fixed cost is as large as the weight reads. Inductor fuses each such chain into one
kernel. With ``DFLASH_DECODE_TUNE=1`` it also gets ``coordinate_descent_tuning``, under which
Inductor turns a one-row matmul (batch 1: ``[1, H] @ W``) into a reduction kernel tuned for the
weight's read bandwidth and fused with the norm that feeds it.

The decoders run this only when asked (``compile`` "on" or "auto"; their default is "off"):
its compile time and its gain on a GPU are not measured yet (``python3 -m
benchmarks.compile_decode qwen3-1.7b`` measures both). Tested on CPU through ``aot_eager``
(tests/test_decode_compiled.py).

What is compiled is :meth:`BatchedTarget.extend`'s body (positions, masks, the cache write
plan, the model forward, the captured layers): the step of the decoding core and the verify
pass of speculative decoding both go through it. The prefill stays eager (its shapes change
with every refill). Shapes are dynamic (``dynamic=True``), so one compile serves every rows
bucket, key span and cache size; torch specialises sizes of 1, so batch 1 (and the one-token
step) get a program of their own. The compiled call runs inside the CUDA graphs: the first call of a
shape compiles during the graph's eager warm-up, the capture records the fused kernels.

A compile that fails (an op Dynamo or Inductor cannot handle in some model) logs once and
the target runs the same forward eagerly from then on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from dflash_ipc.errors import ConfigError

log = logging.getLogger(__name__)

COMPILE = ("auto", "on", "off")  # the decoders' default is off (decode/engine.py EngineSettings.compile)
"""auto: compiled where the step is a CUDA graph (a CUDA device); on: compiled (any device: CPU
needs a C++ compiler); off: eager."""
BACKEND = "inductor"
"""torch.compile backend (tests swap in ``aot_eager``: the same tracing without code generation)."""


def compile_enabled(setting: str, device, graphs: bool) -> bool:
    """Whether ``setting`` (COMPILE) compiles the decode forward on ``device`` (``graphs``: the
    steps are captured as CUDA graphs)."""
    if setting not in COMPILE:
        raise ConfigError(f"decode compile={setting!r}; allowed: {list(COMPILE)}")
    return setting == "on" or (setting == "auto" and graphs and torch.device(device).type == "cuda")


class CompiledForward:
    """``fn`` through torch.compile; the first failure that is not the caller's (out of memory,
    a CUDA graph capture in progress) logs once and ``fn`` runs eagerly from then on."""

    def __init__(self, fn: Callable, device: torch.device) -> None:
        self.fn = fn
        tune = BACKEND == "inductor" and device.type == "cuda" and os.environ.get("DFLASH_DECODE_TUNE") == "1"
        options = {"coordinate_descent_tuning": True} if tune else None
        self.compiled = torch.compile(fn, dynamic=True, backend=BACKEND, options=options)
        self.failed = False

    def __call__(self, *args):
        if self.failed:
            return self.fn(*args)
        try:
            # No duck sizing: the first step's rows often equal the cache's, and an equality
            # guard on that would compile again for every other rows bucket.
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                return self.compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any compiler failure: the eager forward is the same math
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise  # the capture is broken either way; StepGraphs turns graphs off and we retry then
            log.warning("decode: torch.compile of the target's decode forward failed (%s: %s); running it eagerly",
                        type(e).__name__, str(e)[:300])
            self.failed = True
            return self.fn(*args)
