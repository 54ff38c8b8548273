"""What the end of a finished job prints: where its checkpoint is, and the commands that come
next (evaluate it, export it), with the job's real paths so they can be pasted as they are."""

from __future__ import annotations

import os
import shlex

from dflash_ipc.run.checkpoints import CheckpointStore


def next_steps(cfg) -> list[str]:
    """Lines for the end of a job that exited 0: its newest committed checkpoint, an eval on the
    prepared dataset's held-out prompts (saved into the run directory for report and export),
    and an export beside the run. No checkpoint: one line saying so."""
    checkpoints = cfg.files.checkpoints
    step_dir = CheckpointStore(checkpoints).latest()
    if step_dir is None:
        return [f"no committed checkpoint in {checkpoints}"]
    run_dir = cfg.run.run_dir
    export_dir = os.path.join(run_dir, "export")
    q = shlex.quote
    return [f"checkpoint: {step_dir}",
            "next:",
            f"  dflash-ipc eval --target {q(cfg.target.path)} --drafter {q(step_dir)} --data {q(cfg.data.path)} "
            f"--save-to {q(run_dir)}",
            f"  dflash-ipc report {q(run_dir)}",
            f"  dflash-ipc export {q(step_dir)} {q(export_dir)}"]


def stopped_lines(cfg) -> list[str]:
    """Lines for the end of a job stopped by Ctrl-C or SIGTERM: where it stands and how to go
    on (the run directory resumes from its newest committed checkpoint)."""
    step_dir = CheckpointStore(cfg.files.checkpoints).latest()
    where = f"checkpoint: {step_dir}" if step_dir is not None else f"no committed checkpoint in {cfg.files.checkpoints}"
    return [f"stopped; {where}", f"resume: rerun the same command (run.run_dir={shlex.quote(cfg.run.run_dir)} "
            "continues from its newest checkpoint)"]
