"""The supervisor (`bin/dflash-up` = `dflash-ipc up`): starts the job, watches it, stops it.

    cfg = resolve_job(load_config(path, overrides))
    Supervisor(cfg).run()        # returns the exit code: 0 when every batch is committed

It writes the resolved config to the run directory, starts the dispatcher, then the targets
and drafters, prints a status line every `dispatch.status_interval_s`, and stops everything
on Ctrl-C/SIGTERM or on the end of the job. On the way out it removes this run's
shared-memory segments and socket file, whatever state the children left them in; on the
way in it removes those a previous supervisor of this run directory left (one killed with
SIGKILL cannot clean up after itself).

Faults:
- A target that dies (non-zero exit or a signal) is started again for the same rank, as a
  new process with a new pid and so a new slot pool, within its `RestartPolicy`
  (`supervise.max_restarts` per `supervise.restart_window_s`, exponential backoff). The
  dispatcher returns the dead target's batches to pending when the new one registers (or
  when its heartbeats stop), so nothing is lost. Past the budget the job fails (exit 1)
  with a message naming the target, its restart count and the window.
- A target that hangs (SIGSTOP, stuck in a CUDA call) is found from the dispatcher's
  status, polled every status interval: its heartbeat is older than
  `dispatch.heartbeat_timeout_s`, or the dispatcher already dropped it as silent, or it
  never registered within `supervise.startup_timeout_s`. It is SIGKILLed and then
  restarted like a dead one.
- A drafter that dies, or hangs (its heartbeat older than `supervise.drafter_timeout_s`, or
  not registered within `supervise.startup_timeout_s`), restarts the drafter group: every
  drafter is SIGKILLed (the survivors' collective group is broken) and all start again, on
  a fresh rendezvous port, within the group's `RestartPolicy`. The dispatcher sees a drafter
  rank register again from a new process, returns every consumed-not-committed batch to
  pending, and the new group resumes from the checkpoint of the last commit.
- A dispatcher that dies, or hangs (no status reply for `dispatch.heartbeat_timeout_s`), is
  started again within its `RestartPolicy`, after the drafters are SIGKILLed (they would
  otherwise go on reading slots and training past what the ledger holds). The new
  dispatcher restores the ledger (every uncommitted batch pending), the targets register
  again with it on their own (`Unregistered` from a new instance), the drafter group
  restarts from its last commit.
- A worker that exits with code 0 got `Shutdown`: the end of the job, not a fault.

Stop: SIGINT/SIGTERM (once) sends SIGTERM to the drafters, which finish their step,
checkpoint and commit together and exit (within `supervise.stop_timeout_s`); then the
dispatcher saves its ledger and everything is stopped. A rerun in the same run directory
resumes from that checkpoint. A second signal stops at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time

from dflash_ipc import protocol as p
from dflash_ipc.config import JobConfig
from dflash_ipc.config_load import dump_config
from dflash_ipc.link import DispatcherLink
from dflash_ipc.supervise.children import Child, stop_children
from dflash_ipc.supervise.restart import RestartPolicy
from dflash_ipc.metric_sinks import MetricSinks, open_sinks
from dflash_ipc.supervise.status_line import StatusLine
from dflash_ipc.transport.slots import unlink_segments

log = logging.getLogger(__name__)

POLL_S = 0.25
STATUS_RETRY_S = 30.0  # ask again if a status request went unanswered this long


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


class Supervisor:
    def __init__(self, cfg: JobConfig, *, print_status=print) -> None:
        self.cfg = cfg
        self.print_status = print_status
        self.children: list[Child] = []
        self.files = cfg.files
        self.config_path = self.files.config
        self._stop_reason: str | None = None
        self.last_status: dict | None = None
        # Restart budgets: one per target rank, one for the drafter group, one for the dispatcher.
        self.policies: dict[str, RestartPolicy] = {}
        self._restart_due: dict[str, float] = {}        # "target/N" | "drafters" | "dispatcher" -> when
        self._status_asked_at: float | None = None      # the StatusRequest still unanswered
        self._last_reply_at: float | None = None        # the dispatcher's last status reply
        self._instance: str | None = None                # the dispatcher process answering
        self._instance_changed_at = 0.0                  # when a restarted one first answered
        self._signals = 0
        self._checkpoint_on_stop = True
        self.sinks = MetricSinks([])
        self.status_line = StatusLine()

    # --- start ----------------------------------------------------------------------------

    def _child(self, stage: str, role: str, rank: int | None, env: dict) -> Child:
        argv = [sys.executable, "-m", "dflash_ipc.cli", stage, "--config", self.config_path]
        if rank is not None:
            argv += ["--rank", str(rank)]
        return Child(role=role, argv=argv, env=env, log_path=self.files.log(role))

    def start(self) -> None:
        os.makedirs(self.cfg.run.run_dir, mode=0o700, exist_ok=True)
        removed = unlink_segments(self.files.segments_prefix)
        if removed:
            log.warning("removed %d shared-memory segments left by an earlier run in %s",
                        removed, self.cfg.run.run_dir)
        dump_config(self.cfg, self.config_path)
        env = dict(os.environ, PYTHONUNBUFFERED="1", DFLASH_IPC_SUPERVISED="1")
        env.update(rendezvous_env(self.cfg, os.environ))
        cpu_workers = sum(d == "cpu" for d in ([self.cfg.target.device_of(r) for r in range(self.cfg.target.num_workers)]
                                               + [self.cfg.drafter.device_of(r) for r in range(self.cfg.drafter.num_workers)]))
        if cpu_workers:
            # Many CPU workers on few cores: one intra-op thread each avoids oversubscription.
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cpu_workers)))
        if self.cfg.run.node_rank == 0:  # one dispatcher per job, on node 0
            self.children.append(self._child("dispatcher", "dispatcher", None, env))
        self.children += [self._child("target", f"target/{r}", r, env) for r in self.cfg.local_ranks("target")]
        self.children += [self._child("drafter", f"drafter/{r}", r, env) for r in self.cfg.local_ranks("drafter")]
        sup = self.cfg.supervise
        roles = [c.role for c in self.children if c.role.startswith("target/")] + ["drafters", "dispatcher"]
        self.policies = {role: RestartPolicy(max_restarts=sup.max_restarts, window_s=sup.restart_window_s,
                                             role="the drafter group" if role == "drafters" else role)
                         for role in roles}
        for child in self.children:
            child.start()
        self._write_processes()

    def _write_processes(self) -> None:
        record = {"supervisor": os.getpid(), "run_dir": self.cfg.run.run_dir, "node_rank": self.cfg.run.node_rank,
                  "processes": [{"role": c.role, "pid": c.pid, "log": c.log_path, "restarts": len(c.restarts)}
                                for c in self.children]}
        tmp = self.files.processes + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, self.files.processes)

    # --- watch ----------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        self._signals += 1
        self._stop_reason = signal.Signals(signum).name

    def request_stop(self, reason: str, *, checkpoint: bool = True) -> None:
        """Stops the job as a signal would (callable from another thread: benches, tests);
        `checkpoint=False` skips the drafters' closing checkpoint (a bench's window end)."""
        self._checkpoint_on_stop = checkpoint
        self._stop_reason = reason

    def run(self) -> int:
        """Starts the job and watches it to the end; returns the process exit code."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        link = None
        try:
            if self.cfg.run.node_rank == 0:  # one writer per job; before any child, so a missing
                self.sinks = open_sinks(self.cfg)  # tracker stops nothing that runs
            self.start()
            link = DispatcherLink(self.cfg.dispatcher_address, identity="observer/supervisor",
                                  heartbeat_interval_s=3600, timeout_s=3600)
            return self._watch(link)
        finally:
            if link is not None:
                link.close()
            self.sinks.close()
            if self._stop_reason and self._signals <= 1 and self._checkpoint_on_stop:
                self._checkpoint_drafters()
            self.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _watch(self, link: DispatcherLink) -> int:
        next_status = time.monotonic() + self.cfg.dispatch.status_interval_s
        dispatcher = self._dispatcher()
        while True:
            # 1) a signal: stop
            if self._stop_reason:
                log.warning("stopping on %s", self._stop_reason)
                return {"SIGINT": 130, "SIGTERM": 143}.get(self._stop_reason, 0)
            # 2) the dispatcher exits 0 once every batch is committed (workers exit 0 on its
            #    Shutdown, just before); any other exit of it is a death (step 3)
            #    On another node: every local worker exits 0 on that Shutdown.
            if dispatcher is not None:
                done = dispatcher.poll() == 0 and "dispatcher" not in self._restart_due
            else:  # (a restarted worker that never registered gets no Shutdown: the file says it)
                done = all(c.poll() == 0 for c in self.children) or self._finished_on_disk()
            if done:
                self._report_status(link, final=True)
                self._wait_workers()
                log.info("job finished" if dispatcher is not None else f"node {self.cfg.run.node_rank} finished")
                return 0
            # 3) deaths: restarted within their policy, else the job fails
            if not self._handle_deaths():
                return 1
            # 4) restarts whose backoff is over
            self._start_due_restarts()
            # 5) status line; workers that hang are killed here and restarted by step 3
            if time.monotonic() >= next_status:
                next_status = time.monotonic() + self.cfg.dispatch.status_interval_s
                status = self._report_status(link)
                if status is not None:
                    self._kill_hung_targets(status)
                    if not self._restart_hung_drafters(status):
                        return 1
                self._kill_hung_dispatcher()
            time.sleep(POLL_S)

    def _finished_on_disk(self) -> bool:
        """The dispatcher's final status says every batch is committed (shared run dir)."""
        try:
            with open(self.files.final_status) as f:
                return bool(json.load(f).get("finished"))
        except (OSError, ValueError):
            return False

    def _dispatcher(self) -> Child | None:
        """The dispatcher's process: on node 0 only."""
        return self.children[0] if self.children and self.children[0].role == "dispatcher" else None

    def _child_of(self, role: str) -> Child:
        return next(c for c in self.children if c.role == role)

    def _drafters(self) -> list[Child]:
        return [c for c in self.children if c.role.startswith("drafter/")]

    def _handle_deaths(self) -> bool:
        """Schedules the restart of each newly dead process; False when the job must fail."""
        for child in self.children:
            code = child.poll()
            if code in (None, 0) or child.role in self._restart_due:
                continue
            if child.role.startswith("drafter/") and ("drafters" in self._restart_due
                                                      or "dispatcher" in self._restart_due):
                continue  # killed by us: its group restarts already
            log.error("%s (pid %d) exited with code %s; see %s", child.role, child.pid, code, child.log_path)
            self._tail_log(child)
            if child.role == "dispatcher":
                if not self._schedule_group("dispatcher", f"the dispatcher exited with code {code}"):
                    return False
                continue
            if child.role.startswith("drafter/"):
                if not self._schedule_group("drafters", f"{child.role} exited with code {code}"):
                    return False
                continue
            policy = self.policies[child.role]
            decision = policy.on_death()
            if not decision.allowed:
                log.error("%s; the job fails", decision.reason)
                return False
            # No process of this rank runs now: whatever /dev/shm holds under its pool name is
            # a dead pool (a SIGKILLed target cannot unlink its own). Readers keep their maps.
            unlink_segments(self.files.pool_name(int(child.role.split("/")[1])) + "-")
            self._restart_due[child.role] = time.monotonic() + decision.delay_s
            log.warning("%s will restart in %.1fs (restart %d of %d allowed per %.0fs)", child.role,
                        decision.delay_s, decision.restarts_in_window, policy.max_restarts, policy.window_s)
        return True

    def _schedule_group(self, key: str, why: str) -> bool:
        """The drafter group ("drafters") or the dispatcher and the drafter group
        ("dispatcher") start again after the policy's backoff; False: the job fails."""
        decision = self.policies[key].on_death()
        if not decision.allowed:
            log.error("%s (%s); the job fails", decision.reason, why)
            return False
        if key == "dispatcher":
            self._restart_due.pop("drafters", None)  # the dispatcher's restart brings them
        # The drafters go first and at once: a broken group must not train on, and after a
        # dispatcher death nothing may read slots the new dispatcher will hand out again.
        drafters = self._drafters()
        for child in drafters:
            child.signal(signal.SIGKILL)
        for child in drafters:
            if child.popen is not None:
                child.popen.wait()
        self._restart_due[key] = time.monotonic() + decision.delay_s
        log.warning("%s: %s will restart in %.1fs (restart %d of %d allowed per %.0fs)", why,
                    "the dispatcher and the drafter group" if key == "dispatcher" else "the drafter group",
                    decision.delay_s, decision.restarts_in_window, self.policies[key].max_restarts,
                    self.policies[key].window_s)
        return True

    def _start_due_restarts(self) -> None:
        now = time.monotonic()
        for key, due in list(self._restart_due.items()):
            if now < due:
                continue
            del self._restart_due[key]
            if key in ("dispatcher", "drafters"):
                self._restart_group(key, now)
                continue
            child = self._child_of(key)
            old_pid = child.pid
            child.restarts.append(now)
            child.start()
            log.warning("restarted %s: pid %d replaces pid %d", key, child.pid, old_pid)
            self._write_processes()

    def _restart_group(self, key: str, now: float) -> None:
        restarted = self._drafters()
        if key == "dispatcher":
            restarted = [self._dispatcher()] + restarted
            self._status_asked_at = self._last_reply_at = None  # the old one's request died with it
        if key == "drafters" and "dispatcher" in self._restart_due:
            return  # the dispatcher's restart brings the drafters too
        # The new group meets one port up (MASTER_PORT + the dispatcher's drafter generation).
        for child in restarted:
            old_pid = child.pid
            child.restarts.append(now)
            child.start()
            log.warning("restarted %s: pid %d replaces pid %d", child.role, child.pid, old_pid)
        self._write_processes()

    def _restart_hung_drafters(self, status: dict) -> bool:
        """Restarts the drafter group if `status` shows one of its processes hung."""
        if "drafters" in self._restart_due or "dispatcher" in self._restart_due:
            return True
        for child in self._drafters():
            seat = status.get("drafters", {}).get(child.role.split("/")[1])
            seated = seat is not None and seat.get("pid") == child.pid
            timeout, startup = self.cfg.supervise.drafter_timeout_s, self.cfg.supervise.startup_timeout_s
            why = None
            if seated and seat["heartbeat_age_s"] > timeout:
                why = f"no heartbeat for {seat['heartbeat_age_s']:.1f}s (supervise.drafter_timeout_s={timeout:g})"
            elif not seated and time.monotonic() - child.started_at > startup:
                why = f"not registered {startup:g}s after its start (supervise.startup_timeout_s)"
            if why:
                log.error("%s (pid %d) hangs: %s", child.role, child.pid, why)
                return self._schedule_group("drafters", f"{child.role} hangs")
        return True

    def _kill_hung_dispatcher(self) -> None:
        """A dispatcher that stops answering status requests is SIGKILLed; step 3 restarts it."""
        dispatcher = self._dispatcher()
        if dispatcher is None or dispatcher.poll() is not None or "dispatcher" in self._restart_due:
            return
        if self._last_reply_at is None or self._last_reply_at < dispatcher.started_at:
            since, limit, what = dispatcher.started_at, self.cfg.supervise.startup_timeout_s, "supervise.startup_timeout_s"
        else:
            since, limit, what = self._last_reply_at, self.cfg.dispatch.heartbeat_timeout_s, "dispatch.heartbeat_timeout_s"
        silent = time.monotonic() - since
        if silent > limit:
            log.error("the dispatcher (pid %d) hangs: no status reply for %.1fs (%s=%g); SIGKILL",
                      dispatcher.pid, silent, what, limit)
            dispatcher.signal(signal.SIGKILL)

    def _kill_hung_targets(self, status: dict) -> None:
        """SIGKILLs every living target that `status` shows hung; step 3 restarts it."""
        for child in self.children:
            if not child.role.startswith("target/") or child.poll() is not None:
                continue
            why = self._hang_reason(child, status)
            if why:
                log.error("%s (pid %d) hangs: %s; SIGKILL", child.role, child.pid, why)
                child.signal(signal.SIGKILL)

    def _hang_reason(self, child: Child, status: dict) -> str | None:
        seat = status.get("targets", {}).get(child.role.split("/")[1])
        seated = seat is not None and seat.get("pid", child.pid) == child.pid
        timeout = self.cfg.dispatch.heartbeat_timeout_s
        if seated and seat["heartbeat_age_s"] > timeout:
            return f"no heartbeat for {seat['heartbeat_age_s']:.1f}s (dispatch.heartbeat_timeout_s={timeout:g})"
        dropped = status.get("dropped_targets", {}).get(str(child.pid))
        if not seated and dropped is not None:
            return f"the dispatcher dropped it ({dropped})"
        startup = self.cfg.supervise.startup_timeout_s
        if not seated and time.monotonic() - max(child.started_at, self._instance_changed_at) > startup:
            return f"not registered {startup:g}s after its start (supervise.startup_timeout_s)"
        return None

    def _report_status(self, link: DispatcherLink, final: bool = False) -> dict | None:
        """Prints the status line; returns the dispatcher's live status (None: no answer)."""
        if final:
            try:
                with open(self.files.final_status) as f:
                    self.last_status = json.load(f)
                for line in self.status_line.final_lines(self.last_status):
                    self.print_status(line)
                self.sinks.write(self.last_status)  # the trackers end where the job did
            except (OSError, ValueError) as exc:
                log.warning("no final status: %s", exc)
            return None
        # One request at a time: requests sent while the dispatcher is still starting queue up
        # in ZMQ and would otherwise be answered in a burst, leaving every later reply read
        # one stale status behind (and hang detection blind for that long).
        now = time.monotonic()
        reply = None
        try:
            if self._status_asked_at is None or now - self._status_asked_at > STATUS_RETRY_S:
                link.send(p.StatusRequest())
                self._status_asked_at = now
            msg = link.recv(1.0)
            while msg is not None:
                if isinstance(msg, p.StatusReply):
                    reply, self._status_asked_at = msg, None
                    self._last_reply_at = time.monotonic()
                    instance = msg.status.get("instance")
                    if self._instance is not None and instance != self._instance:
                        # A new dispatcher (restarted, here or on node 0): targets that
                        # outlived it register again; their registration deadline restarts.
                        self._instance_changed_at = self._last_reply_at
                    self._instance = instance
                msg = link.recv(0.0)
        except Exception as exc:  # the dispatcher may be starting or gone; status is best effort
            log.debug("status request failed: %s", exc)
        if reply is None:
            return None
        self.last_status = reply.status
        for line in self.status_line.lines(reply.status):
            self.print_status(line)
        self.sinks.write(reply.status)
        return reply.status

    def _wait_workers(self) -> None:
        """After the dispatcher's Shutdown the workers exit by themselves; give them time.
        A restarted target that had not registered yet got no Shutdown: stop it now."""
        seated = {t.get("pid") for t in (self.last_status or {}).get("targets", {}).values()}
        unseated = [c for c in self.children if c.role.startswith("target/") and c.restarts
                    and c.poll() is None and c.pid not in seated]
        for child in unseated:
            log.info("%s (pid %d) restarted too late to take part; stopping it", child.role, child.pid)
        stop_children(unseated, self.cfg.supervise.grace_s)
        deadline = time.monotonic() + max(30.0, self.cfg.supervise.grace_s)
        for child in self.children:
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
        bad = [c for c in self.children if c.poll() not in (0, None) and c not in unseated]
        for c in bad:
            log.warning("%s exited with code %s at the end; see %s", c.role, c.poll(), c.log_path)

    @staticmethod
    def _tail_log(child: Child, lines: int = 25) -> None:
        try:
            with open(child.log_path, "rb") as f:
                tail = f.read()[-8000:].decode(errors="replace").splitlines()[-lines:]
            for line in tail:
                log.error("  %s| %s", child.role, line)
        except OSError:
            pass

    # --- stop -----------------------------------------------------------------------------

    def _checkpoint_drafters(self) -> None:
        """SIGTERM to the drafters: they finish the step, checkpoint and commit together, and
        exit. Waits up to `supervise.stop_timeout_s` (a second signal: no longer)."""
        drafters = [c for c in self._drafters() if c.poll() is None]
        dispatcher = self._dispatcher()
        if not drafters or (dispatcher is not None and dispatcher.poll() is not None):
            return
        log.warning("asking %d drafters to checkpoint before the stop (up to %.0fs; a second "
                    "Ctrl-C stops at once)", len(drafters), self.cfg.supervise.stop_timeout_s)
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
        """Stops every child and removes what they might have left: idempotent."""
        stop_children(self.children, self.cfg.supervise.grace_s)
        removed = unlink_segments(self.files.segments_prefix)
        if removed:
            log.warning("removed %d leftover shared-memory segments", removed)
        address = self.cfg.dispatcher_address
        if address.startswith("ipc://"):
            try:
                os.unlink(address[len("ipc://"):])
            except FileNotFoundError:
                pass
