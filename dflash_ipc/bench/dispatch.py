"""``dflash-ipc bench dispatch``: pull against round-robin on the real dispatcher and sockets.

What runs: the real ``Dispatcher`` inside the real ``DispatcherProc`` (its own spawned
process, ROUTER socket on ``ipc://`` in a temp dir) and, in this process, one thread per
fake worker, each with its own ``DispatcherLink`` (DEALER socket), speaking the real
protocol. A fake target is a modelled device (``_FakeTarget``): busy for the cost-model
time of each ``Batch`` it is given, then ``Produced`` + ``Ready(1)``; a fake drafter answers each ``Assign`` with
``Consumed``, ``Committed`` and ``WantHidden(1)`` at once, so drafters never hold a
target back and the bench measures only how the policy spreads target work.

The epoch plan is the real one (``plan_epoch``) over log-normal lengths (median 1024,
clipped to 64..8192), bucketed and packed under a token budget. Batch costs are unequal
because the cost has a quadratic term: a padded batch ``[B, L]`` costs
``B * L * (1 + L / attn_crossover_len)`` token-equivalents (linear layers + attention).

Reported per policy, from the targets' busy intervals: makespan (from the moment every
worker has registered to the end of the last batch), ideal = total work / total target
speed (total busy / number of targets at equal speeds), ideal / makespan (goal for pull:
>= 0.97), and per target utilisation (busy / makespan), starved and tail idle seconds,
batches. The intervals come back too, for drawing a timeline.

Run manual::

    from dflash_ipc.bench.dispatch import run_dispatch_bench
    run_dispatch_bench()                                  # 5 equal targets, ~20 s of work per policy
    run_dispatch_bench(target_speeds=(1, 1, 1, 1, 0.5))   # one target at half speed
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np

from dflash_ipc.wire import protocol as p
from dflash_ipc.config.schema import DrafterConfig, TargetConfig
from dflash_ipc.dispatch.policy import POLICIES
from dflash_ipc.config.load import load_config
from dflash_ipc.dispatch.buckets import BucketSpec, PlannedBatch, plan_epoch, plan_stats
from dflash_ipc.dispatch.dispatcher import Dispatcher
from dflash_ipc.dispatch.proc import DispatcherProc
from dflash_ipc.errors import ConfigError, DataError, ProtocolError, WorkerDeadError
from dflash_ipc.wire.link import DispatcherLink
from dflash_ipc.wire.status import read_status_file, to_plain
from dflash_ipc.run.files import RunFiles

log = logging.getLogger(__name__)

DEFAULT_TIME_SCALE = 0.018  # bench seconds per modelled GPU second: ~20 s of sleep per policy
DEFAULT_SPEC = BucketSpec(boundaries=(128, 256, 512, 1024, 2048, 4096, 8192), token_budget=16384)
STARTUP_TIMEOUT_S = 30.0  # registration, and the start barrier
LINK_TIMEOUT_S = 20.0  # a fake worker that hears nothing from the dispatcher this long gives up
POLL_S = 0.5  # idle workers re-check the stop flag this often
GOAL_RATIO = 0.97


# --- models of the workload -------------------------------------------------------------


@dataclass(kw_only=True, frozen=True, slots=True)
class LengthModel:
    """Log-normal sequence lengths, clipped: a chat SFT set with a long tail."""

    median: float = 1024.0
    """Median length in tokens (exp of the log-normal's mu)."""
    sigma: float = 0.9
    """Standard deviation of log(length)."""
    min_len: int = 64
    """Shorter samples are clipped up to this."""
    max_len: int = 8192
    """Longer samples are clipped down to this (the largest bucket)."""

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.min_len <= self.max_len):
            raise ConfigError(f"LengthModel: need median > 0, sigma >= 0, 1 <= min_len <= max_len; "
                              f"got {self}")

    def sample(self, num_samples: int, *, seed: int) -> np.ndarray:
        """``num_samples`` int64 lengths, the same for the same seed."""
        rng = np.random.default_rng([int(seed), 0xD15])
        raw = rng.lognormal(np.log(self.median), self.sigma, int(num_samples))  # [N]
        return np.clip(np.round(raw), self.min_len, self.max_len).astype(np.int64)


@dataclass(kw_only=True, frozen=True, slots=True)
class CostModel:
    """GPU seconds of a padded target batch ``[B, L]``: linear layers + attention.

    Per token the linear layers cost a constant and attention grows with L, so a batch
    costs ``B*L*(1 + L/attn_crossover_len)`` token-equivalents. Under a token budget
    ``B*L`` is nearly constant, so the quadratic term is what makes long-bucket batches
    dear. FLOP counts of Qwen3-8B put the crossover near 23K tokens; padded attention
    kernels run well below matmul efficiency, which brings it lower; 8192 is the default.
    """

    tokens_per_s: float = 30_000.0
    """Throughput of one target at ``ref_len`` (H200, Qwen3-8B-shaped, DESIGN.md)."""
    ref_len: int = 2048
    """Sequence length at which ``tokens_per_s`` holds."""
    attn_crossover_len: int = 8192
    """Length at which a token's attention costs as much as its linear layers."""

    def __post_init__(self) -> None:
        if not (self.tokens_per_s > 0 and self.ref_len >= 1 and self.attn_crossover_len >= 1):
            raise ConfigError(f"CostModel: every field must be positive, got {self}")

    def batch_s(self, batch_size: int, padded_len: int) -> float:
        """Seconds one target spends on a padded ``[batch_size, padded_len]`` batch."""
        per_unit_s = 1.0 / (self.tokens_per_s * (1.0 + self.ref_len / self.attn_crossover_len))
        return per_unit_s * batch_size * padded_len * (1.0 + padded_len / self.attn_crossover_len)


# --- metric arithmetic (pure) -----------------------------------------------------------


class Interval(NamedTuple):
    """One batch on one worker: busy from ``start`` to ``end`` (seconds)."""

    worker: int
    start: float
    end: float
    batch_id: int = -1


def _checked(intervals: Sequence[Sequence], num_workers: int) -> list[tuple[int, float, float]]:
    if num_workers < 1:
        raise ConfigError(f"num_workers must be >= 1, got {num_workers}")
    out = []
    for i, iv in enumerate(intervals):
        worker, start, end = int(iv[0]), float(iv[1]), float(iv[2])
        if not 0 <= worker < num_workers:
            raise DataError(f"interval {i}: worker {worker} outside [0, {num_workers})")
        if end < start:
            raise DataError(f"interval {i}: end {end} < start {start}")
        out.append((worker, start, end))
    return out


def busy_s(intervals: Sequence[Sequence], num_workers: int) -> list[float]:
    """Total busy seconds per worker (intervals of one worker must not overlap)."""
    busy = [0.0] * num_workers
    for worker, start, end in _checked(intervals, num_workers):
        busy[worker] += end - start
    return busy


def makespan_s(intervals: Sequence[Sequence], *, start: float | None = None) -> float:
    """From ``start`` (default: the earliest interval start) to the latest interval end."""
    if not intervals:
        return 0.0
    t0 = min(float(iv[1]) for iv in intervals) if start is None else start
    return max(float(iv[2]) for iv in intervals) - t0


def ideal_s(intervals: Sequence[Sequence], num_workers: int,
            speeds: Sequence[float] | None = None) -> float:
    """Makespan of a perfect split: total work / total speed.

    A worker of speed s busy for d seconds did d*s of work; with equal speeds this is
    total busy time / ``num_workers``.
    """
    speeds = _speeds(speeds, num_workers)
    work = sum(b * s for b, s in zip(busy_s(intervals, num_workers), speeds))
    return work / sum(speeds)


def utilisation(intervals: Sequence[Sequence], num_workers: int, *,
                start: float | None = None) -> list[float]:
    """Busy / makespan per worker."""
    span = makespan_s(intervals, start=start)
    return [b / span if span > 0 else 0.0 for b in busy_s(intervals, num_workers)]


def tail_s(intervals: Sequence[Sequence], num_workers: int, *, start: float | None = None) -> list[float]:
    """Per worker: from its last interval's end to the latest end of all (0 for the last one).

    Idle time in the tail is imbalance (this worker ran out of work first); the rest of a
    worker's idle time, ``makespan - busy - tail``, is starvation while work remained.
    A worker with no interval idles for the whole makespan, all of it counted as tail
    (``start`` as in ``makespan_s``).
    """
    checked = _checked(intervals, num_workers)
    if not checked:
        return [0.0] * num_workers
    first = min(s for _, s, _ in checked) if start is None else start
    last_end = [first] * num_workers
    for worker, _, end in checked:
        last_end[worker] = max(last_end[worker], end)
    finish = max(e for _, _, e in checked)
    return [finish - e for e in last_end]


def summarize(intervals: Sequence[Sequence], num_workers: int, *, start: float | None = None,
              speeds: Sequence[float] | None = None) -> dict:
    """Makespan, ideal, ideal/makespan, and per worker: utilisation, busy, starved and tail
    seconds (busy + starved + tail = makespan) and number of batches."""
    span = makespan_s(intervals, start=start)
    busy, tail = busy_s(intervals, num_workers), tail_s(intervals, num_workers, start=start)
    counts = [0] * num_workers
    for worker, _, _ in _checked(intervals, num_workers):
        counts[worker] += 1
    ideal = ideal_s(intervals, num_workers, speeds)
    return {"makespan_s": span, "ideal_s": ideal, "ratio": ideal / span if span > 0 else 0.0,
            "utilisation": utilisation(intervals, num_workers, start=start), "busy_s": busy,
            "starved_s": [span - b - t for b, t in zip(busy, tail)], "tail_s": tail, "batches": counts}


def parse_speeds(text: str) -> list[float]:
    """``"1,1,0.5"`` -> ``[1.0, 1.0, 0.5]`` (the CLI's ``--target-speeds``)."""
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--target-speeds: '{text}' is not a comma-separated list of numbers") from None


def _speeds(speeds: Sequence[float] | None, num_workers: int) -> list[float]:
    if speeds is None:
        return [1.0] * num_workers
    speeds = [float(s) for s in speeds]
    if len(speeds) != num_workers or min(speeds) <= 0:
        raise ConfigError(f"target speeds: need {num_workers} values > 0, got {speeds}")
    return speeds


# --- fake workers (threads, real sockets) ------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _Shared:
    """What the fake-worker threads of one run share with the bench thread."""

    address: str
    barrier: threading.Barrier
    t0: list  # [start time], set by the barrier when every worker has registered
    stop: threading.Event
    intervals: list
    errors: list


def _register(link: DispatcherLink, role: str, rank: int, **extra) -> None:
    reply = link.request(p.Register(role=role, rank=rank, pid=os.getpid(), **extra),
                         timeout_s=STARTUP_TIMEOUT_S)
    if not isinstance(reply, p.Registered):
        raise ProtocolError(f"bench {role}/{rank}: expected Registered, got {reply}")


class _FakeTarget:
    """A target modelled as a device with a launch queue, like a GPU behind a CUDA stream.

    The device starts a batch when the batch has reached the worker and the previous batch
    has ended, and is busy for the batch's modelled cost. The thread waits for the end on
    the socket, so a batch that arrives meanwhile is stamped on arrival, and reports
    `Produced` + `Ready(1)` only after the end. The thread's own messaging between batches
    is not device idle time (a real target overlaps it with the next batch's compute);
    idle time is a batch that had not arrived when the device became free.
    """

    def __init__(self, shared: _Shared, rank: int, lengths: np.ndarray, cost: CostModel,
                 seconds_per_cost_s: float) -> None:
        self.shared, self.rank, self.lengths, self.cost = shared, rank, lengths, cost
        self.seconds_per_cost_s = seconds_per_cost_s
        self.link: DispatcherLink | None = None  # made in the worker's thread, which owns it
        self.queue: deque[tuple[float, p.Batch]] = deque()  # (arrival time, batch)
        self.shutdown = False

    def _take(self, msg: p.Message | None) -> None:
        """Files `msg` and everything already waiting behind it."""
        while msg is not None:
            if isinstance(msg, p.Shutdown):
                self.shutdown = True
            elif isinstance(msg, p.Batch):
                self.queue.append((time.perf_counter(), msg))
            msg = self.link.recv(0.0)

    def _wait_until(self, deadline: float) -> None:
        """Sleeps until `deadline` (perf_counter) while taking messages as they arrive."""
        while (remaining := deadline - time.perf_counter()) > 0:
            if remaining < 0.001:  # zmq polls in whole milliseconds
                time.sleep(remaining)
            elif self.link.socket.poll(int(remaining * 1000)):
                self._take(self.link.recv(0.0))

    def run(self) -> None:
        self.link = DispatcherLink(self.shared.address, identity=f"bench-target/{self.rank}",
                                   timeout_s=LINK_TIMEOUT_S)
        try:
            self._serve()
        finally:
            self.link.close()

    def _serve(self) -> None:
        defaults = TargetConfig()
        _register(self.link, "target", self.rank, pool={"backend": "fake"}, num_slots=defaults.num_slots)
        self.shared.barrier.wait(STARTUP_TIMEOUT_S)
        device_free = self.shared.t0[0]
        self.link.send(p.Ready(credits=defaults.prefetch))
        while not (self.shutdown or self.shared.stop.is_set()):
            self._take(self.link.recv(0.0 if self.queue else POLL_S))
            if not self.queue:
                continue
            arrived, batch = self.queue.popleft()
            start = max(arrived, device_free)
            end = start + self.cost.batch_s(len(batch.sample_ids), batch.padded_len) * self.seconds_per_cost_s
            self._wait_until(end)
            device_free = end
            self.shared.intervals.append(Interval(self.rank, start, end, batch.batch_id))
            self.link.send(p.Produced(batch_id=batch.batch_id, slot=batch.slot, compute_s=end - start,
                                      num_tokens=int(self.lengths[batch.sample_ids].sum())))
            self.link.send(p.Ready(credits=1))


def _fake_drafter(shared: _Shared, rank: int) -> None:
    """Consumes and commits every assignment at once, keeping `prefetch` asks outstanding."""
    link = DispatcherLink(shared.address, identity=f"bench-drafter/{rank}", timeout_s=LINK_TIMEOUT_S)
    try:
        _register(link, "drafter", rank)
        shared.barrier.wait(STARTUP_TIMEOUT_S)
        link.send(p.WantHidden(credits=DrafterConfig().prefetch))
        step = 0
        while not shared.stop.is_set():
            msg = link.recv(POLL_S)
            if isinstance(msg, p.Shutdown):
                return
            if isinstance(msg, p.Assign):
                link.send(p.Consumed(batch_id=msg.batch_id, attempt=msg.attempt))
                link.send(p.Committed(step=step, batch_ids=[msg.batch_id], ranks=[rank], attempts=[msg.attempt],
                                      samples=[msg.sample_ids]))
                link.send(p.WantHidden(credits=1))
                step += 1
    finally:
        link.close()


def _guarded(shared: _Shared, name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except BaseException as exc:  # the bench thread re-raises it; other workers stop
        shared.errors.append(f"{name}: {type(exc).__name__}: {exc}")
        shared.stop.set()
        shared.barrier.abort()


# --- the dispatcher process ---------------------------------------------------------------


def _dispatcher_main(run_dir: str, address: str, policy: str, batches: list[PlannedBatch],
                     num_targets: int, num_drafters: int) -> None:
    """Child process: the real DispatcherProc; exits when every batch is committed."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s dispatcher %(levelname)s %(message)s")
    _exit_with_parent()
    cfg = load_config(None, [f"run.run_dir={run_dir}",
                             f"target.num_workers={num_targets}", f"drafter.num_workers={num_drafters}"])
    dispatcher = Dispatcher([batches], policy=policy, num_targets=num_targets, num_drafters=num_drafters,
                            heartbeat_timeout_s=cfg.dispatch.heartbeat_timeout_s)
    proc = DispatcherProc(cfg, dispatcher, address=address)
    try:
        proc.run()
    finally:
        proc.close()


def _exit_with_parent() -> None:
    """A death pipe: the dispatcher must not outlive the bench if the bench is killed."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        mp.connection.wait([parent.sentinel])
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _stop_process(proc: mp.Process) -> None:
    for stop in (proc.terminate, proc.kill):  # SIGTERM, grace, SIGKILL
        if proc.is_alive():
            stop()
            proc.join(5.0)


def run_policy(policy: str, batches: list[PlannedBatch], lengths: np.ndarray, *, num_targets: int,
               num_drafters: int, speeds: Sequence[float], cost: CostModel, time_scale: float,
               timeout_s: float) -> dict:
    """One job under ``policy``: returns ``summarize`` of the target intervals, plus the
    intervals (seconds from the start barrier) and the dispatcher's final status."""
    run_dir = tempfile.mkdtemp(prefix="dflash-bench-dispatch-")
    address = f"ipc://{RunFiles(run_dir).socket}"
    t0: list[float] = []
    shared = _Shared(address=address, stop=threading.Event(), intervals=[], errors=[], t0=t0,
                     barrier=threading.Barrier(num_targets + num_drafters,
                                               action=lambda: t0.append(time.perf_counter())))
    proc = mp.get_context("spawn").Process(
        target=_dispatcher_main, args=(run_dir, address, policy, batches, num_targets, num_drafters),
        name=f"bench-dispatcher-{policy}", daemon=True)
    workers = {f"target/{r}": _FakeTarget(shared, r, lengths, cost, time_scale / speeds[r]).run
               for r in range(num_targets)}
    workers.update({f"drafter/{r}": functools.partial(_fake_drafter, shared, r) for r in range(num_drafters)})
    threads = [threading.Thread(target=_guarded, args=(shared, name, fn), name=f"bench-{name}", daemon=True)
               for name, fn in workers.items()]
    proc.start()
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        while proc.is_alive() and not shared.errors and time.monotonic() < deadline:
            proc.join(0.2)
        if proc.is_alive():
            raise WorkerDeadError(f"bench {policy}: the dispatcher did not finish within {timeout_s:.0f}s; "
                                  f"worker errors: {shared.errors or 'none'}")
        if proc.exitcode != 0:
            raise WorkerDeadError(f"bench {policy}: dispatcher process (pid {proc.pid}) exited with "
                                  f"code {proc.exitcode}; worker errors: {shared.errors or 'none'}")
        for thread in threads:  # they leave on the dispatcher's Shutdown
            thread.join(max(0.1, deadline - time.monotonic()))
        if shared.errors:
            raise WorkerDeadError(f"bench {policy}: fake workers failed: {'; '.join(shared.errors)}")
        final = read_status_file(RunFiles(run_dir).final_status)
    finally:
        shared.stop.set()
        shared.barrier.abort()
        _stop_process(proc)
        for thread in threads:
            thread.join(2 * POLL_S)
        shutil.rmtree(run_dir, ignore_errors=True)
    intervals = sorted(shared.intervals, key=lambda iv: (iv.start, iv.worker))
    result = summarize(intervals, num_targets, start=t0[0], speeds=speeds)
    result["intervals"] = [[iv.worker, iv.start - t0[0], iv.end - t0[0], iv.batch_id] for iv in intervals]
    result["dispatcher"] = {"batches": to_plain(final.batches), "refusals": final.refusals,
                            "elapsed_s": final.elapsed_s}
    return result


# --- the bench -----------------------------------------------------------------------------


def run_dispatch_bench(*, num_targets: int = 5, num_drafters: int = 3, num_samples: int = 20000,
                       policies: Sequence[str] = POLICIES, seed: int = 0,
                       time_scale: float = DEFAULT_TIME_SCALE,
                       target_speeds: Sequence[float] | None = None,
                       lengths: LengthModel = LengthModel(), spec: BucketSpec = DEFAULT_SPEC,
                       cost: CostModel = CostModel(), timeout_s: float | None = None,
                       print_fn: Callable[[str], None] = print) -> dict:
    """Plans one epoch, runs it under each policy, prints a table, returns every figure.

    ``time_scale``: bench seconds per modelled GPU second. ``target_speeds``: relative
    speed of each target (default all 1.0; e.g. 0.5 for a target sharing its GPU).
    ``starved_s``/``tail_s`` in the table are summed over targets. Returns ``{"config", "plan", "policies": {policy: summarize(...) + intervals}}``.
    """
    for policy in policies:
        if policy not in POLICIES:
            raise ConfigError(f"bench dispatch: policy '{policy}' not allowed; allowed: {', '.join(POLICIES)}")
    if num_targets < 1 or num_drafters < 1 or num_samples < 1 or time_scale <= 0:
        raise ConfigError(f"bench dispatch: need num_targets, num_drafters, num_samples >= 1 and "
                          f"time_scale > 0; got {num_targets}, {num_drafters}, {num_samples}, {time_scale}")
    speeds = _speeds(target_speeds, num_targets)
    sample_lengths = lengths.sample(num_samples, seed=seed)  # [N]
    batches = plan_epoch(sample_lengths, spec, seed=seed, epoch=0)
    model_s = sum(cost.batch_s(len(b.sample_ids), b.padded_len) for b in batches)
    if timeout_s is None:  # even one target doing everything alone would finish in this time
        timeout_s = 2 * STARTUP_TIMEOUT_S + 2 * model_s * time_scale / min(speeds)
    out = {"config": {"num_targets": num_targets, "num_drafters": num_drafters, "num_samples": num_samples,
                      "seed": seed, "time_scale": time_scale, "target_speeds": speeds,
                      "lengths": _fields(lengths), "spec": _fields(spec), "cost": _fields(cost)},
           "plan": {**plan_stats(batches, token_budget=spec.token_budget), "model_gpu_s": model_s,
                    "bench_sleep_s": model_s * time_scale},
           "policies": {}}
    _print_header(out, print_fn)
    for policy in policies:
        log.info("bench dispatch: running %s on %d batches", policy, len(batches))
        started = time.monotonic()
        result = run_policy(policy, batches, sample_lengths, num_targets=num_targets,
                            num_drafters=num_drafters, speeds=speeds, cost=cost, time_scale=time_scale,
                            timeout_s=timeout_s)
        result["wall_s"] = time.monotonic() - started
        out["policies"][policy] = result
        _print_row(policy, result, print_fn)
    return out


def _fields(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}


def _print_header(out: dict, print_fn: Callable[[str], None]) -> None:
    cfg, plan, lm = out["config"], out["plan"], out["config"]["lengths"]
    print_fn(f"dispatch bench: {cfg['num_samples']} samples (log-normal median {lm['median']:.0f}, "
             f"sigma {lm['sigma']}, {lm['min_len']}..{lm['max_len']} tokens) -> {plan['num_batches']} batches "
             f"under a {cfg['spec']['token_budget']}-token budget, padding {plan['padding_fraction']:.1%}")
    print_fn(f"  {cfg['num_targets']} targets (speeds {' '.join(f'{s:g}' for s in cfg['target_speeds'])}), "
             f"{cfg['num_drafters']} drafters; cost B*L*(1+L/{cfg['cost']['attn_crossover_len']}): "
             f"{plan['model_gpu_s']:.0f} GPU-s x time_scale {cfg['time_scale']:g} = "
             f"{plan['bench_sleep_s']:.1f} s of target work per policy")
    print_fn(f"{'policy':<12}{'makespan_s':>11}{'ideal_s':>9}{'ideal/mk':>9}{'starved_s':>10}{'tail_s':>8}"
             f"  utilisation per target / batches per target")


def _print_row(policy: str, r: dict, print_fn: Callable[[str], None]) -> None:
    util = " ".join(f"{u:.2f}" for u in r["utilisation"])
    print_fn(f"{policy:<12}{r['makespan_s']:>11.3f}{r['ideal_s']:>9.3f}{r['ratio']:>9.3f}"
             f"{sum(r['starved_s']):>10.3f}{sum(r['tail_s']):>8.3f}  {util} / "
             f"{' '.join(str(b) for b in r['batches'])}")
    if policy == "pull":
        print_fn(f"{'':<12}goal ideal/makespan >= {GOAL_RATIO}: {'met' if r['ratio'] >= GOAL_RATIO else 'NOT met'}")
