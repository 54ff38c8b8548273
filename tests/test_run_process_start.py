"""run/process_start.py: a process's start in clock ticks since boot, the same for every reader
whatever the wall clock does (psutil's create_time follows the wall clock's boot time)."""

import os
import subprocess
import sys

import pytest

from dflash_ipc.run.process_start import parse_start_ticks, start_ticks

linux = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")


def test_field_22_is_counted_after_the_commands_last_parenthesis():
    rest = " ".join(str(n) for n in range(4, 52))  # fields 4.. : field 22 holds 22
    assert parse_start_ticks(f"123 (python3) S {rest}".encode()) == 22
    assert parse_start_ticks(f"123 (a) b (c) 7) S {rest}".encode()) == 22  # a command with ") " in it
    with pytest.raises(ValueError):
        parse_start_ticks(b"123 no command here")


@linux
def test_a_process_start_is_fixed_and_a_later_child_started_later():
    mine = start_ticks(os.getpid())
    assert isinstance(mine, int) and mine > 0 and start_ticks(os.getpid()) == mine
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        theirs = start_ticks(child.pid)
        assert theirs is not None and theirs >= mine
    finally:
        child.kill()
        child.wait()
    assert start_ticks(child.pid) is None  # gone and reaped: no /proc entry
