"""One regenerate per output: an exclusive `flock` on OUT.lock beside OUT.jsonl.

RegenOutput appends whole lines, cuts back a line it did not finish, cuts a torn last line off
on resume and rewrites the file sorted through a rename: each assumes this process is the
file's only writer. Two runs on one `--out` (a command started twice, a job array with one
output) would interleave rows, cut each other's lines and sort a file the other still appends
to. So the output is held for the whole run; a second run is refused, naming the holder's pid.

A separate lock file because the output itself is deleted by `--overwrite` and replaced by the
sort's rename, and a lock on one inode says nothing of the next. The kernel drops a flock with
its process, so a killed run leaves no stale lock; the empty file stays (`.lock` is not a data
file a directory input reads).
"""

from __future__ import annotations

import fcntl
import os

from dflash_ipc.errors import DataError


def lock_path(out_path: str) -> str:
    """OUT.lock for OUT.jsonl (OUT.x.lock for any other name)."""
    stem = out_path[: -len(".jsonl")] if out_path.endswith(".jsonl") else out_path
    return f"{stem}.lock"


class OutLock:
    """Held from `acquire` to `release` (or the process's end)."""

    def __init__(self, out_path: str) -> None:
        self.out_path = os.path.abspath(out_path)
        self.path = lock_path(self.out_path)
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise DataError(f"{self.out_path}: cannot write in {os.path.dirname(self.path)} ({e.strerror or e}: "
                            f"the lock file {os.path.basename(self.path)}); choose a writable --out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise DataError(f"{self.out_path}: another regenerate is writing it (pid {holder} holds {self.path}); "
                            "wait for that run to end, or choose another --out") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def check_unlocked(out_path: str) -> None:
    """Before the model loads: DataError when another run holds `out_path`. Takes the lock and
    lets it go at once (RegenOutput holds it for the run); where the output's directory does
    not exist yet, nothing can hold it."""
    if not os.path.isdir(os.path.dirname(os.path.abspath(out_path))):
        return
    lock = OutLock(out_path)
    lock.acquire()
    lock.release()
