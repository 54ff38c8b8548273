"""Before and after a job's processes run: what `health` reads instead of "down".

A job whose supervisor is up but whose dispatcher has not answered yet is starting (its
children are importing torch and loading the target); before the supervisor has written
processes.json, the run directory's lock (run/lock.py) names it. A job whose dispatcher wrote
a final status with every batch committed has finished: the state `up` exits 0 in.
"""

from __future__ import annotations

import os

import psutil

from dflash_ipc.errors import DataError
from dflash_ipc.run.files import node_file
from dflash_ipc.run.process_start import RECORD_SLACK_S, is_recorded_process
from dflash_ipc.run.regular_file import regular_file
from dflash_ipc.wire.status import JobStatus, read_status_file

STARTING, FINISHED = "starting", "finished"  # health's levels read instead of down
LOCK_FILE = ".lock"  # run/lock.py's RunLock(run_dir, node_rank)


def lock_holder(run_dir: str, node_rank: int = 0) -> int | None:
    """The pid written in the run directory's lock when that very process still runs (a reused
    pid is not a supervisor of this run); else None. The lock names its writer's start in clock
    ticks since boot (run/lock.py), compared exactly; a lock without them (no /proc where it was
    written) falls back to "not younger than the lock's mtime", which reads the wall clock.
    Read without taking the lock: a probe must never make a starting supervisor's own
    (non-blocking) acquire fail."""
    path = node_file(run_dir, LOCK_FILE, node_rank)
    try:
        regular_file(path, "the run lock", error=OSError)  # a FIFO there would block open(): health hangs
        with open(path, "rb") as f:
            fields = f.read(64).decode("ascii", "replace").split()
        written_at = os.stat(path).st_mtime
        pid = int(fields[0])
        recorded = int(fields[1]) if len(fields) > 1 else None
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE or not is_recorded_process(proc, recorded, written_at):
            return None
        return pid
    except (OSError, ValueError, IndexError, psutil.Error):
        return None


def finished_status(path: str, since: float) -> JobStatus | None:
    """The final status at `path` when it says the job finished (every batch committed) and
    was written at or after `since` (the processes.json of this run, not an earlier one's);
    None when it is absent, older, torn or of another shape (health then says down)."""
    try:
        if os.stat(path).st_mtime + RECORD_SLACK_S < since:
            return None
        status = read_status_file(path)
    except (OSError, DataError):
        return None
    return status if status.finished else None


def answered_before(previous: dict, rows) -> bool:
    """An earlier check of these very processes got the dispatcher's status (its counters are
    in health's state file, `previous`, under their pids): a dispatcher silent now is not one
    still starting."""
    return any(isinstance(previous.get(row.role), dict) and previous[row.role].get("pid") == row.pid
               for row in rows if row.role != "supervisor")


def starting_or_finished(report, final_job: dict | None, final_path: str, *, answered: bool) -> None:
    """A job that looks down because its dispatcher does not answer: finished (its final status
    says every batch is committed) or starting (the supervisor runs, the dispatcher process is
    alive, no check has had an answer from it yet, and the run is younger than
    supervise.startup_timeout_s)."""
    rows = {row.role: row for row in report.processes}
    if final_job is not None:  # the finished final status, as health's job summary
        report.level = FINISHED
        report.job = final_job
        report.reasons = [f"the job finished: every batch committed ({final_path})"]
        return
    supervisor, dispatcher = rows["supervisor"], rows.get("dispatcher")
    age_s, limit_s = report.thresholds["run_age_s"], report.thresholds["startup_timeout_s"]
    dispatcher_up = report.node_rank != 0 or (dispatcher is not None and dispatcher.alive)
    if (supervisor.alive and dispatcher_up and age_s < limit_s and not answered
            and not any(r.problems for r in report.processes)):
        report.level = STARTING
        report.reasons = [f"the dispatcher does not answer yet: the job started {age_s:.0f}s ago "
                          f"(supervise.startup_timeout_s = {limit_s:g})"]
