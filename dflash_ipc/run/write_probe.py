"""Whether a directory takes a new file now: a file made there and removed at once.

Permission bits alone (`os.access`) miss a read-only filesystem, a full quota of inodes and,
for root, every mode: root passes any access check and still cannot write to a read-only
mount. A command that writes its output only after minutes of work asks this first, so a bad
output path is one error line before the work rather than a traceback after it
(`output_file_problem`: the whole check of an output file's path).
"""

from __future__ import annotations

import os
import tempfile


def check_takes_new_files(directory: str) -> None:
    """Raises the OSError a new file in `directory` meets (EROFS, EACCES, ENOSPC, ...); leaves
    nothing behind."""
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".dflash-write-check-")
    os.close(fd)
    os.unlink(probe)


def output_file_problem(path: str) -> str | None:
    """Why a file could not be written at `path` now, in words that follow "PATH: ", or None:
    a directory in its place, a directory that does not exist or takes no new file, a file
    there that cannot be written."""
    if os.path.isdir(path):
        return "is a directory; give a file path"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"its directory {parent} does not exist"
    try:
        check_takes_new_files(parent)
    except OSError as e:
        return f"cannot write in {parent} ({e.strerror or e}): its directory is not writable"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "exists and is not writable"
    return None
