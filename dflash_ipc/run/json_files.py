"""JSON files read back from disk (datasets, checkpoints, exports, run directories), strictly.

A JSON file in one of those folders is data someone may have damaged, truncated or crafted:
`read_json_object` turns every way it can be wrong (missing, a directory, larger than a
bound, a FIFO or a device, bad UTF-8, bad JSON, nested past the parser's recursion limit, an integer past
Python's 4,300 digits, a bare NaN/Infinity, not an object) into one line of the caller's
error type naming the file. `json_safe` is the other direction: non-finite floats become
null, so what we write is JSON every reader accepts; `write_json_atomic` writes a file that
way, whole or not at all.
"""

from __future__ import annotations

import contextlib
import json
import math
import os

from dflash_ipc.errors import DataError
from dflash_ipc.run.regular_file import regular_file

MAX_JSON_FILE_BYTES = 256 * 1024 * 1024  # far above any metadata file; a bigger one is not ours


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json_strict(text: str | bytes):
    """json.loads that refuses NaN/Infinity (Python's json accepts them); its other errors
    (ValueError, RecursionError) propagate."""
    return json.loads(text, parse_constant=_no_constant)


def read_json_object(path: str, what: str, *, error: type[Exception] = DataError,
                     max_bytes: int = MAX_JSON_FILE_BYTES) -> dict:
    """The JSON object in `path`; `error` (one line naming the file and `what`) otherwise."""
    try:
        regular_file(path, what, error=error, max_bytes=max_bytes)  # no FIFO, no device, bounded
        with open(path, "rb") as f:
            value = parse_json_strict(f.read())
    except FileNotFoundError:
        raise error(f"{path}: {what} missing") from None
    except RecursionError:
        raise error(f"{path}: {what} unreadable (nested deeper than the parser's recursion limit)") from None
    except json.JSONDecodeError as exc:
        raise error(f"{path}: {what} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: {what} is not UTF-8 (byte {exc.start})") from None
    except (OSError, ValueError) as exc:
        if isinstance(exc, error):
            raise
        raise error(f"{path}: {what} unreadable ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: {what} is not a JSON object (a {type(value).__name__})")
    return value


def json_safe(value):
    """`value` with non-finite floats as None, so it is valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def as_number(value) -> float | None:
    """A JSON value as a float when it is a number (bools excluded: JSON's true is no count),
    else None (a status writes a NaN as null)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def write_json_atomic(path: str, value, *, indent: int | None = 1, sort_keys: bool = False,
                      fsync: bool = False) -> None:
    """`value` as strict JSON (json_safe: no bare NaN/Infinity), written to a temp file of this
    process and renamed over `path`: a reader sees the old file or the new one, never a torn
    one. ``fsync``: on disk before the rename (a checkpoint's manifest, a resumable state)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(json_safe(value), f, indent=indent, sort_keys=sort_keys, allow_nan=False)
            f.write("\n")
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a value that is not JSON, a full disk: no temp file left behind
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
