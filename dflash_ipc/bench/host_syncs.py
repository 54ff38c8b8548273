"""Where a piece of work makes the host wait for the GPU.

A step whose host waits for the GPU cannot queue the next one while the GPU runs: the drafter
loop's launched steps (drafter/launched_step.py) read nothing back until the step is done.
Two sources name the waits, and neither sees them all:

* CUDA's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) warns at every copy to
  pageable host memory, ``.item()``, ``nonzero``, a stream's ``synchronize()`` and the like, as
  "called a synchronizing CUDA operation" (c10's ``warn_or_error_on_sync``). Its first use in a
  process also warns once that the mode "is a prototype feature and does not yet detect all
  synchronizing operations", from ``set_sync_debug_mode``'s own line: that notice is no wait.
* The mode does not see ``torch.cuda.synchronize()`` (c10's ``device_synchronize`` does not
  report) nor an event's ``synchronize()`` (``cudaEventSynchronize``, unreported); libraries
  call them from Python (CUDA graph trees' warm-up and recording call the first, inductor's
  autotuning a copy of it that dynamo keeps), so :func:`counted_waits` counts those calls by
  their caller while the work runs: the binding ``torch.cuda.synchronize`` calls on every call,
  ``torch._C._cuda_synchronize``, so a kept copy is counted too. ``torch.accelerator``'s
  synchronize is not counted.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import typing
import warnings

import torch

SYNC_WARNING = "called a synchronizing CUDA operation"


def host_syncs(run: typing.Callable[[], object]) -> dict[str, int]:
    """``run()`` once (CUDA), and where it waited: "file:line" -> count for the sync debug
    mode's warnings, "file:line (what)" for the waits :func:`counted_waits` names."""
    found: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught, counted_waits(found):
        warnings.simplefilter("always")
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    for where, count in sync_sites(caught).items():
        found[where] = found.get(where, 0) + count
    return found


def sync_sites(caught: typing.Iterable[warnings.WarningMessage]) -> dict[str, int]:
    """The synchronising calls among recorded warnings, as "file:line" -> count."""
    found: dict[str, int] = {}
    for w in caught:
        if str(w.message).startswith(SYNC_WARNING):
            where = f"{os.path.relpath(w.filename)}:{w.lineno}"
            found[where] = found.get(where, 0) + 1
    return found


# (owner, attribute, name in the report): the Python-level waits the sync debug mode misses.
# torch._C._cuda_synchronize is absent from CPU builds: what is absent is not counted.
WAITS = ((torch._C, "_cuda_synchronize", "torch.cuda.synchronize"),
         (torch.cuda.Event, "synchronize", "Event.synchronize"))
_SYNCHRONIZE = torch.cuda.synchronize.__code__  # whose call of the binding names its own caller


@contextlib.contextmanager
def counted_waits(found: dict[str, int]):
    """While inside: each call of WAITS from this thread adds 1 to ``found["file:line (name)"]``,
    the line its caller's (torch.cuda.synchronize's caller, for the binding it calls); the
    originals run as before and are put back on the way out. Other threads' calls are not
    counted; two threads must not count at once (each would restore the other's wrapper)."""
    thread = threading.get_ident()
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in WAITS if hasattr(owner, attr)]

    def counting(original, name):
        def wait(*args, **kwargs):
            if threading.get_ident() == thread:
                caller = sys._getframe(1)
                if caller.f_code is _SYNCHRONIZE and caller.f_back is not None:
                    caller = caller.f_back
                where = f"{os.path.relpath(caller.f_code.co_filename)}:{caller.f_lineno} ({name})"
                found[where] = found.get(where, 0) + 1
            return original(*args, **kwargs)
        return wait

    names = {(owner, attr): name for owner, attr, name in WAITS}
    try:
        for owner, attr, original in originals:
            setattr(owner, attr, counting(original, names[owner, attr]))
        yield found
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)
