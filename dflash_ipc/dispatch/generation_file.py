"""The run directory's `drafter_generation`: the last drafter-group generation a dispatcher
used, so a restarted one starts one past it (its drafters are new processes, a new group).

The file holds one decimal integer and a newline, written whole (a temp file renamed). Read
back, anything else (garbage, a number of 5,000 digits or past 2^62, a negative one, a FIFO)
is one DataError naming the file and what to do, at the job's start (`up` checks it before
any child starts) rather than as tracebacks of a dispatcher restarted until the job fails.
"""

from __future__ import annotations

import os

from dflash_ipc.errors import DataError
from dflash_ipc.run.regular_file import regular_file

MAX_GENERATION = 1 << 62  # the wire's integers are 64-bit; a count of restarts never comes near
_MAX_FILE_BYTES = 32  # 19 digits and a newline, with room


def read_generation(path: str) -> int | None:
    """The generation saved in `path`; None when there is none (no file, or an empty one)."""
    try:
        size = regular_file(path, "the drafter generation file")
        with open(path, "rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DataError(f"{path}: unreadable ({e}); {_REMEDY}") from None
    text = data.decode("ascii", errors="replace").strip()
    if size > _MAX_FILE_BYTES or not (text.isascii() and text.isdigit()) and text:
        shown = f"{size} bytes" if size > _MAX_FILE_BYTES else repr(text[:40])
        raise DataError(f"{path}: holds {shown}, not a drafter generation (an integer from 0 to 2^62); {_REMEDY}")
    if not text:
        return None
    generation = int(text)
    if generation >= MAX_GENERATION:
        raise DataError(f"{path}: holds {generation}, past 2^62, not a drafter generation; {_REMEDY}")
    return generation


def write_generation(path: str, generation: int) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{generation}\n")
    os.replace(tmp, path)


_REMEDY = ("a dispatcher writes it at each start: remove it (the next start counts from 0) or restore it "
           "from a backup of this run directory")
