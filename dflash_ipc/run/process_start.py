"""A process's start as every process reads it: clock ticks since boot (Linux).

psutil's ``create_time()`` is the start in clock ticks since boot plus the boot time, and Linux
derives the boot time (``btime`` of /proc/stat) from the wall clock: where the wall clock is
stepped or drifts against the kernel's boot clock, ``btime`` moves, and two processes that read
``create_time()`` of one process moments apart disagree by whole seconds. (One build machine
of this project gained a second of wall clock on its boot clock every ~200 s: a drafter
restarted there took every target's slot pools for a dead process's and dropped their batches
for ever.) Field 22 of /proc/<pid>/stat, the start in ticks since boot, is fixed for the
process's life and the same for every reader: an identity for a pid that cannot have been
reused in between.
"""

from __future__ import annotations

import psutil

RECORD_SLACK_S = 1.0
"""Where a record has no start in ticks: psutil's start times have clock-tick resolution, and a
record of a process is written just after it started."""


def start_ticks(pid: int) -> int | None:
    """``pid``'s start in clock ticks since boot; None when it has no /proc entry (gone, or no
    procfs: not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return parse_start_ticks(f.read())
    except (OSError, ValueError, IndexError):
        return None


def parse_start_ticks(stat: bytes) -> int:
    """Field 22 of a /proc/<pid>/stat line. Field 2, the command in parentheses, may hold spaces
    and parentheses itself: the fields are counted from after its last ')'."""
    after_command = stat[stat.rindex(b")") + 1:].split()
    return int(after_command[19])  # after_command[0] is field 3 (the state)


def is_recorded_process(proc: psutil.Process, ticks: int | None, written_at: float) -> bool:
    """Whether ``proc`` is the process a record written at ``written_at`` (wall clock) names, not
    a later one that reused its pid: its start in ticks equals the record's ``ticks`` where the
    record has them and /proc answers; else it was created no later than the record was written
    (within RECORD_SLACK_S), a rule that reads the wall clock. psutil errors propagate (gone)."""
    if ticks is not None:
        found = start_ticks(proc.pid)
        if found is not None:
            return found == ticks
    return proc.create_time() <= written_at + RECORD_SLACK_S
