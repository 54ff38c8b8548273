"""One generation process per device, all pulling batches from one queue (data parallel).

The main process forms batches (hf.py) and puts at most two per device on a shared queue;
each device process takes the next batch when it is free, so a slow device takes fewer
batches and never holds the others back (no fixed shards). Results come back on one queue.
The processes are spawned (no CUDA state or threads inherited), load the model once, exit on
a `None` task, ignore Ctrl-C (the parent stops them by pid: a None task, terminate, then
kill) and exit when their parent is gone (`ParentWatch`), so a parent killed outright leaves
none behind. A process that dies unexpectedly fails the run with a DataError naming its
device (rows already written stay; a rerun resumes). So does a batch that fails and leaves
its device unusable (a CUDA error that sticks to the process): that process reports it and
exits rather than failing, in moments, every batch it would pull next. A batch that fails
on a device that still works only rejects its rows.

The queues carry token ids and ints between our own processes, nothing read from disk.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import queue
import signal
import time

from dflash_ipc.errors import DataError
from dflash_ipc.regenerate.generator import DeviceUnusable, Generator

log = logging.getLogger(__name__)

_READY_TIMEOUT_S = 600.0
_JOIN_S = 5.0


def _device_main(settings, device: str, name: str, tasks, results, throttle_s: float, parent: int) -> None:
    """A device process: build the Generator, then run batches until a None task."""
    from dflash_ipc.run.child_env import ParentWatch
    from dflash_ipc.run.quiet import quiet_unactionable_warnings

    # A spawned process starts without the parent's logging filters: torchao's import lines
    # (at the model's load) would print once per device.
    quiet_unactionable_warnings()
    # Ctrl-C reaches the whole process group: the parent decides, and stops us by pid. A
    # parent killed outright leaves us orphaned: the watch then exits this process. `parent`
    # comes from the parent itself: one killed while we start has handed us to another.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ParentWatch(parent=parent).start()
    try:
        gen = Generator(settings, device)
    except Exception as e:
        results.put(("failed", name, f"{type(e).__name__}: {e}"[:500]))
        return
    results.put(("ready", name, os.getpid()))
    while True:
        task = tasks.get()
        if task is None:
            return
        batch_id, keys, prompts, max_new = task
        try:
            outputs, stats, error = gen.run_batch(prompts, max_new, keys)
        except DeviceUnusable as e:
            results.put(("broken", name, str(e)))
            return  # its rows stay in flight: not rejected, a rerun generates them
        if throttle_s:
            time.sleep(throttle_s)  # tests: a slow device
        results.put(("done", batch_id, name, outputs, stats, error))


class DevicePool:
    """The device processes and their two queues."""

    def __init__(self, settings, devices: list[str], *, throttle_s: dict | None = None):
        ctx = multiprocessing.get_context("spawn")
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._procs = {}
        self._ids = itertools.count()
        self._out: dict[int, list] = {}  # batch id -> keys
        self.devices = devices
        for i, device in enumerate(devices):
            name = f"{device}#{i}" if devices.count(device) > 1 else device
            p = ctx.Process(target=_device_main, name=f"regenerate-{name}", daemon=True,
                            args=(settings, device, name, self._tasks, self._results, (throttle_s or {}).get(i, 0.0),
                                  os.getpid()))
            p.start()
            self._procs[p.pid] = (p, name)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        ready, deadline = 0, time.monotonic() + _READY_TIMEOUT_S
        while ready < len(self._procs):
            msg = self._next(deadline - time.monotonic())
            if msg is None:
                raise DataError(f"regenerate: the device processes did not load the model within {_READY_TIMEOUT_S:.0f}s")
            if msg[0] == "failed":
                raise DataError(f"regenerate: the process on {msg[1]} could not load the model: {msg[2]}")
            if msg[0] == "ready":
                ready += 1
        log.info("regenerate: %d device processes ready (%s)", ready, ", ".join(self.devices))

    def free_slots(self) -> int:
        """Batches that may still be queued: two per device in all."""
        return 2 * len(self._procs) - len(self._out)

    def put(self, keys: list, prompts: list[list[int]], max_new: list[int]) -> None:
        """Queue one batch for whichever device is free first."""
        batch_id = next(self._ids)
        self._out[batch_id] = keys
        self._tasks.put((batch_id, keys, prompts, max_new))

    def get(self, timeout_s: float):
        """(keys, outputs, stats, device, error) of a finished batch, or None after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._next(deadline - time.monotonic())
            if msg is None:
                return None
            if msg[0] == "done":
                _, batch_id, device, outputs, stats, error = msg
                return self._out.pop(batch_id), outputs, stats, device, error

    def _next(self, timeout_s: float):
        """The next message, or None after timeout_s; DataError when a process died or reported
        its device broken."""
        end = time.monotonic() + max(0.0, timeout_s)
        while True:
            try:
                msg = self._results.get(timeout=min(0.5, max(0.0, end - time.monotonic())) or 0.01)
            except queue.Empty:
                msg = None
            if msg is not None and msg[0] == "broken":
                raise DataError(msg[2])
            if msg is not None:
                return msg
            for p, name in self._procs.values():
                if p.exitcode is not None:
                    raise DataError(f"regenerate: the process on {name} (pid {p.pid}) died with exit code "
                                    f"{p.exitcode}; rows written so far are kept, rerun to resume")
            if time.monotonic() >= end:
                return None

    def close(self) -> None:
        """Stop every device process: a None task each, then terminate and kill by pid."""
        for _ in self._procs:
            self._tasks.put(None)
        deadline = time.monotonic() + _JOIN_S
        for p, _ in self._procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p, _ in self._procs.values():
            if p.exitcode is None:
                p.terminate()
                p.join(1.0)
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
        for q in (self._tasks, self._results):
            q.cancel_join_thread()
            q.close()
