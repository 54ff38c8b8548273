"""Reading the JSON-lines files of a run directory (one object per line, appended by one writer).

A process killed mid-write leaves a torn last line, and a file may come from an older version:
readers skip what they cannot use with one warning naming the file and line, never fail.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


def read_json_lines(path: str, *, keep: Callable[[object], bool] = lambda row: isinstance(row, dict),
                    expected: str = "a JSON object") -> Iterator[dict]:
    """The rows of `path` that parse and pass `keep` (nothing when the file does not exist)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if row is not None and keep(row):
                yield row
            else:
                log.warning("%s:%d: not %s; skipped", path, number, expected)
