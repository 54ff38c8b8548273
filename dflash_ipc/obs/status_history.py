"""The job's status over time: `RUN_DIR/status_history.jsonl`, one line per status poll.

Worker timelines (metrics.py) say what each process did; what each process *held* (host RSS,
GPU memory) reaches the dispatcher only in heartbeats, and so only the status. The supervisor
appends a compact extract of every status it polls, written by the same hand as the other
sinks:

    {"time": 1767000000.0, "elapsed_s": 42.0, "instance": "...",
     "rates": {"tgt_rate": .., "dft_rate": .., "tok_rate": ..},
     "tokens": {"produced": .., "consumed": .., "trained": .., "committed": .., "total": ..},
     "batches": {"pending": .., ..., "committed": ..},
     "workers": {"target/0": {"pid": 123, "rss_mib": .., "gpu_mem_allocated_mib": .., ...}, ...}}

`time` is wall-clock seconds (the timelines' clock), so `dflash-ipc report` lines memory up with
the state lanes. A resumed job appends to the same file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from dflash_ipc.run.json_lines import read_json_lines
from dflash_ipc.obs.sinks import MEMORY_METRICS
from dflash_ipc.wire.status import JobStatus

MEMORY_KEYS = (*MEMORY_METRICS, "gpu_mem_peak_mib")
STATUS_GROUPS = ("rates", "tokens", "batches")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def history_record(status: JobStatus, now: float) -> dict:
    """The line written for one status."""
    record = {"time": now, "elapsed_s": status.elapsed_s, "instance": status.instance}
    for group in STATUS_GROUPS:
        values = getattr(status, group)
        record[group] = {f.name: v for f in dataclasses.fields(values) if _finite(v := getattr(values, f.name))}
    workers = {}
    for kind, seats in (("target", status.targets), ("drafter", status.drafters)):
        for rank, seat in seats.items():
            memory = {k: float(seat.metrics[k]) for k in MEMORY_KEYS if _finite(seat.metrics.get(k))}
            if memory:
                workers[f"{kind}/{rank}"] = {"pid": seat.pid, **memory}
    record["workers"] = workers
    return record


class StatusHistorySink:
    """Appends `history_record(status)` lines to `path` (flushed per line: a killed
    supervisor leaves every poll it made)."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")
        self.writes = 0

    def write(self, status: JobStatus) -> None:
        self._file.write(json.dumps(history_record(status, time.time())) + "\n")
        self._file.flush()
        self.writes += 1

    def close(self) -> None:
        self._file.close()


def load_status_history(path: str) -> list[dict]:
    """Every readable line of a history file ([] when there is none); a torn last line (a
    killed supervisor) is skipped."""
    return list(read_json_lines(path, keep=lambda row: isinstance(row, dict) and _finite(row.get("time"))
                                and isinstance(row.get("workers", {}), dict),
                                expected="a status record with a time"))
