"""Starting and stopping worker processes so that none outlives its supervisor.

Every child runs `python -m dflash_ipc.cli <stage> --config <run_dir>/config.yaml` in its own
session (so its own process group); what the child does at its start to die with its
supervisor is `run.child_env`. Nothing runs between fork and exec (no `preexec_fn`): that is
unsafe in a parent with threads, and the supervisor has some (sockets, trackers).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

from dflash_ipc.run.child_env import REPLACES_ENV

log = logging.getLogger(__name__)


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
