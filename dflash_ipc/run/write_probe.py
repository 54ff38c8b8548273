"""Whether a directory takes a new file now: a file made there and removed at once.

Permission bits alone (`os.access`) miss a read-only filesystem, a full quota of inodes and,
for root, every mode: root passes any access check and still cannot write to a read-only
mount. A command that writes its output only after minutes of work asks this first, so a bad
output path is one error line before the work rather than a traceback after it.
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
