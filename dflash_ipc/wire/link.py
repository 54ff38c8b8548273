"""A worker's connection to the dispatcher: one ZMQ DEALER socket, typed messages, heartbeats.

Liveness is a counter in the style of circus/locust: every message from the dispatcher
resets it; if nothing was heard for `timeout_s`, `check()` raises `WorkerDeadError` and the
worker exits (the supervisor then decides what to do). Workers send a `Heartbeat` every
`heartbeat_interval_s` carrying their metrics; the dispatcher answers each one, so a quiet
but healthy link still proves both sides alive.

Registration: the `Registered` reply names the dispatcher's `instance`. A later
`Unregistered` from another instance means the dispatcher restarted (`DispatcherRestarted`:
register again); from the same instance, that it dropped this worker (`WorkerDeadError`).
Replies are in request order, so `Unregistered` answers to messages sent before a
`Register` all arrive before its `Registered` and are skipped there.
"""

from __future__ import annotations

import logging
import os
import secrets
import time

import zmq

from dflash_ipc.wire import protocol as p
from dflash_ipc.errors import DispatcherRestarted, ProtocolError, WorkerDeadError
from dflash_ipc.wire.security import client_security

log = logging.getLogger(__name__)


class DispatcherLink:
    def __init__(self, address: str, *, identity: str, heartbeat_interval_s: float = 1.0,
                 timeout_s: float = 30.0, context: zmq.Context | None = None, secure=None) -> None:
        """`secure(socket)` sets the socket's credentials before it connects (CURVE)."""
        self.address = address
        # The random tail: a seat is known by its holder's identity, so a peer that could
        # guess one (role, rank and pid are in every status) could connect under it after
        # a worker's disconnect and speak for its seat without registering.
        self.identity = f"{identity}/{os.getpid()}/{secrets.token_hex(8)}".encode()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.timeout_s = timeout_s
        self._context = context or zmq.Context.instance()
        self.socket = self._context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, self.identity)
        self.socket.setsockopt(zmq.LINGER, 0)
        if secure is not None:
            secure(self.socket)
        self.socket.connect(address)
        self.last_heard = time.monotonic()
        # The first heartbeat waits one interval: a short-lived observer (status, health) must
        # not send one, the dispatcher would refuse it from an unregistered sender.
        self._last_beat = time.monotonic()
        self.metrics: dict[str, float] = {}
        self.instance: str | None = None  # the dispatcher we are registered with
        self._registering = False

    @classmethod
    def for_job(cls, cfg, identity: str, *, heartbeat_interval_s: float | None = None,
                timeout_s: float | None = None) -> "DispatcherLink":
        """A link to the job's dispatcher, with the job's credentials on tcp://."""
        address = cfg.dispatcher_address
        return cls(address, identity=identity,
                   heartbeat_interval_s=heartbeat_interval_s or cfg.dispatch.heartbeat_interval_s,
                   timeout_s=timeout_s or cfg.dispatch.heartbeat_timeout_s,
                   secure=lambda socket: client_security(cfg, socket, address))

    def send(self, msg: p.Message) -> None:
        self.socket.send_multipart(p.encode(msg))

    def recv(self, timeout_s: float) -> p.Message | None:
        """The next message that is not a heartbeat reply, or None after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.beat()
            remaining = max(0.0, deadline - time.monotonic())
            if not self.socket.poll(int(min(remaining, self.heartbeat_interval_s) * 1000)):
                if time.monotonic() >= deadline:
                    self.check()
                    return None
                continue
            frames = self.socket.recv_multipart()
            self.last_heard = time.monotonic()
            try:
                msg = p.decode(frames)
            except ProtocolError as exc:
                log.error("dropped undecodable message from the dispatcher: %s", exc)
                continue
            if isinstance(msg, p.Heartbeat):
                continue
            if isinstance(msg, (p.Registered, p.Refused)):
                self.instance = msg.instance if isinstance(msg, p.Registered) else self.instance
                self._registering = False
            if isinstance(msg, p.Unregistered):
                if self._registering or self.instance is None:
                    continue  # an answer to something sent before our Register
                if msg.instance != self.instance:
                    raise DispatcherRestarted(f"the dispatcher at {self.address} restarted "
                                              f"(instance {self.instance} -> {msg.instance})")
                raise WorkerDeadError(f"the dispatcher dropped this worker: {msg.reason}")
            if isinstance(msg, p.Rejected):
                log.error("dispatcher rejected our %s: %s", p.Kind(msg.kind).name if msg.kind in
                          p.Kind._value2member_map_ else msg.kind, msg.reason)
                continue
            return msg

    def request(self, msg: p.Message, timeout_s: float) -> p.Message:
        """Sends `msg` and waits for the next real reply; WorkerDeadError on silence."""
        self._registering = isinstance(msg, p.Register)
        self.send(msg)
        reply = self.recv(timeout_s)
        if reply is None:
            raise WorkerDeadError(f"no reply from the dispatcher at {self.address} within {timeout_s:.0f}s")
        return reply

    def beat(self, force: bool = False) -> None:
        """A heartbeat with `metrics` when one is due (`force`: now, e.g. a drafter's last step)."""
        now = time.monotonic()
        if force or now - self._last_beat >= self.heartbeat_interval_s:
            self._last_beat = now
            self.send(p.Heartbeat(metrics=dict(self.metrics)))

    def check(self) -> None:
        silent = time.monotonic() - self.last_heard
        if silent > self.timeout_s:
            raise WorkerDeadError(f"dispatcher at {self.address} silent for {silent:.1f}s")

    def close(self) -> None:
        self.socket.close(linger=0)
