"""A worker's liveness beacon: what it is doing and since when, rewritten every half second.

A drafter sends nothing to the dispatcher while it steps or checkpoints, so the dispatcher's
heartbeats cannot tell a long step from a stopped process. Instead a thread of the worker
rewrites a tiny JSON file (`RunFiles.beacon(role)`) every `BEAT_S`: the time, the phase the
main thread is in (`start`, `compile`, `step`, `checkpoint`, `wait`, ...) and when that phase
began. The node's supervisor reads it:

* the beacon's time older than `supervise.drafter_stall_s`: the process is stopped or frozen
  (SIGSTOP, a lock held with the GIL) - its thread would otherwise have written;
* a phase older than its limit (`supervise.drafter_{compile,step,checkpoint}_timeout_s`):
  the main thread is stuck inside it (a collective waiting for ever, a hung kernel).

A slow but alive step keeps the beacon fresh and stays within its phase limit. A worker on its
way out closes the beacon with a last record in phase `exit`: no longer rewritten, and no hang
(whether the process then exits is the supervisor's to see, as for any child).
"""

from __future__ import annotations

import json
import os
import threading
import time

BEAT_S = 0.5
PHASES = ("start", "resume", "wait", "compile", "step", "checkpoint", "finish", "exit")


class Beacon:
    """The writer, owned by the worker; `phase(name)` is called by its main thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._phase, self._since, self._step = "start", time.time(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="beacon", daemon=True)
        self._write()
        self._thread.start()

    def phase(self, name: str, step: int | None = None) -> None:
        if name not in PHASES:
            raise ValueError(f"beacon phase {name!r} not one of {PHASES}")
        if name != self._phase:
            self._phase, self._since = name, time.time()
        if step is not None:
            self._step = step

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._write()

    def _write(self) -> None:
        record = {"time": time.time(), "pid": os.getpid(), "phase": self._phase, "since": self._since,
                  "step": self._step}
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full disk must not kill training; the supervisor then sees a stale beacon

    def close(self) -> None:
        """Stops the thread, then writes the last record, in phase `exit`: the interpreter's
        teardown that follows can outlast `supervise.drafter_stall_s` while the dispatcher, ending
        the job, still runs, and a stale beacon would have the supervisor kill a clean exit."""
        self._stop.set()
        self._thread.join(timeout=2 * BEAT_S)
        if not self._thread.is_alive():  # never two writers of the file
            self._phase, self._since = "exit", time.time()
            self._write()


def read_beacon(path: str) -> dict | None:
    """The last record, or None when there is none (not started, or unreadable)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError, RecursionError):  # torn, damaged or crafted: no beacon
        return None
    ok = isinstance(record, dict) and all(isinstance(record.get(k), (int, float)) for k in ("time", "since", "pid"))
    return record if ok and record.get("phase") in PHASES else None


def beacon_problem(record: dict | None, *, pid: int, now: float, stall_s: float, limits: dict[str, float]) -> str | None:
    """Why the beacon of process `pid` says it hangs, or None."""
    if record is None or record["pid"] != pid:
        return None  # not written yet by this process: the start-up timeout covers it
    if record["phase"] == "exit":
        return None  # closed on the way out (Beacon.close): no longer rewritten, not stopped
    age = now - record["time"]
    if age > stall_s:
        return f"its liveness beacon stopped {age:.1f}s ago (supervise.drafter_stall_s={stall_s:g}): stopped or frozen"
    phase, in_phase = record["phase"], now - record["since"]
    limit = limits.get(phase)
    if limit is not None and in_phase > limit:
        return f"{in_phase:.0f}s in phase '{phase}' (limit {limit:g}s)"
    return None
