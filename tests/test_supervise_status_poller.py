"""The supervisor's status poller registers as a trusted observer when it has the job's secret."""

from dflash_ipc.supervise.status_poller import STATUS_RETRY_S, StatusPoller
from dflash_ipc.wire import protocol as p


class FakeLink:
    def __init__(self) -> None:
        self.sent: list = []
        self.inbox: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)

    def recv(self, timeout_s):
        return self.inbox.pop(0) if self.inbox else None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_poller_registers_with_the_secret_before_it_asks_and_again_on_a_retry_or_restart():
    link, clock = FakeLink(), Clock()
    poller = StatusPoller(link, clock, secret=b"s" * 32)
    poller.poll(0.0)
    register, request = link.sent
    assert isinstance(register, p.Register) and (register.role, register.secret) == ("observer", b"s" * 32)
    assert isinstance(request, p.StatusRequest)
    poller.poll(0.0)
    assert len(link.sent) == 2  # the request is still unanswered: nothing more goes out
    clock.now = STATUS_RETRY_S + 1  # unanswered: the Register may have been dropped in a flood
    poller.poll(0.0)
    assert [type(m) for m in link.sent[2:]] == [p.Register, p.StatusRequest]
    poller.forget_dispatcher()  # a restarted dispatcher knows no observer
    poller.poll(0.0)
    assert [type(m) for m in link.sent[4:]] == [p.Register, p.StatusRequest]


def test_without_a_secret_the_poller_only_asks():
    link = FakeLink()
    StatusPoller(link, Clock()).poll(0.0)
    assert [type(m) for m in link.sent] == [p.StatusRequest]
