"""What may refuse a job before anything of its run directory is touched: the devices, then the
run directory's lock (run/lock.py). Here, above config, since the device check reads the job's
config (run/ sits below it)."""

from __future__ import annotations

import os

from dflash_ipc.config.machine import check_job_devices
from dflash_ipc.run.lock import RunLock


def claim_run_dir(cfg) -> RunLock:
    """The devices, then the run directory's lock, before anything there is created (a
    tracker's files, a sweep). `up` calls it before the target is resolved (torch's import, a
    Hub download: seconds), so a directory in use is refused at once and `health` reads the job
    as starting meanwhile."""
    check_job_devices(cfg)  # a config error never reaches a child (nor its restarts)
    run_dir = os.path.abspath(cfg.run.run_dir)
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    lock = RunLock(run_dir, cfg.run.node_rank)
    lock.acquire()  # refused: another job's files, left as they are
    return lock
