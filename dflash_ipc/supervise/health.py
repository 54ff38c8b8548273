"""`dflash-ipc health RUN_DIR`: is this job alive and making progress? (psutil + the dispatcher)

    report = health_report("runs/default")      # ~0.2 s; up to `timeout_s` more if the dispatcher hangs
    print(format_health(report))                # or json.dumps(report.to_json())
    sys.exit(report.exit_code)                  # 0 healthy, 1 degraded, 2 down: a liveness probe

Sources: `<run_dir>/processes.json` (the supervisor's pids and roles; node K of a
multi-node job: `processes-nodeK.json`, with `node_rank=K`), psutil for every
process (state, RSS, CPU%, threads), NVML for GPU memory when `pynvml` (nvidia-ml-py) is
importable and a driver answers (otherwise the column is empty), and one `StatusRequest` to
the dispatcher (heartbeat ages, batch counters). CPU% is measured over one shared window of
`cpu_window_s` for all processes together; the dispatcher is asked during that window.

Rules, first match wins:

**down** (exit 2): no readable `processes.json` or `config.yaml`; the supervisor is not
running (gone, zombie, or its pid now belongs to a younger process); no `dispatcher` entry;
the dispatcher process is gone, zombie or stopped; the dispatcher does not answer a status
request within `timeout_s` (hung or not serving counts as down: nothing moves without it).
On nodes other than 0 the dispatcher is not a local process: it is only asked.

**degraded** (exit 1), any of, per target/drafter:
- its process is gone, a zombie, stopped (SIGSTOP, psutil "stopped"/"tracing-stop") or dead;
- the dispatcher does not know it (never registered, or dropped as silent), once the run is
  older than `supervise.startup_timeout_s` (counted from processes.json's mtime; before
  that it is reported as "starting" and does not degrade);
- its heartbeat is older than `stale_after_s` (default `dispatch.heartbeat_timeout_s / 2`:
  half-way to the dispatcher declaring it dead);
- no progress for longer than `stall_after_s` (default `2 x dispatch.heartbeat_timeout_s`)
  while progress is expected (see below);
and for the supervisor: stopped (the job still runs, but nobody would restart or stop it).

**healthy** (exit 0) otherwise, including a finished job whose processes still run.

Instead of down, when the dispatcher does not answer (supervise/job_phase.py):
**finished** (exit 0): its `final_status.json`, written since processes.json, says every batch
is committed (the job `up` ends with code 0); **starting** (exit 0): the supervisor runs and
holds the run directory's lock but has not written processes.json yet, or it runs, the
dispatcher process is alive (node 0), no earlier check got its status (the progress state file
holds none for these pids) and the run is younger than `supervise.startup_timeout_s`, with no
worker problem.

Progress. The dispatcher's counters say how much was done, not when, so each check keeps
the counters it saw in `<run_dir>/health_state.json` (`health_state-nodeK.json` for node K;
role -> pid, counter, first time this
counter value was seen). Progress age = now - the time the current value was first seen:
None on the first check (unknown), 0 when the value changed since the previous check, and a
lower bound otherwise (its resolution is the interval between checks, which suits a probe
that runs every few seconds). Counters: target = batches produced; drafter = (batches
consumed, training step); job (the dispatcher's row) = the ledger's batch-state counts.
Expected: the job and drafters until the job is finished; a target while batches are still
pending (after that, targets legitimately idle while drafters drain). The state file is
best effort: if the run directory is read-only, progress is simply never judged.

A pid from processes.json whose process is not the one the supervisor started is not ours (the
pid was reused): reported as "gone (pid reused)". The file records each process's start in clock
ticks since boot (run/process_start.py), which a reused pid's process cannot share; where it has
none (no /proc), a process created after the file was written is the reused one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field

import psutil

from dflash_ipc.run.checkpoints import UNCOMMITTED_NOTE, CheckpointStore
from dflash_ipc.errors import DataError, DFlashError
from dflash_ipc.run.json_files import read_json_object, write_json_atomic
from dflash_ipc.run.liveness import beacon_problem, read_beacon
from dflash_ipc.run.files import RunFiles
from dflash_ipc.run.process_start import is_recorded_process
from dflash_ipc.supervise.job_phase import (FINISHED, STARTING, answered_before, finished_status, lock_holder,
                                           starting_or_finished)
from dflash_ipc.supervise.roles import Role
from dflash_ipc.wire.status import DrafterStatus, JobStatus, TargetStatus, to_plain

log = logging.getLogger(__name__)

HEALTHY, DEGRADED, DOWN = "healthy", "degraded", "down"
EXIT_CODES = {HEALTHY: 0, STARTING: 0, FINISHED: 0, DEGRADED: 1, DOWN: 2}
BAD_STATES = {psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD, psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP}
GONE = "gone"
REUSED = "gone (pid reused)"
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_CPU_WINDOW_S = 0.2


@dataclass(kw_only=True, slots=True)
class ProcessHealth:
    """One row of the report: a process of the run as psutil, NVML and the dispatcher see it."""
    role: str
    """supervisor, dispatcher, target/N or drafter/N."""
    pid: int
    state: str = GONE
    """psutil status (running, sleeping, stopped, zombie, ...), or gone / gone (pid reused)."""
    rss_bytes: int | None = None
    cpu_percent: float | None = None
    num_threads: int | None = None
    gpu_memory_bytes: int | None = None
    """Summed over devices; None when NVML is unavailable or shows no memory for this pid."""
    heartbeat_age_s: float | None = None
    progress_age_s: float | None = None
    batches: int | None = None
    """Targets: produced; drafters: consumed; the dispatcher's row: committed."""
    phase: str | None = None
    """Drafters: the phase their liveness beacon reports, and for how long."""
    beacon_problem: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.state not in BAD_STATES and self.state not in (GONE, REUSED)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(kw_only=True, slots=True)
class HealthReport:
    """The verdict on one run directory; `exit_code` is the liveness-probe answer."""
    run_dir: str
    level: str
    """healthy, degraded or down."""
    node_rank: int = 0
    reasons: list[str] = field(default_factory=list)
    processes: list[ProcessHealth] = field(default_factory=list)
    job: dict | None = None
    """From the dispatcher: elapsed_s, num_batches, batches per state, finished, rates."""
    uncommitted_checkpoints: list[str] = field(default_factory=list)
    """Checkpoints written but never committed, set aside (never resumed from)."""
    thresholds: dict = field(default_factory=dict)
    checked_at: float = field(default_factory=time.time)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.level]

    def to_json(self) -> dict:
        return {"run_dir": self.run_dir, "node_rank": self.node_rank, "level": self.level,
                "exit_code": self.exit_code,
                "reasons": list(self.reasons), "checked_at": self.checked_at,
                "thresholds": dict(self.thresholds), "job": self.job,
                "uncommitted_checkpoints": list(self.uncommitted_checkpoints),
                "processes": [p.to_json() for p in self.processes]}


# --- entry point ------------------------------------------------------------------------------


def health_report(run_dir: str, *, node_rank: int = 0, stale_after_s: float | None = None,
                  stall_after_s: float | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                  cpu_window_s: float = DEFAULT_CPU_WINDOW_S) -> HealthReport:
    """Checks node `node_rank` of the run in `run_dir` (its supervisor and workers, and the
    job's dispatcher); never raises for a broken run (that is a `down` report)."""
    try:
        record, written_at = read_processes(run_dir, node_rank)
        cfg = _load_run_config(run_dir, node_rank)
    except DFlashError as exc:
        holder = lock_holder(run_dir, node_rank)
        if holder is not None and not os.path.exists(RunFiles(run_dir, node_rank).processes):
            return HealthReport(run_dir=run_dir, node_rank=node_rank, level=STARTING, reasons=[
                f"supervisor (pid {holder}) holds the run directory and has not started its processes yet"])
        return HealthReport(run_dir=run_dir, node_rank=node_rank, level=DOWN, reasons=[str(exc)])
    hb_timeout = cfg.dispatch.heartbeat_timeout_s
    thresholds = {"stale_after_s": stale_after_s if stale_after_s is not None else hb_timeout / 2,
                  "stall_after_s": stall_after_s if stall_after_s is not None else 2 * hb_timeout,
                  "startup_timeout_s": cfg.supervise.startup_timeout_s,
                  "run_age_s": max(0.0, time.time() - written_at)}
    roles = [("supervisor", record["supervisor"], record.get("supervisor_start_ticks"))] + [
        (e["role"], e["pid"], e.get("start_ticks")) for e in record["processes"]]
    rows, status, status_error = _sample(roles, written_at, run_dir, node_rank, timeout_s, cpu_window_s)
    report = HealthReport(run_dir=run_dir, node_rank=node_rank, level=HEALTHY, processes=rows,
                          thresholds=thresholds)
    if status is not None:
        report.job = _job_summary(status)
        _apply_status(rows, status)
    _apply_progress(RunFiles(run_dir, node_rank).health_state, rows, status, thresholds["stall_after_s"])
    _apply_beacons(rows, cfg)
    report.uncommitted_checkpoints = CheckpointStore(cfg.files.checkpoints).uncommitted()
    _judge(report, status, status_error, cfg.dispatcher_address)
    if report.level == DOWN and status is None:
        answered = answered_before(_read_state(RunFiles(run_dir, node_rank).health_state), rows)
        final = finished_status(cfg.files.final_status, written_at)
        starting_or_finished(report, None if final is None else _job_summary(final), cfg.files.final_status,
                             answered=answered)
    return report


def _job_summary(status: JobStatus) -> dict:
    """HealthReport.job: what the verdict's `job:` line shows, as plain JSON values."""
    return {"elapsed_s": status.elapsed_s, "num_batches": status.num_batches, "batches": to_plain(status.batches),
            "finished": status.finished, "rates": to_plain(status.rates)}


def _apply_beacons(rows: list[ProcessHealth], cfg) -> None:
    """Drafters: their liveness beacon says what they do and whether they are stopped (a
    drafter sends no heartbeat during a step, so its heartbeat age says little)."""
    now = time.time()
    for row in rows:
        if _kind(row.role) != "drafter":
            continue
        record = read_beacon(cfg.files.beacon(row.role))
        if record is None or record["pid"] != row.pid:
            continue
        row.phase = f"{record['phase']} {now - record['since']:.0f}s"
        row.beacon_problem = beacon_problem(record, pid=row.pid, now=now, stall_s=cfg.supervise.drafter_stall_s,
                                            limits=cfg.supervise.drafter_phase_limits())


def read_processes(run_dir: str, node_rank: int = 0) -> tuple[dict, float]:
    """The supervisor's processes.json and its mtime; DataError naming the file and field."""
    path = RunFiles(run_dir, node_rank).processes
    if not os.path.exists(path):
        raise DataError(f"{path} does not exist: no supervisor has started a job in {run_dir}")
    record = read_json_object(path, "the supervisor's process list")
    try:
        written_at = os.stat(path).st_mtime
    except OSError as exc:
        raise DataError(f"{path}: unreadable ({exc})") from None
    if not isinstance(record.get("supervisor"), int):
        raise DataError(f"{path}: field 'supervisor' must be an integer pid")
    entries = record.get("processes")
    if not isinstance(entries, list):
        raise DataError(f"{path}: field 'processes' must be a list of {{role, pid, log}}")
    for i, entry in enumerate(entries):
        if not (isinstance(entry, dict) and isinstance(entry.get("role"), str) and isinstance(entry.get("pid"), int)):
            raise DataError(f"{path}: processes[{i}] must have a string 'role' and an integer 'pid', got {entry!r:.80}")
    ticks = [("supervisor_start_ticks", record.get("supervisor_start_ticks"))] + [
        (f"processes[{i}].start_ticks", entry.get("start_ticks")) for i, entry in enumerate(entries)]
    for field, value in ticks:
        if value is not None and (type(value) is not int or value < 0):
            raise DataError(f"{path}: field {field!r} must be a count of clock ticks or null, got {value!r:.40}")
    return record, written_at


def _load_run_config(run_dir: str, node_rank: int):
    from dflash_ipc.config.load import load_config
    return load_config(RunFiles(run_dir, node_rank).config)


# --- sampling ---------------------------------------------------------------------------------


def _sample(roles: list[tuple[str, int, int | None]], written_at: float, run_dir: str, node_rank: int,
            timeout_s: float, cpu_window_s: float) -> tuple[list[ProcessHealth], JobStatus | None, str | None]:
    """psutil rows for every process (role, pid, start in clock ticks or None) and the
    dispatcher's status, in one CPU% window."""
    rows = [ProcessHealth(role=role, pid=pid) for role, pid, _ in roles]
    procs: list[psutil.Process | None] = []
    for row, (_, _, ticks) in zip(rows, roles):
        proc = _open_process(row.pid, written_at, ticks)
        if isinstance(proc, str):
            row.state, proc = proc, None
        else:
            _cpu_percent(proc)  # starts the window; the first call always returns 0.0
        procs.append(proc)
    started = time.monotonic()
    status, status_error = None, None
    asked = next((proc for row, proc in zip(rows, procs) if row.role == "dispatcher"), None)
    if node_rank != 0 or (asked is not None and _state(asked) not in BAD_STATES | {GONE}):
        status, status_error = _fetch(run_dir, node_rank, timeout_s)
    time.sleep(max(0.0, cpu_window_s - (time.monotonic() - started)))
    gpu = gpu_memory_by_pid()
    for row, proc in zip(rows, procs):
        if proc is not None:
            _fill_row(row, proc)
            row.gpu_memory_bytes = gpu.get(row.pid) if gpu is not None else None
    return rows, status, status_error


def _open_process(pid: int, written_at: float, ticks: int | None = None) -> psutil.Process | str:
    """The process, or GONE / REUSED (not the process the supervisor started: another start in
    clock ticks than ``ticks``; without them, created after processes.json was written)."""
    try:
        proc = psutil.Process(pid)
        return proc if is_recorded_process(proc, ticks, written_at) else REUSED
    except psutil.NoSuchProcess:
        return GONE
    except psutil.Error as exc:  # AccessDenied: another user's process cannot be ours
        log.debug("pid %d: %s", pid, exc)
        return GONE


def _state(proc: psutil.Process) -> str:
    try:
        return proc.status()
    except psutil.NoSuchProcess:
        return GONE
    except psutil.Error:
        return "unknown"


def _cpu_percent(proc: psutil.Process) -> float | None:
    try:
        return proc.cpu_percent(None)
    except psutil.Error:
        return None


def _fill_row(row: ProcessHealth, proc: psutil.Process) -> None:
    row.state = _state(proc)
    if row.state == GONE:
        return
    row.cpu_percent = _cpu_percent(proc)
    # A zombie has no memory or threads left to read; psutil may raise for it.
    try:
        row.rss_bytes = proc.memory_info().rss
    except psutil.Error:
        pass
    try:
        row.num_threads = proc.num_threads()
    except psutil.Error:
        pass


def _fetch(run_dir: str, node_rank: int, timeout_s: float) -> tuple[JobStatus | None, str | None]:
    import zmq

    from dflash_ipc.supervise.status_query import fetch_status
    try:
        return fetch_status(run_dir, timeout_s=timeout_s, node_rank=node_rank), None
    except (DFlashError, zmq.ZMQError) as exc:
        return None, str(exc)


def gpu_memory_by_pid(nvml=None) -> dict[int, int] | None:
    """GPU memory per pid summed over all devices via NVML; None when NVML is unavailable.

    `nvml` is the pynvml module (imported here when None). NVML sees pids of its own pid
    namespace: in a container without the host's pid namespace the map may not match.
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU here
        log.debug("NVML unavailable: %s", exc)
        return None
    used: dict[int, int] = {}
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            for info in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                # usedGpuMemory is None where the driver withholds it (MIG, some containers).
                if info.usedGpuMemory is not None:
                    used[info.pid] = used.get(info.pid, 0) + int(info.usedGpuMemory)
    except Exception as exc:
        log.debug("NVML query failed: %s", exc)
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return used


# --- the dispatcher's view and progress ---------------------------------------------------


def _kind(role: str) -> str:
    """`target`, `drafter`, `dispatcher`, or the name itself (`supervisor`: not a child role)."""
    try:
        return Role.parse(role).kind
    except ValueError:
        return role


def _worker_status(status: JobStatus, role: str) -> TargetStatus | DrafterStatus | None:
    """The dispatcher's seat of a worker (a follower of a multi-process target: its leader's)."""
    seats = {"target": status.targets, "drafter": status.drafters}.get(_kind(role))
    return seats.get(str(Role.parse(role).rank)) if seats is not None else None


def _apply_status(rows: list[ProcessHealth], status: JobStatus) -> None:
    for row in rows:
        if row.role == "dispatcher":
            row.batches = status.batches.committed
            continue
        seen = _worker_status(status, row.role)
        if seen is not None:
            row.heartbeat_age_s = seen.heartbeat_age_s
            row.batches = seen.batches


def _progress_counter(row: ProcessHealth, status: JobStatus) -> list | None:
    if row.role == "dispatcher":
        return sorted(to_plain(status.batches).items())
    seen = _worker_status(status, row.role)
    if seen is None:
        return None
    if _kind(row.role) == "drafter":
        return [seen.batches, seen.metrics.get("step")]
    return [seen.batches]


def _progress_expected(row: ProcessHealth, status: JobStatus) -> bool:
    if status.finished:
        return False
    if _kind(row.role) == "target":
        return status.batches.pending > 0
    return True


def _apply_progress(path: str, rows: list[ProcessHealth], status: JobStatus | None, stall_after_s: float) -> None:
    """Updates the state file at `path` with this check's counters and sets each row's progress age."""
    if status is None:
        return  # nothing to compare; keep the previous state for the next check
    previous = _read_state(path)
    now = time.time()
    state = {}
    for row in rows:
        counter = _progress_counter(row, status)
        if counter is None:
            continue
        counter = json.loads(json.dumps(counter))  # tuples -> lists, so it compares with what was stored
        old = previous.get(row.role)
        if old is None or old.get("pid") != row.pid:
            entry, row.progress_age_s = {"pid": row.pid, "counter": counter, "since": now}, None
        elif old.get("counter") != counter:
            entry, row.progress_age_s = {"pid": row.pid, "counter": counter, "since": now}, 0.0
        else:
            entry, row.progress_age_s = old, max(0.0, now - float(old.get("since", now)))
        state[row.role] = entry
        if (row.progress_age_s is not None and row.progress_age_s > stall_after_s
                and _progress_expected(row, status)):
            what = "the job" if row.role == "dispatcher" else row.role
            row.problems.append(f"no progress of {what} for {row.progress_age_s:.0f}s (> {stall_after_s:g}s)")
    _write_state(path, state)


def _read_state(path: str) -> dict:
    try:
        return read_json_object(path, "health state")
    except DataError:  # absent or damaged: start afresh (it only rate-limits reports)
        return {}


def _write_state(path: str, state: dict) -> None:
    try:
        write_json_atomic(path, state, indent=None)
    except OSError as exc:
        log.debug("cannot keep progress state in %s: %s", path, exc)


# --- verdict ----------------------------------------------------------------------------------


def _judge(report: HealthReport, status: JobStatus | None, status_error: str | None, address: str) -> None:
    """Fills `report.level` and `report.reasons` from the rows (rules in the module docstring)."""
    rows = {row.role: row for row in report.processes}
    down: list[str] = []
    supervisor = rows["supervisor"]
    if not supervisor.alive and supervisor.state != psutil.STATUS_STOPPED:
        down.append(f"supervisor (pid {supervisor.pid}) is not running: {supervisor.state}")
    dispatcher = rows.get("dispatcher")
    if report.node_rank != 0:
        if status is None:  # it runs on node 0: asking is all this node can do
            down.append(f"the dispatcher at {address} does not answer: {status_error}")
    elif dispatcher is None:
        down.append("processes.json has no 'dispatcher' entry")
    elif not dispatcher.alive:
        down.append(f"dispatcher (pid {dispatcher.pid}) is not running: {dispatcher.state}")
    elif status is None:
        down.append(f"dispatcher (pid {dispatcher.pid}) does not answer: {status_error}")
    if supervisor.state == psutil.STATUS_STOPPED:
        supervisor.problems.append("process stopped")
    thresholds = report.thresholds
    starting = thresholds["run_age_s"] < thresholds["startup_timeout_s"]
    for row in report.processes:
        if row.role in ("supervisor", "dispatcher"):
            continue
        if not row.alive:
            row.problems.append(f"process {row.state}")
        elif status is not None and _worker_status(status, row.role) is None and not status.finished:
            if not starting:
                row.problems.append("not registered with the dispatcher")
        elif row.beacon_problem is not None:
            row.problems.append(row.beacon_problem)
        elif _kind(row.role) == "drafter" and row.phase is not None:
            pass  # its beacon is fresh: a long step is not a silence
        elif row.heartbeat_age_s is not None and row.heartbeat_age_s > thresholds["stale_after_s"]:
            row.problems.append(f"heartbeat {row.heartbeat_age_s:.1f}s old (> {thresholds['stale_after_s']:g}s)")
    degraded = [f"{row.role} (pid {row.pid}): {problem}" for row in report.processes for problem in row.problems]
    report.reasons = down + degraded
    report.level = DOWN if down else DEGRADED if degraded else HEALTHY


# --- text -------------------------------------------------------------------------------------


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


def _num(value: float | int | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_health(report: HealthReport) -> str:
    """A verdict line, one line per reason, then the per-process table."""
    node = f" node {report.node_rank}" if report.node_rank else ""
    lines = [f"{report.run_dir}{node}: {report.level.upper()} (exit {report.exit_code})"]
    lines += [f"  - {reason}" for reason in report.reasons]
    job = report.job
    if job:
        batches = job.get("batches") or {}
        lines.append(f"  job: {batches.get('committed', 0)}/{job.get('num_batches')} batches committed, "
                     f"{job.get('elapsed_s', 0):.0f}s elapsed" + (", finished" if job.get("finished") else ""))
    for path in report.uncommitted_checkpoints:
        lines.append(f"  {UNCOMMITTED_NOTE}: {path}")
    if not report.processes:
        return "\n".join(lines)
    header = ("role", "pid", "state", "rss", "cpu%", "threads", "gpu_mem", "heartbeat", "progress", "batches",
              "phase")
    table = [header]
    for row in report.processes:
        table.append((row.role, str(row.pid), row.state, _size(row.rss_bytes), _num(row.cpu_percent, ".1f"),
                      _num(row.num_threads, ".0f"), _size(row.gpu_memory_bytes),
                      _num(row.heartbeat_age_s, ".1f") + ("s" if row.heartbeat_age_s is not None else ""),
                      _num(row.progress_age_s, ".1f") + ("s ago" if row.progress_age_s is not None else ""),
                      _num(row.batches, ".0f"), row.phase or "-"))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    return "\n".join(lines)
