"""Children that never outlive their supervisor: `ParentWatch` against real processes."""

import os
import signal
import subprocess
import sys
import time

_WATCHED = """
import sys, time
from dflash_ipc.run.child_env import ParentWatch
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


class _Loop:
    stop_reason = None


def _signals_after(watch, enter_then):
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with watch:
            enter_then()
        return {s: signal.getsignal(s) for s in previous}
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_training_drafter_stops_at_a_signal_and_unwinds_once_when_its_supervisor_is_gone():
    from dflash_ipc.drafter.worker import StopOnSignal
    # Its supervisor alive: a SIGTERM asks the group to stop together; nothing unwinds.
    loop = _Loop()
    kept = _signals_after(StopOnSignal(loop), lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert loop.stop_reason == "SIGTERM" and kept[signal.SIGTERM] is not signal.SIG_IGN
    # Its supervisor gone: the first SIGTERM unwinds; the second (ParentWatch's) is ignored,
    # during the unwinding and after it.
    gone = StopOnSignal(_Loop())
    gone._parent = -1  # not this process's parent: as after the supervisor died

    def twice():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        except SystemExit as first:
            assert first.code == 128 + signal.SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # a handler that raised again would do it here
            return
        raise AssertionError("the first SIGTERM did not unwind")

    after = _signals_after(gone, twice)
    assert after[signal.SIGTERM] is signal.SIG_IGN and after[signal.SIGINT] is signal.SIG_IGN


_STUCK = """
import signal, sys, time
from dflash_ipc.run.child_env import ParentWatch
from dflash_ipc.transport.backends import create_pool
from dflash_ipc.transport.shm import unlink_own_segments
from dflash_ipc.transport.slots import SlotLayout
pool = create_pool(SlotLayout(1, 1, 1, "float32"), "cpu", name=sys.argv[2])
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a main thread stuck in C code would: deaf to it
print(pool.descriptor()["segment"], flush=True)
ParentWatch(interval_s=0.05, parent=int(sys.argv[1]), grace_s=0.5, before_kill=unlink_own_segments).start()
time.sleep(60)
"""


def test_a_child_deaf_to_sigterm_is_killed_after_the_grace_and_leaves_no_segment():
    from dflash_ipc.transport.backends import unlink_segments
    from dflash_ipc.transport.shm import SHM_DIR
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    child = subprocess.Popen([sys.executable, "-c", _STUCK, str(gone.pid), f"dfpw{os.getpid()}"],
                             stdout=subprocess.PIPE, text=True)
    try:
        segment = child.stdout.readline().strip()
        assert segment.startswith(f"dfpw{os.getpid()}")
        assert child.wait(30) == -signal.SIGKILL
        assert not os.path.exists(os.path.join(SHM_DIR, segment))
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(5)
        unlink_segments(f"dfpw{os.getpid()}")
