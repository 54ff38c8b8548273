"""torch.compile's kernels compiled in the process that runs them, not in a pool of workers.

Inductor's backend starts a pool of compile workers the first time it runs (``min(32, cores)``
processes, each importing torch and Triton), shuts them down 60 s after a compile ends and
starts them again at the next compile. While they start they take every core, and a training
process's host work, the small CPU tensor ops that build each step's batch and the copy into
pinned memory, runs on intra-op threads that then wait for cores: in a fresh process on one
H200 (16 cores) the 135M-class drafter step under ``drafter.compile: reduce-overhead`` takes
111.7 ms pipelined with the pool (``copy_`` 63 ms of host time per step) and 18.3-18.9 ms
compiled in the process (docs/benchmarks.md, "The CE chunk in one kernel";
benchmarks/compile_pool.py shows the effect on CPU ops). The pool buys a drafter little: inductor compiles in the main process until the
pool answers, so a first compile gains from it only once its workers are up, and later
compiles are rare.

:func:`compile_in_process` sets inductor's ``compile_threads`` to 1 unless
``TORCHINDUCTOR_COMPILE_THREADS`` says otherwise (the user's choice is kept).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV = "TORCHINDUCTOR_COMPILE_THREADS"


def compile_in_process() -> bool:
    """No compile-worker pool in this process unless $TORCHINDUCTOR_COMPILE_THREADS asks for
    one; True when this call turned the pool off. Call it before the first compile."""
    if os.environ.get(ENV):
        return False
    try:
        from torch._inductor import config
    except ImportError:  # a torch without inductor compiles nothing
        return False
    config.compile_threads = 1
    logger.debug("torch.compile: kernels compiled in this process (%s unset)", ENV)
    return True
