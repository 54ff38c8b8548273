"""SIGTERM ends a regeneration as Ctrl-C does: the output closed as partial, a rerun resumes.

Slurm, docker stop and `timeout` send SIGTERM, whose default action ends the process at once:
no fsync, a state file that still counts the rows of the run's start, no word on stderr.
While `StopOnSigterm` is entered, SIGTERM raises SystemExit(143) (128 + the signal, the code
a shell shows for it, as Ctrl-C's Abort gives 130) in the main thread, which unwinds through
the run's `finally` like the KeyboardInterrupt of Ctrl-C: the output is fsynced, the state
file written, the partial line logged, the backend closed (device processes stopped by pid).

Once only: a second SIGTERM (a `timeout` that signals the process group after its child) is
ignored rather than cutting the closing short; SIGKILL still ends a run that hangs. A SIGTERM
that comes while the output closes (`closing()`) waits until it is closed, then stops the
run. The previous handler is restored on exit.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class StopOnSigterm:
    """A context manager: SIGTERM -> SystemExit(128 + SIGTERM) while entered (see the module docstring)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._closing = False
        self._raised = False
        self._previous = None
        self._installed = False

    def __enter__(self) -> "StopOnSigterm":
        # Python runs signal handlers in the main thread only, and only it may set them; a
        # regenerate() called from another thread keeps the process's own handling.
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True
        return self

    def __exit__(self, *exc) -> bool:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
        return False

    def _on_signal(self, signum, frame) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if not self._closing:
            self._stop()

    def _stop(self):
        self._raised = True
        raise SystemExit(128 + self.signum)

    @contextlib.contextmanager
    def closing(self):
        """Holds a SIGTERM back while the output is closed (fsync, sort, state file)."""
        self._closing = True
        try:
            yield
        finally:
            self._closing = False
        if self.signum is not None and not self._raised:
            self._stop()
