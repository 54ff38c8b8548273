"""A benchmark that measures a K-process target worker leads it from its own process.

`bench pipeline` and `bench target` measure a target worker's capacity in-process. With
`target.gpus_per_worker` K > 1 the bench process becomes the worker's leader (rank 0, on
`target.devices_of(0)[0]`) and the K - 1 followers are the real follower processes
(`dflash-ipc target --rank 0 --tp-rank k`, on the worker's other devices), started here with the
job's config and stopped at the end:

    with worker_followers(cfg) as group:   # None when K = 1
        capture = load_capture(cfg, device)   # this rank's shard
        ... group.announce(sample_ids, padded_len) before each forward ...

They meet through a file in a temporary directory (no port to pick). A follower that fails is a
`BenchError` with the tail of its log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

from dflash_ipc.config.schema import JobConfig
from dflash_ipc.errors import DFlashError
from dflash_ipc.run.logs import tail_lines
from dflash_ipc.run.child_env import SUPERVISOR_ENV

log = logging.getLogger(__name__)

EXIT_WAIT_S = 60.0  # after the leader's stop, how long a follower may take to exit


class FollowerError(DFlashError):
    """A follower process of the benchmarked worker failed (its log's tail is in the message)."""


def _tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(tail_lines(path, lines, max_bytes=6000))
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def worker_followers(cfg: JobConfig):
    """Yields this process's `WorkerGroup` as the leader of target worker 0, with its followers
    running; None (nothing started) when target.gpus_per_worker is 1."""
    k = cfg.target.gpus_per_worker
    if k == 1:
        yield None
        return
    from dflash_ipc.config.load import dump_config
    from dflash_ipc.target.worker_group import ADDRESS_ENV, WorkerGroup

    folder = tempfile.mkdtemp(prefix="dflash-bench-tp-")
    config = os.path.join(folder, "config.yaml")
    dump_config(cfg, config)
    # The followers die with this process as a supervisor's children do: the parent-death
    # signal, and their ParentWatch against this pid.
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               **{ADDRESS_ENV: f"file://{folder}/rendezvous", SUPERVISOR_ENV: str(os.getpid())})
    procs = []
    previous = os.environ.get(ADDRESS_ENV)
    clean = False
    try:
        for tp_rank in range(1, k):
            log_path = os.path.join(folder, f"follower-{tp_rank}.log")
            with open(log_path, "wb") as out:
                procs.append((subprocess.Popen(
                    [sys.executable, "-m", "dflash_ipc.cli", "target", "--config", config, "--rank", "0",
                     "--tp-rank", str(tp_rank)], env=env, stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True), log_path))
        log.info("worker of %d processes: this one leads on %s, followers pids %s", k, cfg.target.device_of(0),
                 [p.pid for p, _ in procs])
        os.environ[ADDRESS_ENV] = env[ADDRESS_ENV]
        group = WorkerGroup.join(cfg, 0, 0, cfg.target.device_of(0))
        try:
            yield group
            clean = True
        finally:
            group.close(clean)
    finally:
        if previous is None:
            os.environ.pop(ADDRESS_ENV, None)
        else:
            os.environ[ADDRESS_ENV] = previous
        failed = _reap(procs)
        if not failed:
            shutil.rmtree(folder, ignore_errors=True)
        elif clean:  # otherwise the leader's own error is what the caller sees
            raise FollowerError(failed)
        else:
            log.error("%s", failed)


def _reap(procs) -> str:
    """Waits for every follower, EXIT_WAIT_S in all (then SIGKILL); the failures, described, or ''."""
    failed, deadline = [], time.monotonic() + EXIT_WAIT_S
    for proc, log_path in procs:
        try:
            code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if code != 0:
            failed.append(f"follower pid {proc.pid} exited with code {code}; {log_path}:\n{_tail(log_path)}")
    return "\n".join(failed)
