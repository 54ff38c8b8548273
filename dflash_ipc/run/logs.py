"""Logging set-up: every line carries the process role and rank (`target/3`, `drafter/1`)."""

from __future__ import annotations

import logging
import os
import sys

from dflash_ipc.run.quiet import quiet_unactionable_warnings

_FORMAT = "%(asctime)s %(levelname).1s [%(role)s] %(name)s: %(message)s"


class _RoleFilter(logging.Filter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        return True


def setup_logging(role: str, *, level: str = "INFO", log_file: str | None = None) -> None:
    """Configures the root logger of this process; `role` is e.g. 'dispatcher' or 'target/3'."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler.addFilter(_RoleFilter(role))
        root.addHandler(handler)
    root.setLevel(level)
    # transformers and torch are chatty at INFO about things that are expected here.
    for noisy in ("transformers", "torch", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    quiet_unactionable_warnings()  # torchao's import lines (run/quiet.py)


def tail_lines(path: str, lines: int, *, max_bytes: int = 8000) -> list[str]:
    """The last `lines` lines within the last `max_bytes` bytes of a log file, read from its
    end (a long job's log may be gigabytes); OSError when it cannot be read."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - max_bytes))
        return f.read(max_bytes).decode(errors="replace").splitlines()[-lines:]
