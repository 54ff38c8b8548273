"""Starting and stopping worker processes so that none outlives its supervisor.

Every child runs `python -m dflash_ipc.cli <stage> --config <run_dir>/config.yaml`, in its
own session (so its own process group), and sets the Linux parent-death signal to SIGTERM at
its start (`die_with_parent`): if the supervisor is killed (even with SIGKILL) the kernel
sends SIGTERM to each child, which then unwinds normally (closing its slot pool and sockets).
`ParentWatch` is the second line of defence, and covers a supervisor that died before the
child set the signal: a thread that exits the child when its parent is no longer the
supervisor. Nothing runs between fork and exec (no `preexec_fn`): that is unsafe in a parent
with threads, and the supervisor has some (sockets, trackers).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

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


@dataclass
class Child:
    """One supervised process."""
    role: str          # "dispatcher", "target/3", "drafter/0"
    argv: list[str]
    env: dict
    log_path: str
    keep_fds: tuple[int, ...] = ()  # inherited open files (the run directory's lock)
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: list[float] = field(default_factory=list)
    past_pids: list[int] = field(default_factory=list)  # earlier processes of this role

    def start(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            raise RuntimeError(f"{self.role} (pid {self.popen.pid}) is still running: not started twice")
        if self.popen is not None:
            self.past_pids.append(self.popen.pid)
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        log_file = open(self.log_path, "ab")
        env = dict(self.env, **{REPLACES_ENV: ",".join(map(str, self.past_pids[-64:]))})
        self.popen = subprocess.Popen(self.argv, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      pass_fds=self.keep_fds)
        log_file.close()
        self.started_at = time.monotonic()
        log.info("started %s (pid %d)", self.role, self.popen.pid)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def poll(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def signal(self, sig: int) -> None:
        if self.popen and self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)  # the child's own group: it and anything it started
            except ProcessLookupError:
                pass


def stop_children(children: list[Child], grace_s: float) -> None:
    """SIGTERM every living child, wait up to `grace_s`, then SIGKILL what is left."""
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        if child.popen is None:
            continue
        try:
            child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) ignored SIGTERM for %.0fs: SIGKILL", child.role, child.pid, grace_s)
            child.signal(signal.SIGKILL)
            child.popen.wait()


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
