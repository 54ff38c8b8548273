"""One drafter rank's loop, apart from its sockets and collectives (both are injected).

`DrafterLoop.pass_once()` is one pass, numbered as it runs:
  1) intake: every waiting message; each `Assign` is copied out of its slot and queued
     (`Consumed`), or reported `Lost` when its target died first;
  2) request more: `WantHidden` while the queue is short;
  3) agree with the group (one small all-reduce): is every rank full (or holding its last
     sequences after `EndOfData`), is everyone drained, must the group stop, has a full rank
     waited `drafter.max_group_wait_s` for a short one?
  4) step together when all are full; every `checkpoint.every_steps`, checkpoint: the ranks
     gather which samples of which copies went through a step since the last commit, rank 0
     writes the checkpoint and sends one `Committed` for the group (a commit is all of a
     checkpoint's samples or none), then marks it `latest` when `CommitDone` comes back
     (`confirmed`: the one writer of latest.json; the ledger owns which steps are committed).
Before the first pass `resume()` loads the newest intact committed checkpoint (none: a fresh
job, started from `drafter.init_from`'s weights when set) and tells the dispatcher which one
(`Resumed`); after the last, `finish()` checkpoints what is left and
waits for `Shutdown`. A stop (SIGTERM/SIGINT on any rank, or `Shutdown` before the end of
the data) travels in step 3, so all ranks leave together after a closing checkpoint.
Tests drive it with a fake link and `SoloGroup` (tests/test_drafter_loop.py).
"""

from __future__ import annotations

import json
import os
import logging
import math
import signal
import time
from dataclasses import dataclass
from typing import Callable

from dflash_ipc.wire import protocol as p
from dflash_ipc.run.checkpoints import CheckpointStore
from dflash_ipc.drafter.launched_step import LaunchedStep
from dflash_ipc.drafter.sequence_queue import SequenceQueue
from dflash_ipc.errors import DataError, TransportError, WorkerDeadError
from dflash_ipc.run.json_files import json_safe, read_json_object, write_json_atomic
from dflash_ipc.obs.timelines import process_memory

log = logging.getLogger(__name__)

BEST_DECODED = "best_decoded.json"
"""Beside the checkpoints: the best by held-out decoding so far (validation.prompts)."""

COMMIT_CONFIRM_S = 5.0  # on a stop, how long rank 0 waits for the dispatcher to take its commit
RESUME_CONFIRM_S = 60.0


class StopRequested(SystemExit):
    """The group left together on a stop; the exit code says "not the end of the job"."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


class DrafterLoop:
    def __init__(self, cfg, rank: int, *, trainer, queue: SequenceQueue, readers, link, group,
                 store: CheckpointStore, beacon=None, timeline=None, step_log=None,
                 after_step: Callable[[], None] | None = None,
                 validator: Callable[[str], dict] | None = None, pipelined: bool | None = None) -> None:
        """`after_step` runs after each optimizer step, inside its timed interval (the fault
        tests slow steps down with it: drafter/faults.py). `validator` (rank 0, with
        validation.prompts > 0): a checkpoint's step directory -> {"tau", "prompts", ...} on
        held-out prompts (eval/held_out_validation.py); the best checkpoint is then the best by it.
        `pipelined` (default: on a CUDA trainer) publishes each step's figures after the next
        step is queued (`step`)."""
        self.cfg, self.rank = cfg, rank
        self.trainer, self.queue, self.readers = trainer, queue, readers
        self.link, self.group, self.store = link, group, store
        self.beacon, self.timeline, self.step_log = beacon, timeline, step_log
        self.outstanding = 0          # WantHidden credits not yet answered by an Assign
        self.end_of_data = self.shutdown = False
        self.waiting_since: float | None = None  # the group could not step since then
        self.stop_reason: str | None = None  # set by a signal handler, or a Shutdown too early
        self.resumed_from = -1
        self.last_checkpoint_step = trainer.step_count
        self.best: tuple[int, float] | None = None  # (step, acceptance length) of the best checkpoint so far
        self.compiled = False
        self.wait_s = 0.0
        # Transport cost, cumulative: wall time inside reads, the copies' own time (GPU-timed
        # on cuda_ipc), bytes read; read_s - copy_s is handoff overhead, not bandwidth.
        self.read_s = self.copy_s = 0.0
        self.read_bytes = self.reads = 0
        self.after_step = after_step
        self.validator = validator
        self.pipelined = trainer.device.type == "cuda" if pipelined is None else pipelined
        self.pending: _PendingStep | None = None  # launched, its figures not yet published

    # --- 0) resume ---------------------------------------------------------------------------

    def resume(self, registered: p.Registered) -> int:
        """Loads the newest intact committed checkpoint at or before the ledger's last commit
        (all ranks the same one) and has the dispatcher confirm it; returns its step (-1: none)."""
        self._phase("resume")
        step = -1
        if self.rank == 0:
            committed = [s for s in registered.committed_steps if s <= registered.resume_step]
            self.store.quarantine_after(registered.resume_step if registered.resume_step >= 0 else None)
            step = self.store.newest_intact(committed) if committed else -1
            if committed and step != registered.resume_step:
                log.error("resuming from step %d: the checkpoint of the last commit (step %d) is damaged; the "
                          "dispatcher returns what was committed after step %d to pending", step,
                          registered.resume_step, step)
        step = self.group.broadcast_int(step)
        init_from = self.cfg.drafter.init_from
        if step >= 0:
            self.best = self._best_decoded(_best_of(self.trainer.resume(self.store, step)), step)
            self.last_checkpoint_step = step
            if init_from and self.rank == 0:
                log.info("drafter.init_from=%s ignored: the job resumes from its checkpoint of step %d", init_from,
                         step)
        elif init_from:
            self.trainer.warm_start(init_from)  # every rank: identical weights, as after the seeded init
        if self.rank == 0:
            self.link.send(p.Resumed(step=step))
            deadline = time.monotonic() + RESUME_CONFIRM_S
            while not isinstance(reply := self.link.recv(max(0.0, deadline - time.monotonic())), p.Resumed):
                if reply is None:
                    raise WorkerDeadError(f"drafter/0: the dispatcher did not confirm resuming from step {step} "
                                          f"within {RESUME_CONFIRM_S:.0f}s")
                self._handle(reply)
            self.confirmed(step)
        self.group.agree([0.0])  # nobody asks for work before the dispatcher knows the step
        self.resumed_from = step
        return step

    # --- one pass ----------------------------------------------------------------------------

    def pass_once(self) -> bool:
        """One pass of steps 1-4; False once the whole group is drained."""
        waited = time.perf_counter()
        self._phase("wait")
        self.intake(0.0 if self.full or self.end_of_data else 0.02)   # 1
        self.request_more()                                           # 2
        full, drained, stop, impatient = self.agree()                 # 3
        if stop:
            self.stop_together()
        if drained == self.group.world:
            return False
        # Lockstep: every rank full (or drained). A full rank that has waited long enough for
        # a short one steps with it anyway (the short rank gives what it has): a rank whose node
        # has no hidden states left never holds the group, and nobody has to hoard batches.
        if full + drained < self.group.world and not (full and impatient):
            self.waiting_since = self.waiting_since or time.monotonic()
            self.wait_s += time.perf_counter() - waited
            if self.timeline is not None:
                self.timeline.record("wait_hidden", waited, time.perf_counter())
            return True
        self.waiting_since = None
        self.step()                                                   # 4
        if self.trainer.step_count % self.cfg.checkpoint.every_steps == 0:
            self.checkpoint()
        return True

    @property
    def full(self) -> bool:
        return self.queue.anchors >= self.cfg.objective.anchors_per_step

    def intake(self, timeout_s: float) -> None:
        msg = self.link.recv(timeout_s)
        while msg is not None and not self.shutdown:
            self._handle(msg)
            msg = None if self.shutdown else self.link.recv(0.0)
        if self.shutdown and not self.end_of_data and self.stop_reason is None:
            self.stop_reason = "Shutdown before the end of data"

    def _handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.Assign):
            self.outstanding -= 1  # the credit is spent whether or not the copy succeeds
            self.accept(msg)
        elif isinstance(msg, p.EndOfData):
            self.end_of_data = True
        elif isinstance(msg, p.CommitDone):
            if self.rank == 0:
                self.confirmed(msg.step)
        elif isinstance(msg, p.Shutdown):
            self.shutdown = True
        else:
            log.warning("drafter/%d: ignored unexpected %s", self.rank, msg.KIND.name)

    def confirmed(self, step: int) -> None:
        """Rank 0: the dispatcher confirmed `step` as the ledger's last commit (`CommitDone`,
        or `Resumed`; -1: none), so latest.json names it. The only writer of latest.json. Then
        retention (`checkpoint.keep_last`, the best by validation kept) deletes what no resume
        needs: only once the commit is durable."""
        self.store.mark_latest(step if step >= 0 else None)
        if step >= 0:
            self.store.retain(step, keep_last=self.cfg.checkpoint.keep_last, best_step=self.best_step)

    def accept(self, msg: p.Assign) -> None:
        """Copies an assigned slot into local memory and queues its sequences; a copy that
        fails (its target died first) is reported `Lost`, and the batch goes back to pending."""
        try:
            reader = self.readers.get(msg.pool)
            started = time.perf_counter()
            features = reader.read(msg.slot, msg.num_tokens)  # [T, F] local copy
        except TransportError as exc:
            log.warning("drafter/%d: batch %d lost with its producer target/%d: %s", self.rank, msg.batch_id,
                        msg.target, exc)
            self.readers.drop(str(msg.pool.get("pool_id", "")))
            self.link.send(p.Lost(batch_id=msg.batch_id, attempt=msg.attempt, reason=p.cut_reason(str(exc))))
            return
        self.read_s += time.perf_counter() - started
        self.copy_s += reader.last_copy_s or 0.0
        self.read_bytes += features.numel() * features.element_size()
        self.reads += 1
        self.queue.add_copy(msg.batch_id, msg.attempt, msg.epoch, msg.sample_ids, features)
        self.link.send(p.Consumed(batch_id=msg.batch_id, attempt=msg.attempt))

    def request_more(self) -> None:
        """Asks while below the queue cap, or short of a step's anchors whatever the cap (a
        queue full of short sequences must not wait for ever in lockstep). The queue is bounded:
        a rank that waits for a short one steps after `drafter.max_group_wait_s` instead."""
        if self.end_of_data:
            return
        if len(self.queue) < self.cfg.drafter.fifo_sequences or not self.full:
            want = self.cfg.drafter.prefetch - self.outstanding
            if want > 0:
                self.link.send(p.WantHidden(credits=want))
                self.outstanding += want

    def agree(self) -> tuple[float, float, float, float]:
        """(ranks full, ranks drained, ranks that must stop, ranks that waited past
        `drafter.max_group_wait_s`), summed over the group: every rank decides alike."""
        drained = self.end_of_data and not len(self.queue)
        full = self.full or (self.end_of_data and bool(len(self.queue)))
        impatient = (self.waiting_since is not None
                     and time.monotonic() - self.waiting_since > self.cfg.drafter.max_group_wait_s)
        return tuple(self.group.agree([float(full), float(drained), float(self.stop_reason is not None),
                                       float(impatient)]))

    # --- 4) step and checkpoint --------------------------------------------------------------

    def step(self) -> None:
        """One collective optimizer step over this rank's share of a step's anchors. Pipelined
        (a CUDA trainer), the step is queued and the previous one's figures are published
        after it: the host builds step N+1 while the GPU runs step N (drafter/launched_step.py)."""
        started = time.perf_counter()
        self._phase("step" if self.compiled else "compile", self.trainer.step_count)
        before = (self.queue.anchors, self.queue.trained_tokens)
        chosen = self.queue.take(self.cfg.objective.anchors_per_step)
        every = self.cfg.validation.every_steps
        validated = self.trainer.step_count  # the proxy scores the weights before this step
        try:
            launched = self.trainer.launch(chosen, validate=bool(every) and validated % every == 0)
        except BaseException:
            self.flush_step()  # the step before it finished (or failed on its own): its record is kept
            raise
        self.queue.record_trained(chosen)
        if self.after_step is not None:
            self.after_step()
        self.compiled = True
        ended = time.perf_counter()
        previous, self.pending = self.pending, _PendingStep(
            launched, started, ended, validated, sequences=len(chosen), anchors=before[0] - self.queue.anchors,
            tokens=self.queue.trained_tokens - before[1])
        if previous is not None:
            self.publish(previous)
        if not self.pipelined:
            self.flush_step()

    def flush_step(self) -> None:
        """Publishes the step still in flight, if any: before a checkpoint and at the end, so the
        step log and metrics are complete where a checkpoint commits."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.publish(pending)

    def publish(self, pending: "_PendingStep") -> None:
        """A finished step's figures: the timeline, validation, heartbeat metrics, step log."""
        stats = dict(pending.launched.result())  # waits for that step's device work only
        if self.timeline is not None:
            self.timeline.record("step", pending.started, pending.ended, loss=float(stats["loss"]),
                                 sequences=pending.sequences, anchors=pending.anchors, tokens=pending.tokens)
        if "acceptance_length" in stats:
            stats["validated_step"] = pending.validated
            self.validated(pending.validated, stats)
        stats.update(wait_s=self.wait_s, fifo=len(self.queue), rank=self.rank, time=time.time(),
                     trained_tokens=self.queue.trained_tokens, read_s=self.read_s, copy_s=self.copy_s,
                     read_bytes=self.read_bytes, reads=self.reads, resumed_from=self.resumed_from)
        # Finite values only: the dispatcher refuses a heartbeat with an inf (a diverged loss).
        # A value that is not finite now is dropped, so no stale finite one goes on being sent.
        for k, v in stats.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.link.metrics[k] = float(v)
            elif isinstance(v, (int, float)):
                self.link.metrics.pop(k, None)
        self.link.metrics.update(process_memory(self.trainer.device))
        if self.step_log is not None:
            self.step_log.write(json.dumps(json_safe(stats), allow_nan=False) + "\n")
            self.step_log.flush()

    def validated(self, step: int, stats: dict) -> None:
        """The acceptance proxy of the weights of `step`: logged (rank 0), and the best kept when
        a checkpoint holds those weights (retention never deletes it)."""
        value = stats["acceptance_length"]
        if not math.isfinite(value):
            return
        if self.validator is None and step == self.last_checkpoint_step and step > 0 and \
                (self.best is None or value > self.best[1]):
            self.best = (step, value)
        if self.rank == 0:
            best = f"; best {self.best[1]:.3f} at checkpoint {self.best[0]}" if self.best else ""
            log.info("validation at step %d: expected acceptance length %.3f over %d blocks (scored before "
                     "training on them)%s", step, value, stats["acceptance_blocks"], best)

    def validate_held_out(self, step: int, path: str) -> None:
        """Rank 0: tau of checkpoint `step` on the held-out prompts; logged, sent to the trackers
        (the step log), and the best checkpoint by it kept. The checkpoint was written first, so
        the `best` its own file records is the best before it."""
        self._phase("checkpoint", step)
        result = self.validator(path)
        tau = result["tau"]
        if math.isfinite(tau) and (self.best is None or tau > self.best[1]):
            self.best = (step, tau)
            # The checkpoint was written before it was decoded: a resume learns of it here.
            write_json_atomic(os.path.join(self.store.root, BEST_DECODED),
                              {"best": {"step": step, "acceptance_length": tau}})
        best = f"; best {self.best[1]:.3f} at checkpoint {self.best[0]}" if self.best else ""
        log.info("validation at checkpoint %d: tau %.3f on %d held-out prompts, %d tokens, %.1f s%s", step, tau,
                 result["prompts"], result["tokens"], result["seconds"], best)
        if math.isfinite(tau):
            self.link.metrics["held_out_tau"] = float(tau)
        if self.step_log is not None:
            record = {"step": step, "validated_step": step, "held_out_tau": tau, "held_out_prompts": result["prompts"],
                      "time": time.time()}
            self.step_log.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
            self.step_log.flush()

    def _best_decoded(self, recorded: tuple[int, float] | None, step: int) -> tuple[int, float] | None:
        """The best a resume of checkpoint `step` keeps: the one it records, or the best by
        held-out decoding written beside the checkpoints since (validation.prompts), when that
        one is a checkpoint at or before `step` still on disk. An unreadable file is ignored."""
        if self.validator is None:
            return recorded
        try:
            decoded = _best_of(read_json_object(os.path.join(self.store.root, BEST_DECODED), "best checkpoint"))
        except DataError:
            return recorded
        if decoded is None or decoded[0] > step or decoded[0] not in self.store.steps_on_disk():
            return recorded
        return decoded if recorded is None or decoded[1] >= recorded[1] else recorded

    @property
    def best_step(self) -> int | None:
        return self.best[0] if self.best else None

    def checkpoint(self) -> None:
        """Collective: rank 0 writes the checkpoint, then commits what every rank trained
        since the last commit, sample by sample, in one `Committed`."""
        self.flush_step()
        self._phase("checkpoint", self.trainer.step_count)
        rows = [(t.batch_id, t.attempt, s) for t in self.queue.take_trained() for s in t.sample_ids]
        per_rank = self.group.gather_rows(rows, 3)
        self.last_checkpoint_step = self.trainer.step_count
        self.trainer.prepare_checkpoint()  # every rank: a sharded model's state is gathered on rank 0
        if self.rank != 0:
            return
        trained = _by_copy(per_rank)
        # What the checkpoint commits is the ledger's to keep (the Committed below); the
        # checkpoint notes where this run resumed from, for a reader of the file, and the best
        # checkpoint by validation so far, which a resume keeps (retention never deletes it).
        extra = {"resumed_from": self.resumed_from}
        if self.best is not None:
            extra["best"] = {"step": self.best[0], "acceptance_length": self.best[1]}
        path = self.trainer.save_checkpoint(self.store, extra)
        log.info("checkpoint %s: %d copies, %d samples committed", path, len(trained),
                 sum(len(s) for s in trained.values()))
        self.link.send(p.Committed(step=self.trainer.step_count, batch_ids=[b for b, _, _ in trained],
                                   ranks=[r for _, r, _ in trained], attempts=[a for _, _, a in trained],
                                   samples=[list(s) for s in trained.values()]))
        every = self.cfg.validation.every_steps  # after the commit is on its way: decoding takes a while
        if self.validator is not None and every and self.trainer.step_count % every == 0:
            self.validate_held_out(self.trainer.step_count, path)

    # --- the end -----------------------------------------------------------------------------

    def stop_together(self) -> None:
        """Every rank leaves here together: a closing checkpoint, its commit confirmed."""
        log.info("stopping (%s): checkpoint at step %d", self.stop_reason or "a peer stops", self.trainer.step_count)
        self.flush_step()
        # This rank's last metrics now, before the closing checkpoint's collective: they reach the
        # dispatcher before rank 0's last `Committed` ends the job (and final_status.json).
        self.link.beat(force=True)
        if self.trainer.step_count != self.last_checkpoint_step:
            self.checkpoint()
        if self.rank == 0:
            self.await_commit_done(COMMIT_CONFIRM_S)
        raise StopRequested()  # not 0: the supervisor reads exit 0 as "got Shutdown at the end"

    def finish(self) -> None:
        """Drained: the last checkpoint, then wait for the dispatcher to close the job."""
        self._phase("finish", self.trainer.step_count)
        self.flush_step()
        # This rank's last metrics now, before the closing checkpoint's collective: they reach the
        # dispatcher before rank 0's last `Committed` ends the job (and final_status.json).
        self.link.beat(force=True)
        if self.trainer.step_count != self.last_checkpoint_step:
            self.checkpoint()
        timeout = self.cfg.dispatch.heartbeat_timeout_s
        deadline = time.monotonic() + timeout
        while not self.shutdown and time.monotonic() < deadline:
            if (msg := self.link.recv(0.5)) is not None:
                self._handle(msg)
        if not self.shutdown:
            # Exit non-zero: the supervisor treats a clean exit as a worker that got Shutdown.
            raise WorkerDeadError(f"drafter/{self.rank}: trained everything but the dispatcher did not close "
                                  f"the job within {timeout:.0f}s")

    def await_commit_done(self, timeout_s: float) -> None:
        """Waits for the dispatcher's `CommitDone` of the last checkpoint (then marks it)."""
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                msg = self.link.recv(max(0.0, deadline - time.monotonic()))
                if isinstance(msg, p.CommitDone):
                    self.confirmed(msg.step)
                    if msg.step == self.trainer.step_count:
                        return
        except WorkerDeadError as exc:
            log.warning("the dispatcher did not confirm the last commit (%s)", exc)
            return
        log.warning("the dispatcher did not confirm the last commit within %.0fs: a rerun trains those "
                    "samples again from the previous commit", timeout_s)

    def _phase(self, name: str, step: int | None = None) -> None:
        if self.beacon is not None:
            self.beacon.phase(name, step)


@dataclass
class _PendingStep:
    """A launched step and what the loop knew of it when it was launched."""

    launched: LaunchedStep
    started: float
    ended: float
    validated: int
    sequences: int
    anchors: int
    tokens: int


def _by_copy(per_rank: list[list[tuple[int, ...]]]) -> dict[tuple[int, int, int], list[int]]:
    """(batch, rank, attempt) -> sample ids, from the gathered (batch, attempt, sample) rows."""
    out: dict[tuple[int, int, int], list[int]] = {}
    for rank, rows in enumerate(per_rank):
        for batch, attempt, sample in rows:
            out.setdefault((batch, rank, attempt), []).append(sample)
    return out


def _best_of(extra: dict) -> tuple[int, float] | None:
    """The best checkpoint a checkpoint's `extra` recorded, or None (absent or malformed)."""
    best = extra.get("best")
    if not isinstance(best, dict):
        return None
    step, value = best.get("step"), best.get("acceptance_length")
    if isinstance(step, int) and not isinstance(step, bool) and step > 0 and isinstance(value, (int, float)) \
            and math.isfinite(value):
        return step, float(value)
    return None
