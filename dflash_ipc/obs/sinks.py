"""Metric sinks fed from the dispatcher's status (`Dispatcher.status()`, a `JobStatus`).

`StatusScalars` turns each status the supervisor polls into one set of named scalars;
`TensorBoardSink` writes them to `<run_dir>/tensorboard/` when the `tensorboard` package is
installed (`pip install tensorboard`; view with `tensorboard --logdir RUN_DIR/tensorboard`),
`WandbSink` (wandb_sink.py) to a Weights & Biases run. `open_sinks(cfg)` (job_sinks.py) builds
the sinks a job's `metrics` section names, plus the status history that `dflash-ipc report`
reads; the supervisor is their only writer.

Tags written (the per-worker ones only when the worker's heartbeats carry their inputs):

  rates/{tgt_rate,dft_rate,tok_rate}       the status rates (tokens/s, token_rate.py)
  batches/{pending,leased,...,committed}   batch counts by ledger state
  progress/committed_fraction              committed batches / planned batches
  progress/trained_fraction                trained tokens / planned tokens (what the progress line shows)
  progress/epoch                           1-based index of the first epoch not fully committed
  tokens/{produced,consumed,trained,committed}  cumulative token counters
  queue/produced_waiting                   produced batches not yet handed to a drafter
  health/{refusals,dropped_targets,targets,drafters}
  target/<rank>/busy_fraction              d(busy_s) / d(busy_s + wait_s) since the last write
  target/<rank>/tokens_per_s               d(tokens) / d(busy_s + wait_s) since the last write
  target/<rank>/{credits,free_slots,heartbeat_age_s}
  drafter/<rank>/<metric>                  every numeric metric the drafter reports (loss, lr,
                                           grad_norm, anchors, step_s, fifo, ...)
  drafter/<rank>/wait_fraction             d(wait_s) / d(time) since the last write
  drafter/<rank>/tokens_per_s              d(trained_tokens) / d(time) since the last write
  {target,drafter}/<rank>/{rss_mib,gpu_mem_allocated_mib,gpu_mem_reserved_mib}  when reported

Per optimizer step, not per poll (`write_step`, from the drafter's step records: step_log.py):
`train/{loss,lr,grad_norm,anchors,tokens,step_s}` and `validation/*`.

The x axis (global step) is the drafters' mean optimizer step; before the first step (and while
no drafter reports one) the last step written is reused, so the axis never goes backwards. Wall
time is the job's own clock: the wall time of the first write minus its `elapsed_s`, plus each
status' `elapsed_s`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import os
import time

from dflash_ipc.obs.step_log import step_scalars
from dflash_ipc.run.json_files import as_number
from dflash_ipc.wire.status import DrafterStatus, JobStatus, TargetStatus

log = logging.getLogger(__name__)

MEMORY_METRICS = ("rss_mib", "gpu_mem_allocated_mib", "gpu_mem_reserved_mib")
FLUSH_S = 10  # SummaryWriter's flush period (its default, 120 s, leaves TensorBoard far behind)
# drafter metrics that are no curves: the rank, the host clock
DRAFTER_SKIPPED = frozenset({"rank", "time"})


def _summary_writer_class():
    """torch's SummaryWriter; ImportError when the tensorboard package is missing."""
    importlib.import_module("tensorboard")  # torch.utils.tensorboard needs it; fail early and clearly
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter


class StatusScalars:
    """`scalars(status)` -> (step, wall time, {tag: value}) of one status (see the module doc).

    Stateful: the step never goes backwards, and per-worker rates come from the differences of
    cumulative counters since the previous status. `step_reported`: the last status carried a
    drafter step (else its step is the previous one, or 0 before any)."""

    def __init__(self) -> None:
        self._step = 0
        self.step_reported = False
        self._wall0: float | None = None
        # last cumulative counters per worker: key -> (pid or None, {name: value})
        self._last: dict[str, tuple[object, dict]] = {}

    def __call__(self, status: JobStatus) -> tuple[int, float, dict[str, float]]:
        elapsed = status.elapsed_s
        if self._wall0 is None:
            self._wall0 = time.time() - elapsed
        wall = self._wall0 + elapsed
        step = self._global_step(status)
        scalars: dict[str, float] = {}
        self._job_scalars(status, scalars)
        self._target_scalars(status.targets, scalars)
        self._drafter_scalars(status.drafters, scalars)
        return step, wall, scalars

    # ---- pieces -------------------------------------------------------------------------

    def _global_step(self, status: JobStatus) -> int:
        steps = [v for d in status.drafters.values()
                 if (v := as_number(d.metrics.get("step"))) is not None and math.isfinite(v)]
        self.step_reported = bool(steps)
        if steps:
            self._step = max(self._step, int(round(sum(steps) / len(steps))))
        return self._step

    @staticmethod
    def _job_scalars(status: JobStatus, out: dict) -> None:
        out["time/elapsed_s"] = status.elapsed_s
        for group in ("rates", "batches", "tokens"):
            values = getattr(status, group)
            for f in dataclasses.fields(values):
                out[f"{group}/{f.name}"] = float(getattr(values, f.name))
        if status.num_batches:
            out["progress/committed_fraction"] = status.batches.committed / status.num_batches
        if status.tokens.total:
            out["progress/trained_fraction"] = min(1.0, status.tokens.trained / status.tokens.total)
        epochs = status.epochs
        if epochs:
            current = next((i for i, e in enumerate(epochs) if e.committed < e.batches), len(epochs) - 1)
            out["progress/epoch"] = float(current + 1)
        out["queue/produced_waiting"] = float(status.produced_waiting)
        out["health/refusals"] = float(status.refusals)
        out["health/dropped_targets"] = float(len(status.dropped_targets))
        out["health/targets"] = float(len(status.targets))
        out["health/drafters"] = float(len(status.drafters))

    def _deltas(self, key: str, pid, current: dict) -> dict | None:
        """Differences of cumulative counters since this worker's previous write; None on its
        first write or when a counter went backwards (a new process)."""
        previous = self._last.get(key)
        self._last[key] = (pid, current)
        if previous is None or previous[0] != pid:
            return None
        delta = {name: current[name] - previous[1][name] for name in current if name in previous[1]}
        if any(d < 0 for d in delta.values()):
            return None
        return delta

    def _target_scalars(self, targets: dict[str, TargetStatus], out: dict) -> None:
        for rank, t in targets.items():
            prefix = f"target/{rank}"
            out[f"{prefix}/credits"] = float(t.credits)
            out[f"{prefix}/free_slots"] = float(t.free_slots)
            out[f"{prefix}/heartbeat_age_s"] = t.heartbeat_age_s
            metrics = t.metrics
            _memory(metrics, prefix, out)
            counters = {n: v for n in ("busy_s", "wait_s", "tokens") if (v := as_number(metrics.get(n))) is not None}
            if "busy_s" not in counters:
                continue  # registered, no heartbeat with metrics yet
            delta = self._deltas(f"target/{rank}", t.pid, counters)
            span = (delta or {}).get("busy_s", 0.0) + (delta or {}).get("wait_s", 0.0)
            if delta is None or span <= 0:
                continue  # first sight, a new process, or no heartbeat since the last write
            out[f"{prefix}/busy_fraction"] = delta["busy_s"] / span
            if "tokens" in delta:
                out[f"{prefix}/tokens_per_s"] = delta["tokens"] / span

    def _drafter_scalars(self, drafters: dict[str, DrafterStatus], out: dict) -> None:
        for rank, d in drafters.items():
            prefix = f"drafter/{rank}"
            out[f"{prefix}/credits"] = float(d.credits)
            out[f"{prefix}/heartbeat_age_s"] = d.heartbeat_age_s
            metrics = d.metrics
            for name, value in metrics.items():
                if name not in DRAFTER_SKIPPED and (v := as_number(value)) is not None:
                    out[f"{prefix}/{name}"] = v
            counters = {n: v for n in ("time", "wait_s", "trained_tokens")
                        if (v := as_number(metrics.get(n))) is not None}
            if "time" not in counters:
                continue
            # a restarted drafter restarts its counters: the backwards check in _deltas catches it
            delta = self._deltas(f"drafter/{rank}", None, counters)
            if delta is None or delta["time"] <= 0:
                continue
            if "wait_s" in delta:
                out[f"{prefix}/wait_fraction"] = min(1.0, delta["wait_s"] / delta["time"])
            if "trained_tokens" in delta:
                out[f"{prefix}/tokens_per_s"] = delta["trained_tokens"] / delta["time"]


def _memory(metrics: dict, prefix: str, out: dict) -> None:
    for name in MEMORY_METRICS:
        if (v := as_number(metrics.get(name))) is not None:
            out[f"{prefix}/{name}"] = v


class TensorBoardSink:
    """Scalars from each status dict, into `<run_dir>/tensorboard/` (see the module doc)."""

    def __init__(self, writer, log_dir: str):
        self.writer = writer
        self.log_dir = log_dir
        self.writes = 0
        self.scalars = StatusScalars()

    @classmethod
    def open(cls, log_dir: str) -> TensorBoardSink | None:
        """A sink writing to `log_dir` (the run's `tensorboard/`), or None (one info line) when the
        tensorboard package is not installed or cannot be imported."""
        try:
            writer_class = _summary_writer_class()
        except ImportError:
            log.info("TensorBoard logging off: the tensorboard package is not installed "
                     "(pip install tensorboard, or pip install 'dflash-ipc[test]')")
            return None
        except Exception as exc:  # a broken install (e.g. a protobuf mismatch) must not stop training
            log.warning("TensorBoard logging off: importing tensorboard failed: %s", exc)
            return None
        os.makedirs(log_dir, exist_ok=True)
        return cls(writer_class(log_dir=log_dir, flush_secs=FLUSH_S), log_dir)

    def write(self, status: JobStatus) -> None:
        """Write the scalars of one status."""
        self.writes += 1
        step, wall, scalars = self.scalars(status)
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=wall)

    def write_step(self, record: dict) -> None:
        """The scalars of one drafter step record at their own steps (step_log.py)."""
        for step, wall, scalars in step_scalars(record):
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, global_step=step, walltime=wall)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def __enter__(self) -> TensorBoardSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MetricSinks:
    """The sinks of one job, written together from each status. A sink whose write raises is
    closed and dropped with one warning: a tracker must not stop training."""

    def __init__(self, sinks: list) -> None:
        self.sinks = list(sinks)
        self.skipped_steps = 0  # step records a sink's write_step refused
        self._warned_steps: set[int] = set()  # id() of the sinks warned about a skipped step record

    def write(self, status: JobStatus) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(status)
            except Exception as exc:
                log.warning("%s off: a write failed: %s", type(sink).__name__, exc)
                self.sinks.remove(sink)
                _close_quietly(sink)

    def write_steps(self, records: list[dict]) -> None:
        """The drafter's step records since the last call, to each sink that takes them. A
        record a sink refuses is skipped (one warning per sink), never turning the sink off:
        the record came from a file, and a sink that is really dead fails `write` too."""
        for sink in list(self.sinks):
            if not records or not hasattr(sink, "write_step"):
                continue
            for record in records:
                try:
                    sink.write_step(record)
                except Exception as exc:
                    self.skipped_steps += 1
                    if id(sink) not in self._warned_steps:
                        self._warned_steps.add(id(sink))
                        log.warning("%s: a step record was skipped, its write failed: %s", type(sink).__name__, exc)

    def close(self) -> None:
        for sink in self.sinks:
            _close_quietly(sink)
        self.sinks = []


def _close_quietly(sink) -> None:
    try:
        sink.close()
    except Exception as exc:
        log.warning("%s: closing failed: %s", type(sink).__name__, exc)
