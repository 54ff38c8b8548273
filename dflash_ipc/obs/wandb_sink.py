"""Weights & Biases sink: the status scalars of every poll, as one W&B run per job.

    metrics:
      sinks: [tensorboard, wandb]
      wandb_project: qwen3-8b-drafters
      wandb_tags: [h200, 5+3]

The supervisor (node 0) opens the run and is its only writer; workers never import wandb. The
scalars and tags are `StatusScalars`' (metric_sinks.py), the same as TensorBoard's, plus
`train/step` (the drafters' optimizer step, in the rows where they report one), against which
W&B draws the `train/*`, `validation/*` and `drafter/*` charts; everything else is drawn against
the poll index (`_step`). `train/*` and `validation/*` come one row per optimizer step from the
drafter's step records (`write_step`, step_log.py), between the polls' rows. The run's
config is the job's resolved config; its files live in `RUN_DIR/wandb/` (offline runs stay
there: upload them with `wandb sync RUN_DIR/wandb/offline-run-*`).

Resume: `RUN_DIR/wandb_run.json` (`RunFiles.wandb_run`) holds the run id and the next history
step. A job started again in the same run directory opens the same run (`resume="allow"`) and
logs from that step on, so its history appends to the old one: in offline mode W&B itself
cannot know where the run stopped, and a step at or below one already logged would be dropped
when the run is synced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash_ipc.wire.status import JobStatus

import json
import logging
import os
import secrets
import string

from dflash_ipc.config.schema import JobConfig, config_to_dict
from dflash_ipc.errors import ConfigError, MissingExtraError
from dflash_ipc.obs.sinks import StatusScalars
from dflash_ipc.obs.step_log import step_scalars
from dflash_ipc.run.json_files import write_json_atomic

log = logging.getLogger(__name__)

STEP_KEY = "train/step"
STEP_CHARTS = ("train/*", "validation/*", "drafter/*")  # drawn against the optimizer step
ID_ALPHABET = string.ascii_lowercase + string.digits  # the ids made here
ID_CHARS = frozenset(string.ascii_letters + string.digits + "-_")  # the ids accepted (W&B's own too)
ID_LENGTH = 8


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise MissingExtraError("metrics.sinks names wandb but the wandb package is not installed: "
                          "pip install 'dflash-ipc[wandb]' (or remove wandb from metrics.sinks)") from None
    return wandb


def read_run_state(path: str) -> dict | None:
    """`{"id": str, "next_step": int}` of a job's W&B run, or None before its first run."""
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable W&B run record ({exc}); delete it to start a new W&B run") from None
    run_id, step = (state.get("id"), state.get("next_step")) if isinstance(state, dict) else (None, None)
    if not (isinstance(run_id, str) and run_id and set(run_id) <= ID_CHARS
            and isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise ConfigError(f"{path}: expected {{\"id\": letters/digits, \"next_step\": int >= 0}}, got {state!r}; "
                          f"delete it to start a new W&B run")
    return {"id": run_id, "next_step": step}


def write_run_state(path: str, run_id: str, next_step: int) -> None:
    write_json_atomic(path, {"id": run_id, "next_step": next_step}, indent=None)


class WandbSink:
    """Logs each status' scalars as one row of the job's W&B run (see the module doc)."""

    def __init__(self, run, state_path: str, next_step: int) -> None:
        self.run = run
        self.state_path = state_path
        self.next_step = next_step
        self.writes = 0
        self.scalars = StatusScalars()

    @classmethod
    def open(cls, cfg: JobConfig) -> WandbSink | None:
        """The job's run, resumed when the run directory names one. MissingExtraError when
        wandb is not installed (the config asks for it); None (one warning) when W&B refuses
        to start a run (no login, no network in online mode): training does not depend on a
        tracker."""
        wandb = _import_wandb()
        files, m = cfg.files, cfg.metrics
        state = read_run_state(files.wandb_run)
        run_id = state["id"] if state else "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))
        os.makedirs(files.run_dir, exist_ok=True)
        try:
            run = wandb.init(project=m.wandb_project, entity=m.wandb_entity or None,
                             name=m.wandb_run_name or os.path.basename(files.run_dir), tags=list(m.wandb_tags),
                             mode=m.wandb_mode, dir=files.run_dir, id=run_id, resume="allow",
                             config=config_to_dict(cfg))
        except Exception as exc:  # wandb raises its own types (UsageError, CommError, ...)
            log.warning("W&B logging off: wandb.init failed: %s", exc)
            return None
        run.define_metric(STEP_KEY)
        for pattern in STEP_CHARTS:
            run.define_metric(pattern, step_metric=STEP_KEY)
        # Online, W&B knows where a resumed run stopped (run.step); offline only our record does.
        next_step = max(state["next_step"] if state else 0, int(run.step or 0))
        write_run_state(files.wandb_run, run_id, next_step)  # a kill before the first write still resumes
        log.info("W&B run %s (%s, %s)%s", run_id, m.wandb_project, run.settings.mode,
                 f", resumed at history step {next_step}" if state else "")
        return cls(run, files.wandb_run, next_step)

    def write(self, status: JobStatus) -> None:
        """One history row: every scalar of the status, and `train/step` when a drafter reported
        its step (a resumed job's first polls, before its drafters register, have none)."""
        step, _, scalars = self.scalars(status)
        if self.scalars.step_reported:
            scalars[STEP_KEY] = step
        self.run.log(scalars, step=self.next_step)
        self.next_step += 1
        self.writes += 1
        write_run_state(self.state_path, self.run.id, self.next_step)

    def write_step(self, record: dict) -> None:
        """One history row per drafter step record (and one for its validation scores), with
        `train/step` the step they belong to (step_log.py)."""
        for step, _, scalars in step_scalars(record):
            self.run.log({**scalars, STEP_KEY: step}, step=self.next_step)
            self.next_step += 1
        write_run_state(self.state_path, self.run.id, self.next_step)

    def close(self) -> None:
        self.run.finish()
