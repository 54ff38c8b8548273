"""The drafter's per-step records, as the trackers' per-step scalars.

Drafter rank 0 writes one JSON line per optimizer step to `RUN_DIR/drafter_metrics.jsonl`
(drafter/loop.py). The supervisor, the trackers' only writer, reads the lines added since its
last look at every status poll (`StepLogTail`) and writes each as scalars at its own step
(`step_scalars`), so a tracker gets one point per optimizer step, not one per poll:

  train/{loss,lr,grad_norm,anchors,tokens,step_s}     at the record's `step`
  validation/acceptance_length, acceptance_blocks,    at `validated_step` (the weights scored:
  validation/acceptance_at_<k>                         those before the record's step)

A supervisor started again in the same run directory starts at the file's end: what is there
was written to the trackers by the one before. Only complete lines are read (a line being
written waits for the next poll); a line that is not a JSON object is skipped with one warning.
"""

from __future__ import annotations

import json
import logging
import math
import os

from dflash_ipc.run.json_files import as_number

log = logging.getLogger(__name__)

TRAIN_SCALARS = ("loss", "lr", "grad_norm", "anchors", "tokens", "step_s")
VALIDATION_SCALARS = ("acceptance_length", "acceptance_blocks")
MAX_LINE_BYTES = 1 << 20  # a step record is a few hundred bytes
MAX_READ_BYTES = 64 << 20  # per poll: a supervisor that fell far behind catches up over polls


class StepLogTail:
    """The records appended to one JSONL file since the last `read()`."""

    def __init__(self, path: str, *, from_end: bool = True) -> None:
        self.path = path
        self.offset = os.path.getsize(path) if from_end and os.path.exists(path) else 0
        self.skipped = 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # replaced by a shorter file: start over
                    self.offset = 0
                f.seek(self.offset)
                data = f.read(MAX_READ_BYTES)
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # complete lines only
        records = []
        for line in data[:end].splitlines():
            record = _record(line)
            if record is not None:
                records.append(record)
            elif line.strip():
                self.skipped += 1
                if self.skipped == 1:
                    log.warning("%s: a line that is not a step record is skipped (%.60r)", self.path, line)
        self.offset += end
        return records


def _record(line: bytes) -> dict | None:
    if len(line) > MAX_LINE_BYTES:
        return None
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) and _step(value.get("step")) is not None else None


def _step(value) -> int | None:
    number = as_number(value)
    return int(number) if number is not None and math.isfinite(number) and number >= 0 else None


def step_scalars(record: dict) -> list[tuple[int, float | None, dict[str, float]]]:
    """(step, wall time or None, {tag: value}) of one record: its training scalars, and its
    validation scalars at the step they score when it carries them."""
    wall = as_number(record.get("time"))
    out = []
    train = {f"train/{n}": v for n in TRAIN_SCALARS
             if (v := as_number(record.get(n))) is not None and math.isfinite(v)}
    if train:
        out.append((_step(record["step"]), wall, train))
    validated = _step(record.get("validated_step"))
    if validated is not None:
        scores = {f"validation/{n}": v for n in VALIDATION_SCALARS
                  if (v := as_number(record.get(n))) is not None and math.isfinite(v)}
        reach = record.get("acceptance_at")
        if isinstance(reach, list):
            scores.update({f"validation/acceptance_at_{k}": v for k, x in enumerate(reach, start=1)
                           if (v := as_number(x)) is not None and math.isfinite(v)})
        if scores:
            out.append((validated, wall, scores))
    return out
