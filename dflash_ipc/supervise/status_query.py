"""`dflash-ipc status RUN_DIR`: ask the running dispatcher for its live status (of a job whose
dispatcher has ended, the last status it wrote: final_status.json), and list the checkpoints
that were written but never committed (set aside, never resumed from)."""

from __future__ import annotations

import json
import os

from dflash_ipc.wire import protocol as p
from dflash_ipc.config.load import load_config
from dflash_ipc.run.checkpoints import UNCOMMITTED_NOTE, CheckpointStore
from dflash_ipc.errors import DataError, WorkerDeadError
from dflash_ipc.wire.link import DispatcherLink
from dflash_ipc.wire.status import JobStatus, read_status_file
from dflash_ipc.run.files import RunFiles
from dflash_ipc.obs.status_line import format_status


def fetch_status(run_dir: str, timeout_s: float = 3.0, *, node_rank: int = 0) -> JobStatus:
    """The dispatcher's status; WorkerDeadError when no dispatcher answers. Any node's
    config names the job's one dispatcher."""
    cfg = load_config(RunFiles(run_dir, node_rank).config)
    link = DispatcherLink.for_job(cfg, "observer/status", heartbeat_interval_s=3600, timeout_s=timeout_s)
    try:
        reply = link.request(p.StatusRequest(), timeout_s=timeout_s)
    finally:
        link.close()
    if not isinstance(reply, p.StatusReply):
        raise WorkerDeadError(f"unexpected reply {reply.KIND.name} from the dispatcher")
    return reply.status


def query_status(run_dir: str, *, as_json: bool = False) -> str:
    files = RunFiles(run_dir)
    if not os.path.exists(files.job_config):
        raise WorkerDeadError(f"{run_dir} is not a run directory (no config.yaml)")
    try:
        status, heading = fetch_status(run_dir), None
    except WorkerDeadError as live_error:
        if not os.path.exists(files.final_status):
            raise
        try:
            status = read_status_file(files.final_status)
        except DataError as exc:
            raise DataError(f"no dispatcher answers ({live_error}), and its final status is unreadable: {exc}; "
                            f"the job has ended (its checkpoints are in {files.checkpoints}): restore the file "
                            "from a backup, or remove it (a dispatcher of this run rewrites it when it ends)") \
                from None
        heading = f"no dispatcher answers ({live_error}); the job's final status, {files.final_status}:"
    listing_error = None
    try:
        uncommitted = CheckpointStore(files.checkpoints).uncommitted()
    except OSError as exc:  # the folder is there but cannot be listed: say so, show the rest
        uncommitted, listing_error = [], f"cannot list the checkpoints set aside: {exc}"
    if as_json:
        extra = {"uncommitted_checkpoints": uncommitted}
        if listing_error:
            extra["uncommitted_checkpoints_error"] = listing_error
        return json.dumps({**status.to_json(), **extra}, indent=1, sort_keys=True,
                          allow_nan=False)  # strict JSON: no NaN (to_json writes them as null)
    lines = ([heading] if heading else []) + [format_status(status, final=heading is not None)]
    for rank, t in status.targets.items():
        lines.append(f"  target/{rank}: {t.batches} batches {t.tokens:,} tokens, credits {t.credits}, "
                     f"free slots {t.free_slots}, heartbeat {t.heartbeat_age_s:.1f}s ago")
    for rank, d in status.drafters.items():
        m = d.metrics
        lines.append(f"  drafter/{rank}: step {_number(m.get('step'), 0):.0f} loss {_number(m.get('loss')):.3f}, "
                     f"{d.batches} batches, heartbeat {d.heartbeat_age_s:.1f}s ago")
    lines += [f"  {UNCOMMITTED_NOTE}: {path}" for path in uncommitted]
    lines += [f"  ({listing_error})"] if listing_error else []
    return "\n".join(lines)


def _number(value: float | None, default: float = float("nan")) -> float:
    """A metric as a number: the final status writes a NaN as null (strict JSON)."""
    return default if value is None else value
