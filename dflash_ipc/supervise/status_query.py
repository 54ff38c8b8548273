"""`dflash-ipc status RUN_DIR`: ask the running dispatcher for its live status, and list the
checkpoints that were written but never committed (set aside, never resumed from)."""

from __future__ import annotations

import json
import os

from dflash_ipc import protocol as p
from dflash_ipc.config_load import load_config
from dflash_ipc.drafter.checkpoint_store import UNCOMMITTED_NOTE, CheckpointStore
from dflash_ipc.errors import WorkerDeadError
from dflash_ipc.link import DispatcherLink
from dflash_ipc.run_files import RunFiles
from dflash_ipc.supervise.status_line import format_status


def fetch_status(run_dir: str, timeout_s: float = 3.0, *, node_rank: int = 0) -> dict:
    """The dispatcher's status dict; WorkerDeadError when no dispatcher answers. Any node's
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
    if not os.path.exists(RunFiles(run_dir).job_config):
        raise WorkerDeadError(f"{run_dir} is not a run directory (no config.yaml)")
    status = fetch_status(run_dir)
    uncommitted = CheckpointStore(RunFiles(run_dir).checkpoints).uncommitted()
    if as_json:
        return json.dumps({**status, "uncommitted_checkpoints": uncommitted}, indent=1, sort_keys=True)
    lines = [format_status(status)]
    for rank, t in status["targets"].items():
        lines.append(f"  target/{rank}: {t['batches']} batches {t['tokens']:,} tokens, credits {t['credits']}, "
                     f"free slots {t['free_slots']}, heartbeat {t['heartbeat_age_s']:.1f}s ago")
    for rank, d in status["drafters"].items():
        m = d["metrics"]
        lines.append(f"  drafter/{rank}: step {m.get('step', 0):.0f} loss {m.get('loss', float('nan')):.3f}, "
                     f"{d['batches']} batches, heartbeat {d['heartbeat_age_s']:.1f}s ago")
    lines += [f"  {UNCOMMITTED_NOTE}: {path}" for path in uncommitted]
    return "\n".join(lines)
