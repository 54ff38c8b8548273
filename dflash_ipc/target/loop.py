"""One target rank's loop, apart from its sockets, pool and model (all three are injected).

    loop = TargetLoop(worker, link, registration=p.Register(...), prefetch=2, register_timeout_s=60)
    loop.register()                # Register -> Registered, then Ready(prefetch)
    while loop.pass_once():        # until Shutdown
        pass

`pass_once()` is one pass, numbered as it runs:
  1) intake: every waiting message; batches queue up (the worker asks for `prefetch` at once,
     so the next batch is already here while the current one computes). It blocks, up to
     `idle_wait_s`, only when nothing is queued;
  2) compute the oldest queued batch into its slot, publish the slot, report `Produced`, and
     ask for one more (`Ready(1)`); with nothing queued, the pass is idle: the worker's
     tensor-parallel followers hear that their leader lives, and the wait is timed;
  3) `Shutdown` ends the loop (False), whatever is still queued.
The link's liveness rules end it too: a silent dispatcher is a `WorkerDeadError`, a restarted
one a `DispatcherRestarted`; `serve` then registers again on a fresh loop, since the batches
this one held are pending again at the new dispatcher. Tests step it with a fake link and a
fake capture (tests/test_target_loop.py), and with the real link, dispatcher and drafter loop
in one process (tests/test_inprocess_job.py).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

from dflash_ipc.errors import DispatcherRestarted, WorkerDeadError
from dflash_ipc.obs.timelines import process_memory
from dflash_ipc.wire import protocol as p

log = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # longest block for work when nothing is queued (the link beats meanwhile)


class TargetLoop:
    """`worker` computes a `Batch` into its slot (`produce`) and keeps followers alive (`idle`);
    `link` is the dispatcher link (send, recv, request, metrics); `clock` times busy and wait
    (`time.perf_counter` readings, as the timeline takes them)."""

    def __init__(self, worker, link, *, registration: p.Register, prefetch: int, register_timeout_s: float,
                 idle_wait_s: float = IDLE_WAIT_S, timeline=None, profiler=None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if registration.role != "target":
            raise ValueError(f"TargetLoop: registration.role must be 'target', got {registration.role!r}")
        if not 1 <= prefetch <= registration.num_slots:
            raise ValueError(f"TargetLoop: prefetch must be in [1, num_slots={registration.num_slots}], "
                             f"got {prefetch}")
        self.worker, self.link = worker, link
        self.registration, self.prefetch = registration, prefetch
        self.register_timeout_s, self.idle_wait_s = register_timeout_s, idle_wait_s
        self.timeline, self.profiler, self.clock = timeline, profiler, clock
        self.name = f"target/{registration.rank}"
        self.queue: collections.deque[p.Batch] = collections.deque()
        self.busy_s = self.wait_s = 0.0
        self.batches = self.tokens = 0
        self.shutdown_reason: str | None = None

    # --- 0) register -------------------------------------------------------------------------

    def register(self) -> p.Registered:
        """Takes the seat (its pool and slot count travel in `registration`), then asks for
        `prefetch` batches at once."""
        reply = self.link.request(self.registration, timeout_s=self.register_timeout_s)
        if not isinstance(reply, p.Registered):
            raise WorkerDeadError(f"{self.name}: registration refused: {reply}")
        self.link.send(p.Ready(credits=self.prefetch))
        return reply

    # --- one pass ----------------------------------------------------------------------------

    def pass_once(self) -> bool:
        """One pass of steps 1-3; False once `Shutdown` came."""
        waited = self.clock()
        if not self.intake(0.0 if self.queue else self.idle_wait_s):   # 1
            if self.profiler is not None:
                self.profiler.finish()
            return False                                                # 3
        if not self.queue:
            self.worker.idle()
            ended = self.clock()  # one reading: the counter and the timeline agree
            self.wait_s += ended - waited
            self._record("wait_work", waited, ended)
            self.link.metrics.update(self._counters())
            return True
        started = self.clock()
        self._record("wait_work", waited, started)  # a batch that arrived while blocked
        produced = self.worker.produce(self.queue.popleft())           # 2
        self.link.send(produced)
        self.link.send(p.Ready(credits=1))
        ended = self.clock()
        self.busy_s += ended - started
        self._record("busy", started, ended, tokens=produced.num_tokens, batch=produced.batch_id)
        if self.profiler is not None:
            self.profiler.step()
        self.batches += 1
        self.tokens += produced.num_tokens
        self.link.metrics.update(self._counters(), **process_memory(self.worker.device))
        return True

    def intake(self, timeout_s: float) -> bool:
        """Queues every waiting batch; False at a `Shutdown` (what follows it is not read)."""
        msg = self.link.recv(timeout_s)
        while msg is not None:
            if isinstance(msg, p.Batch):
                self.queue.append(msg)
            elif isinstance(msg, p.Shutdown):
                log.info("%s: shutdown: %s", self.name, msg.reason)
                self.shutdown_reason = msg.reason
                return False
            elif not isinstance(msg, p.EndOfData):  # no more batches: Shutdown follows
                log.warning("%s: ignored unexpected %s", self.name, msg.KIND.name)
            msg = self.link.recv(0.0)
        return True

    def _counters(self) -> dict[str, float]:
        return {"busy_s": self.busy_s, "wait_s": self.wait_s, "batches": self.batches, "tokens": self.tokens}

    def _record(self, state: str, t0: float, t1: float, **extra) -> None:
        if self.timeline is not None:
            self.timeline.record(state, t0, t1, **extra)


def serve(new_loop: Callable[[], TargetLoop]) -> TargetLoop:
    """Registers and runs a loop until `Shutdown`; returns that loop. A dispatcher restart
    (a new process restored from the ledger) gets a fresh loop on the same worker and pool:
    the batches the old one held are pending again there, and the supervisor stopped every
    drafter that could still read their slots before that restart."""
    while True:
        loop = new_loop()
        try:
            loop.register()
            while loop.pass_once():
                pass
            return loop
        except DispatcherRestarted as exc:
            log.warning("%s: %s: registering again", loop.name, exc)
