"""The supervisor (`bin/dflash-up` = `dflash-ipc up`): starts the job, watches it, stops it.

    cfg = resolve_job(load_config(path, overrides))
    Supervisor(cfg).run()        # returns the exit code: 0 when every batch is committed

It writes the resolved config to the run directory, starts the dispatcher (node 0), the
targets and the drafters, and then loops: (1) a signal stops; (2) the dispatcher's exit 0
ends the job; (3) it polls the children, reads the drafters' liveness beacons and, every
`dispatch.status_interval_s`, the dispatcher's status (printed, and sent to the metric
sinks); (4) `SupervisorLogic` (decisions.py) says what to do about deaths and hangs, and
this class does it. On the way in and out it removes this run's shared-memory segments and
socket file, whatever the children left (one killed with SIGKILL cannot clean up).

Stop: SIGINT/SIGTERM (once) sends SIGTERM to the drafters, which finish their step,
checkpoint and commit together and exit (within `supervise.stop_timeout_s`); then the
dispatcher saves its ledger and everything is stopped. A rerun in the same run directory
resumes from that checkpoint. A second signal stops at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from typing import TextIO

from dflash_ipc.config.schema import JobConfig
from dflash_ipc.config.load import dump_config
from dflash_ipc.run.checkpoints import CheckpointStore
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.run.json_files import write_json_atomic
from dflash_ipc.run.process_start import start_ticks
from dflash_ipc.wire.link import DispatcherLink
from dflash_ipc.run.liveness import read_beacon
from dflash_ipc.run.logs import tail_lines
from dflash_ipc.obs.job_sinks import open_sinks
from dflash_ipc.obs.step_log import StepLogTail
from dflash_ipc.obs.sinks import MetricSinks
from dflash_ipc.run.child_env import SUPERVISOR_ENV
from dflash_ipc.supervise.children import Child, stop_children
from dflash_ipc.supervise.decisions import (ChildView, Died, Fail, Kill, KillDrafters, KillWorker, Scheduled,
                                            Start, SupervisorLogic, SweepPool)
from dflash_ipc.supervise.roles import DISPATCHER, Role
from dflash_ipc.run.lock import RunLock
from dflash_ipc.supervise.run_dir_claim import claim_run_dir
from dflash_ipc.obs.status_line import StatusLine
from dflash_ipc.obs.status_writer import InterruptOnLog, StatusWriter
from dflash_ipc.supervise.status_poller import StatusPoller
from dflash_ipc.wire.status import JobStatus, read_status_file
from dflash_ipc.supervise.target_groups import WorkerAddresses
from dflash_ipc.transport.backends import unlink_segments
from dflash_ipc.wire.security import curve_required, ensure_job_secret, ensure_keys, read_job_secret

log = logging.getLogger(__name__)

POLL_S = 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_env(cfg: JobConfig, environ) -> dict:
    """MASTER_ADDR/MASTER_PORT for the drafter group (generation g meets at MASTER_PORT + g).
    One node: loopback and a free port unless set. Several nodes: every node must agree, so
    torchrun's variables as given, else the dispatcher's host and its port + 1."""
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if cfg.run.num_nodes == 1:
        return {"MASTER_ADDR": addr or "127.0.0.1", "MASTER_PORT": port or str(_free_port())}
    host, _, dispatcher_port = cfg.dispatch.address[len("tcp://"):].rpartition(":")
    return {"MASTER_ADDR": addr or host.strip("[]"), "MASTER_PORT": port or str(int(dispatcher_port) + 1)}


def quarantine_uncommitted_checkpoints(cfg: JobConfig) -> list[str]:
    """Checkpoints newer than the ledger's last commit were written but never committed (a
    supervisor killed between the two): moved aside, so nothing ever resumes from them."""
    from dflash_ipc.dispatch.ledger_file import load_ledger, remove_partial_saves
    remove_partial_saves(cfg.files.ledger)  # under the run lock: no dispatcher of this run lives
    store = CheckpointStore(cfg.files.checkpoints)
    if not os.path.exists(cfg.files.ledger):
        store.remove_partial_writes()
        return []
    last = load_ledger(cfg.files.ledger, recover=False).last_committed_step()
    return store.quarantine_after(last)


class Supervisor:
    def __init__(self, cfg: JobConfig, *, status_out: TextIO | None = None, run_lock: RunLock | None = None) -> None:
        """`status_out`: where the status goes (default stdout): on a terminal one block
        rewritten in place, elsewhere one line per status interval (obs/status_writer.py).
        `run_lock`: the run directory's, when the caller claimed it already (`claim_run_dir`)."""
        self.cfg = cfg
        self.files = cfg.files
        self.status_writer = StatusWriter(sys.stdout if status_out is None else status_out)
        self.children: dict[Role, Child] = {}
        self.logic: SupervisorLogic | None = None
        self._stop_reason: str | None = None
        self.last_status: JobStatus | None = None
        self._signals = 0
        self._checkpoint_on_stop = True
        self.sinks = MetricSinks([])
        self.step_log: StepLogTail | None = None  # node 0: the drafter's step records, to the trackers
        self.status_line = StatusLine()
        self.worker_addresses = WorkerAddresses(cfg.target.gpus_per_worker, _free_port)
        self.run_lock = run_lock or RunLock(cfg.run.run_dir, cfg.run.node_rank)

    # --- start ----------------------------------------------------------------------------

    def _child(self, role: Role, env: dict) -> Child:
        argv = [sys.executable, "-m", "dflash_ipc.cli", role.kind, "--config", self.files.config]
        if role.rank is not None:
            argv += ["--rank", str(role.rank)]
        if role.tp_rank:
            argv += ["--tp-rank", str(role.tp_rank)]
        return Child(role=role, argv=argv, env=env, log_path=self.files.log(str(role)),
                     keep_fds=(self.run_lock.fd,) if self.run_lock.fd is not None else ())

    def roles(self) -> list[Role]:
        """This node's processes: the dispatcher (node 0), its targets, its drafters."""
        roles = [DISPATCHER] if self.cfg.run.node_rank == 0 else []
        roles += [Role("target", r, k) for r in self.cfg.local_ranks("target")
                  for k in range(self.cfg.target.gpus_per_worker)]
        return roles + [Role("drafter", r) for r in self.cfg.local_ranks("drafter")]

    def claim(self) -> None:
        """The devices, then the run directory's lock (`claim_run_dir`), unless held already."""
        if self.run_lock.fd is None:
            self.run_lock = claim_run_dir(self.cfg)

    def start(self) -> None:
        self.claim()
        removed = unlink_segments(self.files.segments_prefix)
        if removed:
            log.warning("removed %d shared-memory segments left by an earlier run in %s", removed, self.cfg.run.run_dir)
        if self.cfg.run.node_rank == 0:
            quarantine_uncommitted_checkpoints(self.cfg)
            if curve_required(self.cfg.dispatch.auth, self.cfg.dispatcher_address):
                ensure_keys(self.files.curve_keys)
            ensure_job_secret(self.files.job_secret)  # before any child: each reads it to register
        dump_config(self.cfg, self.files.config)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{SUPERVISOR_ENV: str(os.getpid())})
        env.update(rendezvous_env(self.cfg, os.environ))
        roles = self.roles()
        cpu_workers = sum(self._device(r) == "cpu" for r in roles if r.kind != "dispatcher")
        if cpu_workers:
            # Many CPU workers on few cores: one intra-op thread each avoids oversubscription.
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cpu_workers)))
        self.children = {role: self._child(role, env) for role in roles}
        self.logic = SupervisorLogic(self.cfg, roles, clock=time.monotonic)
        for child in self.children.values():
            self._start_child(child)
        self._write_processes()

    def _start_child(self, child: Child) -> None:
        # A multi-process target worker's processes meet at a new address on every start.
        child.env.update(self.worker_addresses.env(child.role, len(child.restarts)))
        child.start()

    def _device(self, role: Role) -> str:
        if role.kind == "target":
            return self.cfg.target.devices_of(role.rank)[role.tp_rank]
        return self.cfg.drafter.device_of(role.rank)

    def _write_processes(self) -> None:
        # start_ticks: each process's start in clock ticks since boot (run/process_start.py), by
        # which health tells it from a later process that reused its pid, whatever the wall clock did
        record = {"supervisor": os.getpid(), "supervisor_start_ticks": start_ticks(os.getpid()),
                  "run_dir": self.cfg.run.run_dir, "node_rank": self.cfg.run.node_rank,
                  "processes": [{"role": str(c.role), "pid": c.pid, "start_ticks": start_ticks(c.pid),
                                 "log": c.log_path, "restarts": len(c.restarts)}
                                for c in self.children.values()]}
        write_json_atomic(self.files.processes, record)

    # --- watch ----------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        self._signals += 1
        self._stop_reason = signal.Signals(signum).name

    def request_stop(self, reason: str, *, checkpoint: bool = True) -> None:
        """Stops the job as a signal would (callable from another thread: benches, tests);
        `checkpoint=False` skips the drafters' closing checkpoint (a bench's window end)."""
        self._checkpoint_on_stop = checkpoint
        self._stop_reason = reason

    def _observer_secret(self) -> bytes | None:
        """The job's secret, for the status poller: with it the dispatcher trusts the poller and
        answers it whatever strangers send. None (one warning) where this node lacks it: its
        children then fail to register and say why."""
        try:
            return read_job_secret(self.files.job_secret)
        except ConfigError as exc:
            log.warning("status polls go untrusted: %s", exc)
            return None

    def run(self) -> int:
        """Starts the job and watches it to the end; returns the process exit code."""
        self.claim()  # outside the try: a refused job must not clean up the job that holds the lock
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        # A log line between two status blocks keeps the older block from being drawn over it.
        log_watch = InterruptOnLog(self.status_writer)
        logging.getLogger().addHandler(log_watch)
        link = None
        try:
            if self.cfg.run.node_rank == 0:  # one writer per job; before any child, so a missing
                self.sinks = open_sinks(self.cfg)  # tracker stops nothing that runs
                self.step_log = StepLogTail(self.files.drafter_metrics)  # from its end: older steps were written
            self.start()
            link = DispatcherLink.for_job(self.cfg, "observer/supervisor", heartbeat_interval_s=3600, timeout_s=3600)
            return self._watch(StatusPoller(link, secret=self._observer_secret()))
        finally:
            if link is not None:
                link.close()
            try:
                if self._stop_reason and self._signals <= 1 and self._checkpoint_on_stop:
                    self._checkpoint_drafters()
                elif self._stop_reason and not self._checkpoint_on_stop:
                    # No closing checkpoint asked for: the SIGTERM of stop() would have the
                    # drafters checkpoint all the same, then wait (COMMIT_CONFIRM_S) for a commit
                    # the dispatcher, stopped with them, never confirms.
                    self._kill_drafters()
                self.stop()
            finally:
                # Last: a tracker's close (wandb uploads) must not delay the drafters' checkpoint.
                self.sinks.close()
                self.run_lock.release()
                logging.getLogger().removeHandler(log_watch)
                for s, handler in previous.items():
                    signal.signal(s, handler)

    def _watch(self, poller: StatusPoller) -> int:
        next_status = time.monotonic() + self.cfg.dispatch.status_interval_s
        while True:
            # 1) a signal: stop
            if self._stop_reason:
                log.warning("stopping on %s", self._stop_reason)
                return {"SIGINT": 130, "SIGTERM": 143}.get(self._stop_reason, 0)
            # 2) the end of the job
            if self._job_done():
                self._final_status()
                self._wait_workers()
                log.info("job finished" if DISPATCHER in self.children else f"node {self.cfg.run.node_rank} finished")
                return 0
            # 3) what is going on
            status = None
            if time.monotonic() >= next_status:
                next_status = time.monotonic() + self.cfg.dispatch.status_interval_s
                status = self._report_status(poller)
            # 4) decisions, carried out
            actions = self.logic.step(time.monotonic(), self._views(), status=status, beacons=self._beacons(),
                                      wall_now=time.time(), dispatcher_replied_at=poller.replied_at,
                                      dispatcher_changed_at=poller.instance_changed_at)
            for action in actions:
                if isinstance(action, Fail):
                    log.error("%s; the job fails", action.reason)
                    return 1
                self._carry_out(action, poller)
            time.sleep(POLL_S)

    def _job_done(self) -> bool:
        """The dispatcher exits 0 once every batch is committed (workers exit 0 on its
        Shutdown, just before); on another node: every local worker exited 0, or the
        dispatcher's final status says so (a restarted worker that never registered)."""
        dispatcher = self.children.get(DISPATCHER)
        if dispatcher is not None:
            return dispatcher.poll() == 0 and not self.logic.busy_restarting("dispatcher")
        return all(c.poll() == 0 for c in self.children.values()) or self._finished_on_disk()

    def _views(self) -> list[ChildView]:
        return [ChildView(role=c.role, pid=c.pid, exit_code=c.poll(), started_at=c.started_at)
                for c in self.children.values()]

    def _beacons(self) -> dict:
        return {role: read_beacon(self.files.beacon(str(role))) for role in self.children if role.kind == "drafter"}

    def _carry_out(self, action, poller: StatusPoller) -> None:
        if isinstance(action, Died):
            self._tail_log(self.children[action.role])
        elif isinstance(action, Kill):
            child = self.children[action.role]
            log.error("%s (pid %d) hangs: %s; SIGKILL", action.role, child.pid, action.reason)
            child.signal(signal.SIGKILL)
        elif isinstance(action, KillDrafters):
            self._kill_drafters()
        elif isinstance(action, KillWorker):
            # Its group is broken: the other processes must not wait in a collective for ever.
            members = [c for c in self.children.values() if c.role.kind == "target" and c.role.rank == action.rank]
            for child in members:
                child.signal(signal.SIGKILL)
            for child in members:
                if child.popen is not None:
                    child.popen.wait()
            log.warning("target/%d: all %d processes of the worker stopped (%s)", action.rank, len(members),
                        action.reason)
        elif isinstance(action, SweepPool):
            # No process of this rank runs now: whatever /dev/shm holds under its pool name is
            # a dead pool. Readers keep their maps.
            unlink_segments(self.files.pool_name(action.target_rank) + "-")
        elif isinstance(action, Scheduled):
            who = {"drafters": "the drafter group restarts",
                   "dispatcher": "the dispatcher and the drafter group restart"}.get(action.key, f"{action.key} restarts")
            log.warning("%s: %s in %.1fs (restart %d of %d allowed per %.0fs)", action.reason, who,
                        action.delay_s, action.restarts_in_window, action.max_restarts, action.window_s)
        elif isinstance(action, Start):
            child = self.children[action.role]
            if action.role == DISPATCHER:
                poller.forget_dispatcher()
            old_pid = child.pid
            child.restarts.append(time.monotonic())
            self._start_child(child)
            log.warning("restarted %s: pid %d replaces pid %s", action.role, child.pid, old_pid)
            self._write_processes()

    def _kill_drafters(self) -> None:
        """SIGKILL every drafter, and reap them."""
        drafters = [c for c in self.children.values() if c.role.kind == "drafter"]
        for child in drafters:
            child.signal(signal.SIGKILL)
        for child in drafters:
            if child.popen is not None:
                child.popen.wait()

    def _finished_on_disk(self) -> bool:
        """The dispatcher's final status says every batch is committed (shared run dir)."""
        try:
            return read_status_file(self.files.final_status).finished
        except DataError:  # not there yet, torn, or not a status
            return False

    def _report_status(self, poller: StatusPoller) -> JobStatus | None:
        """Shows the status and feeds the sinks; returns the live status (None: no answer)."""
        status = poller.poll()
        if status is None:
            return None
        self.last_status = status
        self.status_writer.show(self.status_line.lines(status))
        self._forward_steps()
        self.sinks.write(status)
        return status

    def _forward_steps(self) -> None:
        """The drafter's step records since the last poll: the trackers' per-step scalars."""
        if self.step_log is not None:
            self.sinks.write_steps(self.step_log.read())

    def _final_status(self) -> None:
        self._forward_steps()  # the last steps' records, before the final status
        try:
            self.last_status = read_status_file(self.files.final_status)
            self.status_writer.show(self.status_line.final_lines(self.last_status))
            self.sinks.write(self.last_status)  # the trackers end where the job did
        except DataError as exc:  # missing, damaged, or not a status
            log.warning("no final status: %s", exc)

    def _wait_workers(self) -> None:
        """After the dispatcher's Shutdown the workers exit by themselves; give them time.
        A restarted target that had not registered yet got no Shutdown: stop it now."""
        seated = {t.pid for t in self.last_status.targets.values()} if self.last_status else set()
        unseated = [c for c in self.children.values() if c.role.kind == "target" and c.restarts
                    and c.poll() is None and c.pid not in seated]
        for child in unseated:
            log.info("%s (pid %d) restarted too late to take part; stopping it", child.role, child.pid)
        stop_children(unseated, self.cfg.supervise.grace_s)
        deadline = time.monotonic() + max(30.0, self.cfg.supervise.grace_s)
        for child in self.children.values():
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
        for c in self.children.values():
            if c.poll() not in (0, None) and c not in unseated:
                log.warning("%s exited with code %s at the end; see %s", c.role, c.poll(), c.log_path)

    @staticmethod
    def _tail_log(child: Child, lines: int = 25) -> None:
        log.error("%s (pid %s) exited with code %s; see %s", child.role, child.pid, child.poll(), child.log_path)
        try:
            for line in tail_lines(child.log_path, lines):
                log.error("  %s| %s", child.role, line)
        except OSError:
            pass

    # --- stop -----------------------------------------------------------------------------

    def _checkpoint_drafters(self) -> None:
        """SIGTERM to the drafters: they finish the step, checkpoint and commit together, and
        exit. Waits up to `supervise.stop_timeout_s` (a second signal: no longer)."""
        drafters = [c for c in self.children.values() if c.role.kind == "drafter" and c.poll() is None]
        dispatcher = self.children.get(DISPATCHER)
        if not drafters or (dispatcher is not None and dispatcher.poll() is not None):
            return
        log.warning("asking %d drafters to checkpoint before the stop (up to %.0fs; a second Ctrl-C stops at once)",
                    len(drafters), self.cfg.supervise.stop_timeout_s)
        for child in drafters:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.supervise.stop_timeout_s
        while time.monotonic() < deadline and self._signals <= 1:
            if all(c.poll() is not None for c in drafters):
                log.info("drafters checkpointed and exited")
                return
            time.sleep(POLL_S)
        log.warning("drafters did not finish their checkpoint; stopping them")

    def stop(self) -> None:
        """Stops every child and removes what they might have left: idempotent. Called only
        by `run`, after `claim` took the run directory's lock: its segments and socket are ours."""
        stop_children(list(self.children.values()), self.cfg.supervise.grace_s)
        removed = unlink_segments(self.files.segments_prefix)
        if removed:
            log.warning("removed %d leftover shared-memory segments", removed)
        address = self.cfg.dispatcher_address
        if address.startswith("ipc://"):
            try:
                os.unlink(address[len("ipc://"):])
            except FileNotFoundError:
                pass
