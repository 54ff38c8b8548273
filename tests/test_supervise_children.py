"""Children that never outlive their supervisor: `ParentWatch` against real processes."""

import os
import signal
import subprocess
import sys
import time

_WATCHED = """
import sys, time
from dflash_ipc.supervise.children import ParentWatch
ParentWatch(interval_s=0.05, parent=int(sys.argv[1])).start()
print("watching", flush=True)
time.sleep(60)
"""


def _watched_child(parent: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WATCHED, str(parent)], stdout=subprocess.PIPE, text=True)


def test_a_child_whose_supervisor_died_before_the_watch_began_exits():
    # The supervisor's pid comes from the environment it set, not from getppid() read late:
    # by then a dead supervisor's child already has another parent.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    child = _watched_child(gone.pid)
    try:
        assert child.wait(10) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(5)


def test_a_child_of_a_living_supervisor_keeps_running():
    child = _watched_child(os.getpid())
    try:
        assert child.stdout.readline().strip() == "watching"
        time.sleep(0.5)  # ten checks of the watch
        assert child.poll() is None
    finally:
        child.kill()
        child.wait(5)
