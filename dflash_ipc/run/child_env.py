"""The supervisor-to-child contract: what a supervised process reads at its start and how it
dies with its supervisor.

Every child runs in its own session and sets the Linux parent-death signal to SIGTERM at its
start (`die_with_parent`): if the supervisor is killed (even with SIGKILL) the kernel sends
SIGTERM to each child, which then unwinds normally (closing its slot pool and sockets).
`ParentWatch` is the second line of defence, and covers a supervisor that died before the
child set the signal: a thread that exits the child when its parent is no longer the
supervisor. The supervisor passes its pid (`SUPERVISOR_ENV`) and, to a restarted child, the
pids it replaces (`REPLACES_ENV`). The job's secret, which every `Register` for a seat must
carry, is not in the environment: each child reads `<run_dir>/keys/job_secret`
(`wire.security.read_job_secret`), as a stage started by hand with `--config` does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
REPLACES_ENV = "DFLASH_IPC_REPLACES"  # the pids a restarted child replaces, comma-separated
SUPERVISOR_ENV = "DFLASH_IPC_SUPERVISED"  # the supervisor's pid, in every child it starts


def supervisor_pid() -> int | None:
    """The pid of the supervisor that started this process, or None when run by hand. Read
    from the environment, not `os.getppid()`: a supervisor that died before this is read has
    already handed its child to another parent."""
    raw = os.environ.get(SUPERVISOR_ENV, "")
    return int(raw) if raw.isdigit() else None


def replaced_pids() -> list[int]:
    """The pids this process replaces, as its supervisor set them (its `Register` names them:
    the dispatcher gives a held seat only to the holder's successor)."""
    raw = os.environ.get(REPLACES_ENV, "")
    return [int(x) for x in raw.split(",") if x.strip().isdigit()][-64:]


def die_with_parent() -> None:
    """Called by a child at its start: the kernel sends it SIGTERM when its parent dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)



class ParentWatch(threading.Thread):
    """Exits this process when the parent that started it is gone: SIGTERM to itself, then,
    if it still runs `grace_s` later, `before_kill()` (unlink what it owns) and SIGKILL. A
    process whose main thread is stuck in C code (a rendezvous or collective whose peers are
    gone retries for many minutes) runs no Python signal handler until that call returns, and
    a SystemExit raised inside a finalizer is printed and dropped: neither may outlive its
    supervisor holding GPU memory and ports.

    `parent` is the supervisor's pid as it passed it down (`DFLASH_IPC_SUPERVISED`): a
    supervisor killed between fork and the parent-death `prctl`, or before this thread
    starts, has already handed the child to another parent, and `os.getppid()` read here
    would take that one for the supervisor."""

    def __init__(self, interval_s: float = 1.0, parent: int | None = None, grace_s: float = 10.0,
                 before_kill=None) -> None:
        super().__init__(daemon=True, name="parent-watch")
        self.parent = os.getppid() if parent is None else parent
        self.interval_s, self.grace_s, self.before_kill = interval_s, grace_s, before_kill

    def run(self) -> None:
        while os.getppid() == self.parent:
            time.sleep(self.interval_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(self.grace_s)  # a process that unwinds is gone before this ends
        try:
            if self.before_kill is not None:
                self.before_kill()
        finally:
            os.kill(os.getpid(), signal.SIGKILL)


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like an exception, so `finally` blocks close pools and sockets.

    Once only: when the supervisor dies, a child hears SIGTERM twice (the parent-death
    signal, then `ParentWatch` a second later), and a second SystemExit raised inside the
    unwinding skips what is left of it, such as the `finally` that unlinks a shared-memory
    segment. Later SIGTERMs are ignored; the supervisor's SIGKILL after its grace period
    still ends a child that does not finish."""
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def unlink_own_segments() -> None:
    """Before a SIGKILL of this process by itself: the shared-memory pools it created. Only
    if the module is loaded (no pool otherwise); importing here could wait on a lock forever."""
    shm = sys.modules.get("dflash_ipc.transport.shm")
    if shm is not None:
        shm.unlink_own_segments()
