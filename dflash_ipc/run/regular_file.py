"""A file about to be read is a regular file of bounded size, inside the folder it belongs to.

Checkpoints, exports, run directories and configs are read by path, and a path can name
something that is not a file: a FIFO (open() blocks until a writer comes, forever), a
device (/dev/zero reads without end, /dev/tty waits for a key), or a symlink out of the
directory it was listed in. `regular_file` is called before every such open; it returns
the size, so the reader can bound what it reads. The check is on the path as it is now
(a file swapped between the check and the open is an attack on the operator's own disk,
which is trusted).
"""

from __future__ import annotations

import os
import stat

from dflash_ipc.errors import DataError

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def regular_file(path: str, what: str, *, error: type[Exception] = DataError, max_bytes: int | None = None,
                 inside: str | None = None) -> int:
    """The size of `path` when it is a regular file (after symlinks), at most `max_bytes`, and
    (`inside` given) resolving to a path under that directory; `error` naming it otherwise.
    A missing file raises FileNotFoundError, for the caller's own message."""
    st = os.stat(path)  # follows symlinks: what open() would read
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        target = f" (a symlink to {os.path.realpath(path)})" if os.path.islink(path) else ""
        raise error(f"{path}: {what} is {kind}{target}, not a regular file; replace it with the file itself")
    if inside is not None:
        real, root = os.path.realpath(path), _allowed_root(inside)
        if os.path.commonpath([real, root]) != root:
            raise error(f"{path}: {what} is a symlink to {real}, outside {inside}; copy the file itself in")
    if max_bytes is not None and st.st_size > max_bytes:
        raise error(f"{path}: {what} is larger than {max_bytes} bytes ({st.st_size}): not one of ours")
    return st.st_size


def _allowed_root(inside: str) -> str:
    """Where files listed in `inside` may resolve to: `inside` itself, or, for a snapshot of the
    Hugging Face cache (`<repo>/snapshots/<revision>/`, whose files are links to `<repo>/blobs/`),
    that repository's cache folder."""
    root = os.path.realpath(inside)
    snapshots = os.path.dirname(root)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.isdir(os.path.join(repo, "blobs")):
        return repo
    return root
