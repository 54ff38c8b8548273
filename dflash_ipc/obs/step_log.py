"""The drafter's per-step records, as the trackers' per-step scalars.

Drafter rank 0 writes one JSON line per optimizer step to `RUN_DIR/drafter_metrics.jsonl`
(drafter/loop.py). The supervisor, the trackers' only writer, reads the lines added since its
last look at every status poll (`StepLogTail`) and writes each as scalars at its own step
(`step_scalars`), so a tracker gets one point per optimizer step, not one per poll:

  train/{loss,lr,grad_norm,anchors,tokens,step_s}     at the record's `step`
  validation/acceptance_length, acceptance_blocks,    at `validated_step` (the weights scored:
  validation/acceptance_at_<k>                         those before the record's step)
  validation/held_out_tau                              at `validated_step`, the checkpoint decoded
                                                       (validation.prompts > 0)

A supervisor started again in the same run directory starts at the file's end: what is there
was written to the trackers by the one before. Only complete lines are read (a line being
written waits for the next poll). A line that is not a step record is skipped, with one warning
for the whole file: not a JSON object, over `MAX_LINE_BYTES` (skipped as it is read, never
stalling the tail), a `step` that is not an int in [0, 2**62], a non-finite scalar, or an
`acceptance_at` over `MAX_ACCEPTANCE` entries. A path that is not a regular file (a FIFO
would block the supervisor's open) is not read, with one warning.
"""

from __future__ import annotations

import json
import logging
import math
import os

from dflash_ipc.run.json_files import as_number
from dflash_ipc.run.regular_file import regular_file

log = logging.getLogger(__name__)

TRAIN_SCALARS = ("loss", "lr", "grad_norm", "anchors", "tokens", "step_s")
VALIDATION_SCALARS = ("acceptance_length", "acceptance_blocks", "held_out_tau")
MAX_LINE_BYTES = 1 << 20  # a step record is a few hundred bytes
MAX_READ_BYTES = 64 << 20  # per poll: a supervisor that fell far behind catches up over polls
MAX_STEP = 1 << 62         # a tracker's step: an absurd one must not reach add_scalar
MAX_ACCEPTANCE = 64        # entries of acceptance_at (one per block position): tags per record


class StepLogTail:
    """The records appended to one JSONL file since the last `read()`."""

    def __init__(self, path: str, *, from_end: bool = True) -> None:
        self.path = path
        self.offset = os.path.getsize(path) if from_end and os.path.exists(path) else 0
        self.skipped = 0
        self._in_long_line = False  # the bytes at `offset` continue a line over MAX_LINE_BYTES
        self._warned_not_regular = False

    def read(self) -> list[dict]:
        try:
            regular_file(self.path, "the drafter's step log", error=OSError)  # a FIFO would block open()
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # replaced by a shorter file: start over
                    self.offset, self._in_long_line = 0, False
                f.seek(self.offset)
                data = f.read(MAX_READ_BYTES)
        except FileNotFoundError:
            return []
        except OSError as exc:
            if not self._warned_not_regular:
                self._warned_not_regular = True
                log.warning("%s; the trackers get no step records until it is", exc)
            return []
        start = 0
        if self._in_long_line:  # the rest of an overlong line: skipped up to its newline
            newline = data.find(b"\n")
            if newline < 0:
                self.offset += len(data)
                return []
            start, self._in_long_line = newline + 1, False
        end = max(data.rfind(b"\n") + 1, start)  # complete lines only
        records = []
        for line in data[start:end].splitlines():
            record = _record(line)
            if record is not None:
                records.append(record)
            elif line.strip():
                self._skip(line)
        if len(data) - end > MAX_LINE_BYTES:  # a partial line already over the bound: never waited for
            self._skip(data[end:end + 60])
            self._in_long_line, end = True, len(data)
        self.offset += end
        return records

    def _skip(self, line: bytes) -> None:
        self.skipped += 1
        if self.skipped == 1:
            log.warning("%s: a line that is not a step record is skipped (%.60r)", self.path, line)


def _record(line: bytes) -> dict | None:
    if len(line) > MAX_LINE_BYTES:
        return None
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) and _well_formed(value) else None


def _well_formed(record: dict) -> bool:
    """Whether `record` is one the trackers can take: an int step in [0, MAX_STEP], finite
    scalars, a bounded `acceptance_at` (a sink's add_scalar must never see an absurd value)."""
    if _step(record.get("step")) is None:
        return False
    if "validated_step" in record and record["validated_step"] is not None and _step(record["validated_step"]) is None:
        return False
    for name in (*TRAIN_SCALARS, *VALIDATION_SCALARS, "time"):
        value = as_number(record.get(name))
        if value is not None and not math.isfinite(value):
            return False
    reach = record.get("acceptance_at")
    if isinstance(reach, list):
        if len(reach) > MAX_ACCEPTANCE:
            return False
        if any((v := as_number(x)) is not None and not math.isfinite(v) for x in reach):
            return False
    return True


def _step(value) -> int | None:
    """`value` when it is an int (not a bool) in [0, MAX_STEP], else None."""
    return value if type(value) is int and 0 <= value <= MAX_STEP else None


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
