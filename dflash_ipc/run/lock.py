"""One job per run directory (per node): an exclusive `flock` on `<run_dir>/.lock`.

The supervisor takes it before it touches anything of the run directory (the segment sweep,
the checkpoints it sets aside, the socket) and every child inherits the open file, so the lock
lasts until the last process of the job has exited, not only the supervisor: a rerun started
while a killed supervisor's children are still unwinding, or a second `dflash-up` on the same
directory, is refused instead of sweeping the live job's shared memory and taking over its
socket. The kernel releases a flock with the last descriptor of its open file, so a job that is
SIGKILLed whole leaves no stale lock. Node K of a multi-node job locks its own file (a shared
run directory holds one per node).

The file holds the supervisor's pid and its start in clock ticks since boot
(run/process_start.py), so that `health` can tell that process from a later one with the
same pid without the wall clock (job_phase.lock_holder).
"""

from __future__ import annotations

import fcntl
import os

from dflash_ipc.errors import ConfigError
from dflash_ipc.run.files import node_file
from dflash_ipc.run.process_start import start_ticks


def lock_text(pid: int) -> str:
    """What the lock file holds: ``"<pid> <start ticks>\\n"``, or ``"<pid>\\n"`` where /proc is absent."""
    ticks = start_ticks(pid)
    return f"{pid}\n" if ticks is None else f"{pid} {ticks}\n"


class RunLock:
    """Held from `acquire` to `release`; `fd` is what children inherit (`pass_fds`)."""

    def __init__(self, run_dir: str, node_rank: int = 0) -> None:
        self.path = node_file(run_dir, ".lock", node_rank)
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (os.pread(fd, 32, 0).decode("ascii", "replace").split() or ["?"])[0]
            os.close(fd)
            raise ConfigError(
                f"run.run_dir: {os.path.dirname(self.path)} is in use by another job on this node ({self.path} "
                f"is locked; its supervisor was pid {holder}, and processes of a stopped job hold it until they "
                "exit): wait for that job to end, or use another run.run_dir") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, lock_text(os.getpid()).encode("ascii"), 0)
        self.fd = fd

    def abandon(self, *, remove_dir: bool) -> None:
        """A job that failed before it started. `remove_dir`: this claim made the run directory,
        so the lock file and the directory go (a mistake leaves nothing); in an existing one the
        file stays, so that a job opening it meanwhile locks the same file as the next one."""
        if remove_dir:
            os.unlink(self.path)
        self.release()
        if remove_dir:
            try:
                os.rmdir(os.path.dirname(self.path))
            except OSError:  # something else appeared there meanwhile: it stays
                pass

    def release(self) -> None:
        """Closes this process's descriptor; children that still run keep the lock."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
