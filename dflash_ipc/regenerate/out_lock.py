"""One regenerate per output: an exclusive `flock` on OUT.lock beside OUT.jsonl.

RegenOutput appends whole lines, cuts back a line it did not finish, cuts a torn last line off
on resume and rewrites the file sorted through a rename: each assumes this process is the
file's only writer. Two runs on one `--out` (a command started twice, a job array with one
output) would interleave rows, cut each other's lines and sort a file the other still appends
to. So the output is held for the whole run; a second run is refused, naming the holder's pid.
The command line takes the lock before the model loads and hands it to RegenOutput, which
releases it when the output is closed.

A separate lock file because the output itself is deleted by `--overwrite` and replaced by the
sort's rename, and a lock on one inode says nothing of the next. The kernel drops a flock with
its process, so a killed run leaves no stale lock; the file stays, holding the last holder's
pid (`.lock` is not a data file a directory input reads). It is made writable for everyone the
umask allows, since a directory that several users write to is shared by their runs; a lock
file another user made and this one cannot write is locked through a read-only descriptor.
A filesystem without flock (some Lustre, FUSE and SMB mounts) gets one warning and no lock.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from dflash_ipc.errors import DataError

log = logging.getLogger(__name__)

_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def lock_path(out_path: str) -> str:
    """OUT.lock for OUT.jsonl (OUT.x.lock for any other name)."""
    stem = out_path[: -len(".jsonl")] if out_path.endswith(".jsonl") else out_path
    return f"{stem}.lock"


class OutLock:
    """Held from `acquire` to `release` (or the process's end); `held` says whether it is."""

    def __init__(self, out_path: str) -> None:
        self.out_path = os.path.abspath(out_path)
        self.path = lock_path(self.out_path)
        self.fd: int | None = None
        self.held = False

    def acquire(self) -> None:
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise DataError(f"{self.out_path}: another regenerate is writing it (pid {holder} holds {self.path}); "
                            "wait for that run to end, or choose another --out") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_FLOCK:
                raise DataError(f"{self.path}: cannot lock the output's lock file ({e.strerror or e})") from None
            log.warning("%s: this filesystem does not lock files (%s), so a second regenerate on this --out would "
                        "not be refused: run one at a time", self.path, e.strerror or e)
            return
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.held = fd, True
        try:  # the pid is for the message of a run refused later; the lock holds without it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        except OSError:
            pass

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except PermissionError:
            if os.path.isfile(self.path):  # another user's lock file: flock needs no write access
                try:
                    return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    pass
            error = "permission denied"
        except OSError as e:
            error = e.strerror or str(e)
        raise DataError(f"{self.out_path}: cannot write in {os.path.dirname(self.path)} ({error}: the lock file "
                        f"{os.path.basename(self.path)}); choose a writable --out") from None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.fd, self.held = None, False
