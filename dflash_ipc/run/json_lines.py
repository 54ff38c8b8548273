"""Reading the JSON-lines files of a run directory (one object per line, appended by one writer).

A process killed mid-write leaves a torn last line, and a file may come from an older version,
or be damaged or edited: readers skip what they cannot use (bad UTF-8, bad JSON, nesting past
the parser's recursion limit, a line over `MAX_LINE_BYTES`, a row of the wrong shape) with a
warning naming the file and line, at most `MAX_WARNINGS` per file, and never fail. A line over
the cap is never held in memory whole (`capped_lines`, which the input reader of `prepare`
uses too). A path that is not a regular file (a FIFO, a device) is skipped whole, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator

from dflash_ipc.run.regular_file import regular_file

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 16 << 20  # far above any line a run writes
MAX_WARNINGS = 5           # per file; then one line with the count
_READ_CHUNK = 1 << 20


def capped_lines(f, cap: int, keep: int = 2000) -> Iterator[tuple[int, bytes, int]]:
    """(line number, bytes, size) of every line of the binary file `f` (anything with
    `readline(limit)`); size counts the line's bytes without its newline. A line over `cap`
    bytes (size > cap) is read on a chunk at a time, never held whole: its bytes are then
    only its first `keep`."""
    line_no = 0
    while True:
        raw = f.readline(cap + 1)
        if not raw:
            return
        line_no += 1
        if len(raw) > cap and not raw.endswith(b"\n"):
            size, head = len(raw), raw[:keep]
            del raw
            while True:  # the rest of the line, a chunk at a time
                more = f.readline(_READ_CHUNK)
                size += len(more)
                if not more or more.endswith(b"\n"):
                    size -= more.endswith(b"\n")
                    break
            yield line_no, head, size
        else:
            yield line_no, raw, len(raw) - raw.endswith(b"\n")


def read_json_lines(path: str, *, keep: Callable[[object], bool] = lambda row: isinstance(row, dict),
                    expected: str = "a JSON object", max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[dict]:
    """The rows of `path` that parse and pass `keep` (nothing when the file does not exist);
    blank lines are skipped silently."""
    if not os.path.exists(path):
        return
    try:  # a FIFO would block the open, /dev/zero never end a line
        regular_file(path, "a JSON-lines file", error=OSError)
    except OSError as e:
        log.warning("%s; skipped", e)
        return
    skipped = 0
    with open(path, "rb") as f:
        for number, raw, size in capped_lines(f, max_line_bytes):
            if not raw.strip():
                continue
            row = None
            if size <= max_line_bytes:
                try:
                    row = json.loads(raw)
                except (ValueError, RecursionError):  # bad JSON or UTF-8, huge ints, deep nesting
                    row = None
            if row is not None and keep(row):
                yield row
                continue
            skipped += 1
            if skipped <= MAX_WARNINGS:
                why = f"a line of {size} bytes, over {max_line_bytes}" if size > max_line_bytes else f"not {expected}"
                log.warning("%s:%d: %s; skipped", path, number, why)
    if skipped > MAX_WARNINGS:
        log.warning("%s: %d more lines skipped", path, skipped - MAX_WARNINGS)
