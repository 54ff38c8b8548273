"""The supervisor (`bin/dflash-up` = `dflash-ipc up`): starts the job, watches it, stops it.

    cfg = resolve_job(load_config(path, overrides))
    Supervisor(cfg).run()        # returns the exit code: 0 when every batch is committed

It writes the resolved config to the run directory, starts the dispatcher, then the targets
and drafters, prints a status line every `dispatch.status_interval_s`, and stops everything
on Ctrl-C/SIGTERM, on the end of the job, or when a worker dies (restarts are issue #5's
policy: `supervise.max_restarts`). On the way out it removes this run's shared-memory
segments and socket file, whatever state the children left them in.
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
from dflash_ipc.config import JobConfig, dump_config
from dflash_ipc.dispatch.proc import final_status_path
from dflash_ipc.link import DispatcherLink
from dflash_ipc.runinfo import logs_dir, processes_path, resolved_config_path, shm_prefix
from dflash_ipc.supervise.children import Child, stop_children
from dflash_ipc.supervise.status_line import format_status
from dflash_ipc.transport.slots import unlink_segments

log = logging.getLogger(__name__)

POLL_S = 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Supervisor:
    def __init__(self, cfg: JobConfig, *, print_status=print) -> None:
        self.cfg = cfg
        self.print_status = print_status
        self.children: list[Child] = []
        self.config_path = resolved_config_path(cfg.run.run_dir)
        self._stop_reason: str | None = None
        self.last_status: dict | None = None

    # --- start ----------------------------------------------------------------------------

    def _child(self, stage: str, role: str, rank: int | None, env: dict) -> Child:
        argv = [sys.executable, "-m", "dflash_ipc.cli", stage, "--config", self.config_path]
        if rank is not None:
            argv += ["--rank", str(rank)]
        log_name = role.replace("/", "-") + ".log"
        return Child(role=role, argv=argv, env=env, log_path=os.path.join(logs_dir(self.cfg), log_name))

    def start(self) -> None:
        os.makedirs(self.cfg.run.run_dir, mode=0o700, exist_ok=True)
        dump_config(self.cfg, self.config_path)
        env = dict(os.environ, PYTHONUNBUFFERED="1", DFLASH_IPC_SUPERVISED="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env["MASTER_PORT"] = env.get("MASTER_PORT") or str(_free_port())
        cpu_workers = sum(d == "cpu" for d in ([self.cfg.target.device_of(r) for r in range(self.cfg.target.num_workers)]
                                               + [self.cfg.drafter.device_of(r) for r in range(self.cfg.drafter.num_workers)]))
        if cpu_workers:
            # Many CPU workers on few cores: one intra-op thread each avoids oversubscription.
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cpu_workers)))
        self.children.append(self._child("dispatcher", "dispatcher", None, env))
        self.children += [self._child("target", f"target/{r}", r, env) for r in range(self.cfg.target.num_workers)]
        self.children += [self._child("drafter", f"drafter/{r}", r, env) for r in range(self.cfg.drafter.num_workers)]
        for child in self.children:
            child.start()
        self._write_processes()

    def _write_processes(self) -> None:
        record = {"supervisor": os.getpid(), "run_dir": self.cfg.run.run_dir,
                  "processes": [{"role": c.role, "pid": c.pid, "log": c.log_path} for c in self.children]}
        tmp = processes_path(self.cfg) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, processes_path(self.cfg))

    # --- watch ----------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        self._stop_reason = signal.Signals(signum).name

    def run(self) -> int:
        """Starts the job and watches it to the end; returns the process exit code."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        link = None
        try:
            self.start()
            link = DispatcherLink(self.cfg.dispatcher_address, identity="observer/supervisor",
                                  heartbeat_interval_s=3600, timeout_s=3600)
            return self._watch(link)
        finally:
            if link is not None:
                link.close()
            self.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _watch(self, link: DispatcherLink) -> int:
        next_status = time.monotonic() + self.cfg.dispatch.status_interval_s
        dispatcher = self.children[0]
        while True:
            if self._stop_reason:
                log.warning("stopping on %s", self._stop_reason)
                return 130 if self._stop_reason == "SIGINT" else 143
            code = dispatcher.poll()
            if code == 0:
                self._report_status(link, final=True)
                self._wait_workers()
                log.info("job finished")
                return 0
            # A clean exit (0) is a worker that got Shutdown; the dispatcher follows it.
            dead = [c for c in self.children if c.poll() not in (None, 0)]
            if dead:
                c = dead[0]
                log.error("%s (pid %d) exited with code %s; see %s", c.role, c.pid, c.poll(), c.log_path)
                self._tail_log(c)
                return 1
            if time.monotonic() >= next_status:
                next_status += self.cfg.dispatch.status_interval_s
                self._report_status(link)
            time.sleep(POLL_S)

    def _report_status(self, link: DispatcherLink, final: bool = False) -> None:
        if final:
            try:
                with open(final_status_path(self.cfg)) as f:
                    self.last_status = json.load(f)
                self.print_status(format_status(self.last_status, final=True))
            except (OSError, ValueError) as exc:
                log.warning("no final status: %s", exc)
            return
        try:
            link.send(p.StatusRequest())
            reply = link.recv(1.0)
        except Exception as exc:  # the dispatcher may be starting or gone; status is best effort
            log.debug("status request failed: %s", exc)
            return
        if isinstance(reply, p.StatusReply):
            self.last_status = reply.status
            self.print_status(format_status(reply.status))

    def _wait_workers(self) -> None:
        """After the dispatcher's Shutdown the workers exit by themselves; give them time."""
        deadline = time.monotonic() + max(30.0, self.cfg.supervise.grace_s)
        for child in self.children:
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
        bad = [c for c in self.children if c.poll() not in (0, None)]
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

    def stop(self) -> None:
        """Stops every child and removes what they might have left: idempotent."""
        stop_children(self.children, self.cfg.supervise.grace_s)
        removed = unlink_segments(shm_prefix(self.cfg))
        if removed:
            log.warning("removed %d leftover shared-memory segments", removed)
        address = self.cfg.dispatcher_address
        if address.startswith("ipc://"):
            try:
                os.unlink(address[len("ipc://"):])
            except FileNotFoundError:
                pass
