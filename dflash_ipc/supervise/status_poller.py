"""The supervisor's view of the dispatcher: its status, asked one request at a time.

Requests sent while the dispatcher is still starting would queue up in ZMQ and be answered
in a burst, leaving every later reply read one stale status behind (and hang detection
blind for that long); so a new request goes out only when the last was answered, or after
`STATUS_RETRY_S`. The poller also notes when the answering dispatcher process changed (a
restarted one): targets that outlived it register again, their deadline starts over.

With the job's secret, the poller registers as a trusted observer before it asks (again after a
dispatcher restart, and with every retry): the dispatcher then answers it past the budgets that
bound strangers, so a flood of local connections cannot keep the status from the supervisor
(which would read the silence as a hung dispatcher and kill it).
"""

from __future__ import annotations

import logging
import os
import time

from dflash_ipc.wire import protocol as p
from dflash_ipc.wire.status import JobStatus

log = logging.getLogger(__name__)

STATUS_RETRY_S = 30.0  # ask again if a status request went unanswered this long


class StatusPoller:
    def __init__(self, link, clock=time.monotonic, *, secret: bytes | None = None) -> None:
        self.link = link
        self.clock = clock
        self.secret = secret                     # the job's: register as a trusted observer
        self.registered = False                  # the Register went out to this dispatcher
        self.asked_at: float | None = None       # the request still unanswered
        self.replied_at: float | None = None     # the dispatcher's last reply
        self.instance: str | None = None         # the dispatcher process answering
        self.instance_changed_at = 0.0           # when a restarted one first answered

    def forget_dispatcher(self) -> None:
        """The dispatcher restarts: the old one's request died with it."""
        self.asked_at = self.replied_at = None
        self.registered = False  # a restarted dispatcher knows no observer

    def poll(self, wait_s: float = 1.0) -> JobStatus | None:
        """The latest status, or None when no answer came within `wait_s`."""
        now = self.clock()
        reply = None
        try:
            if self.asked_at is None or now - self.asked_at > STATUS_RETRY_S:
                if self.secret is not None and (not self.registered or self.asked_at is not None):
                    # first, and with each retry: a Register dropped in a flood is sent again
                    self.link.send(p.Register(role="observer", rank=0, pid=os.getpid(), secret=self.secret))
                    self.registered = True
                self.link.send(p.StatusRequest())
                self.asked_at = now
            msg = self.link.recv(wait_s)
            while msg is not None:
                if isinstance(msg, p.StatusReply):
                    reply = msg.status
                    self._replied(reply.instance)
                msg = self.link.recv(0.0)
        except Exception as exc:  # the dispatcher may be starting or gone; status is best effort
            log.debug("status request failed: %s", exc)
        return reply

    def _replied(self, instance: str | None) -> None:
        self.asked_at, self.replied_at = None, self.clock()
        if self.instance is not None and instance != self.instance:
            self.instance_changed_at = self.replied_at
            self.registered = False  # answered by a restarted dispatcher: register with it
        self.instance = instance
