"""Per-worker timelines: what each process did when, and the metrics computed from them.

Every target and drafter appends intervals to `<run_dir>/metrics/<role>.jsonl` (`target-0`,
`drafter-2`), one JSON line each: `{"t0": .., "t1": .., "state": .., **extra}`. Times are
wall-clock seconds (the `time.time()` scale) so the lanes of different processes line up;
call sites pass `time.perf_counter()` readings, converted here with an offset taken once.

States:
  busy         target: one `produce()` (extra: tokens, batch)
  wait_work    target: nothing queued to compute (a target never waits for a slot: the
               dispatcher sends a `Batch` only with a free slot, so waiting for a slot shows
               up as waiting for work)
  step         drafter: one `DrafterLoop.step()` (extra: loss, anchors, sequences, tokens)
  wait_hidden  drafter: a loop pass in which the group could not step (some rank short of
               anchors)
  wait_slot    reserved for producers that hold work but no free slot (none in this design)

The writer is cheap on the hot path: `record` appends to a list (and merges back-to-back
intervals of the same state without extras, so an idle loop polling every 20 ms is one line,
not fifty a second); the file is written at most every `FLUSH_INTERVAL_S` and on `close`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import numpy as np

from dflash_ipc.run.json_lines import read_json_lines
from dflash_ipc.run.files import RunFiles

log = logging.getLogger(__name__)

STATES = ("busy", "wait_work", "wait_slot", "wait_hidden", "step")
WORK_STATES = ("busy", "step")    # a worker doing what it exists for
FLUSH_INTERVAL_S = 1.0
MERGE_GAP_S = 1e-3                # same-state intervals closer than this become one
MIN_INTERVAL_S = 1e-4             # shorter plain intervals (a non-blocking poll) are dropped


def metrics_dir(run_dir: str) -> str:
    return RunFiles(run_dir).metrics


class TimelineWriter:
    """Appends one process's intervals to its JSONL file (`RunFiles.timeline(role)`), buffered."""

    def __init__(self, path: str, role: str, flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        self.role = role
        self.flush_interval_s = flush_interval_s
        self._file = open(self.path, "a")
        self._offset = time.time() - time.perf_counter()  # perf_counter -> wall clock
        self._pending: list[dict] = []
        self._last_flush = time.perf_counter()

    def record(self, state: str, t0: float, t1: float, **extra) -> None:
        """One interval from two `time.perf_counter()` readings; extras must be JSON values."""
        if state not in STATES:
            raise ValueError(f"{self.role}: timeline state {state!r} is not one of {STATES}")
        if not extra and t1 - t0 < MIN_INTERVAL_S:
            return
        last = self._pending[-1] if self._pending else None
        if (not extra and last is not None and last["state"] == state and len(last) == 3
                and t0 + self._offset - last["t1"] <= MERGE_GAP_S):
            last["t1"] = t1 + self._offset
        else:
            self._pending.append({"t0": t0 + self._offset, "t1": t1 + self._offset, "state": state, **extra})
        if t1 - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        # The last interval stays buffered while it may still grow by merging; `close` writes it.
        keep = self._pending[-1:] if self._pending and len(self._pending[-1]) == 3 else []
        lines = self._pending[:len(self._pending) - len(keep)]
        if lines:
            self._file.write("".join(json.dumps(row) + "\n" for row in lines))
            self._file.flush()
        self._pending = keep
        self._last_flush = time.perf_counter()

    def close(self) -> None:
        if self._file.closed:
            return
        if self._pending:
            self._file.write("".join(json.dumps(row) + "\n" for row in self._pending))
            self._pending = []
        self._file.close()


def valid_interval(row) -> bool:
    """A timeline line `report` can use: a known state, finite times in order, and counts
    (when present) finite and >= 0."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return (isinstance(row, dict) and row.get("state") in STATES and number(row.get("t0"))
            and number(row.get("t1")) and row["t0"] <= row["t1"]
            and all(number(row[k]) and row[k] >= 0 for k in ("tokens", "anchors", "sequences") if k in row))


def load_timeline(path: str) -> list[dict]:
    """The intervals of one file, sorted by start; a torn last line (a killed process), or any
    line that is not an interval, is skipped with a warning."""
    rows = read_json_lines(path, keep=valid_interval, expected="a timeline interval (t0 <= t1, state)")
    return sorted(rows, key=lambda r: r["t0"])


def load_timelines(run_dir: str) -> dict[str, list[dict]]:
    """Every worker's intervals, by role (`target/0`, ...), targets first then drafters by rank."""
    folder = metrics_dir(run_dir)
    if not os.path.isdir(folder):
        return {}
    out = {}
    for name in os.listdir(folder):
        if name.endswith(".jsonl"):
            out[name[:-len(".jsonl")].replace("-", "/", 1)] = load_timeline(os.path.join(folder, name))

    def order(role: str):
        kind, _, rank = role.partition("/")
        return (kind != "target", kind, int(rank) if rank.isdigit() else 0)
    return {role: out[role] for role in sorted(out, key=order)}


def state_seconds(intervals: list[dict]) -> dict[str, float]:
    """Seconds spent in each state (every state listed, zero when absent)."""
    totals = dict.fromkeys(STATES, 0.0)
    for row in intervals:
        totals[row["state"]] += row["t1"] - row["t0"]
    return totals


def summarize(intervals: list[dict]) -> dict:
    """One worker's metrics over its own span (first start to last end).

    busy_fraction = (busy + step seconds) / span; `other_s` is the span not covered by any
    interval (message handling, checkpoints). Rates are totals over the span: tokens/s for
    targets (valid tokens produced), anchors/s and sequences/s for drafters.
    """
    if not intervals:
        return {"span_s": 0.0, "busy_fraction": 0.0}
    t0 = min(r["t0"] for r in intervals)
    span = max(r["t1"] for r in intervals) - t0
    seconds = state_seconds(intervals)
    work = [r for r in intervals if r["state"] in WORK_STATES]
    out = {"start": t0, "span_s": span,
           "busy_fraction": sum(seconds[s] for s in WORK_STATES) / span if span > 0 else 0.0,
           "other_s": max(0.0, span - sum(seconds.values())), "count": len(work)}
    out.update({f"{state}_s": value for state, value in seconds.items()})
    for key in ("tokens", "anchors", "sequences"):
        total = sum(r.get(key, 0) for r in work)
        out[key] = total
        out[f"{key}_per_s"] = total / span if span > 0 else 0.0
    steps = [r for r in intervals if r["state"] == "step"]
    if steps:
        out["step_s_mean"] = seconds["step"] / len(steps)
        losses = [r["loss"] for r in steps if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
        out["loss_last"] = losses[-1] if losses else float("nan")
    return out


def rate_series(intervals: list[dict], key: str, start: float, end: float, bin_s: float,
                window_bins: int = 1) -> np.ndarray:
    """`key` per second over time, shape [ceil((end - start) / bin_s)]: each interval's count
    falls in the bin of its end (a batch counts when produced, a step when done), then a
    centered moving average over `window_bins` bins smooths the per-batch spikes."""
    num_bins = max(1, math.ceil((end - start) / bin_s))
    counts = np.zeros(num_bins)
    for row in intervals:
        value = row.get(key)
        if isinstance(value, (int, float)) and value:
            counts[min(num_bins - 1, max(0, int((row["t1"] - start) // bin_s)))] += value
    if window_bins > 1:
        # dividing by the bins inside the image keeps the edges unbiased
        kernel = np.ones(window_bins)
        counts = np.convolve(counts, kernel, "same") / np.convolve(np.ones(num_bins), kernel, "same")
    return counts / bin_s


_PROCESS = None


def _this_process():
    """psutil's handle of this process, made once: called on every batch and every step."""
    global _PROCESS
    import psutil
    if _PROCESS is None or _PROCESS.pid != os.getpid():
        _PROCESS = psutil.Process()
    return _PROCESS


def process_memory(device) -> dict[str, float]:
    """This process's host RSS and, on a GPU, what PyTorch holds there (MiB), for the
    heartbeat metrics: the status, `health`, TensorBoard and reports all read them there."""
    import torch
    out = {"rss_mib": _this_process().memory_info().rss / 2**20}
    device = torch.device(device)
    if device.type == "cuda":
        out["gpu_mem_allocated_mib"] = torch.cuda.memory_allocated(device) / 2**20
        out["gpu_mem_reserved_mib"] = torch.cuda.memory_reserved(device) / 2**20
        out["gpu_mem_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out
