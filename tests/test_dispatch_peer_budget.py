"""The budget of peers without a seat and the status answers, stepped with a fake clock."""

from dflash_ipc.dispatch.peer_budget import PeerBudget, StatusAnswers, Verdict


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_over_its_budget_is_dropped_counted_and_flagged_once_per_window():
    clock = Clock()
    budget = PeerBudget(frames=3, nbytes=100, window_s=1.0, clock=clock)
    assert [budget.admit(b"a", 10) for _ in range(5)] == [Verdict.ADMIT] * 3 + [Verdict.DROP_FIRST, Verdict.DROP]
    assert budget.admit(b"b", 10) is Verdict.ADMIT  # another peer has its own budget
    assert budget.admit(b"c", 101) is Verdict.DROP_FIRST  # bytes count too: one large frame
    clock.now = 1.0  # a new window: a fresh budget
    assert budget.admit(b"a", 10) is Verdict.ADMIT
    assert budget.dropped == 3


def test_peers_past_the_table_share_one_budget():
    budget = PeerBudget(frames=2, nbytes=10**6, window_s=1.0, max_peers=2, clock=Clock())
    assert budget.admit(b"a", 1) is budget.admit(b"b", 1) is Verdict.ADMIT
    verdicts = [budget.admit(b"new%d" % i, 1) for i in range(4)]  # thousands of connections
    assert verdicts == [Verdict.ADMIT, Verdict.ADMIT, Verdict.DROP_FIRST, Verdict.DROP]
    assert len(budget._spent) == 3


def test_status_requests_coalesce_per_peer_and_are_answered_at_most_once_per_interval():
    clock = Clock()
    answers = StatusAnswers(interval_s=0.2, max_waiting=2, clock=clock)
    for _ in range(1000):
        answers.ask(b"a")
    answers.ask(b"b")
    answers.ask(b"c")  # the table is full: dropped
    assert answers.due() == [b"a", b"b"] and answers.dropped == 1
    assert answers.due() == []
    answers.ask(b"a")
    clock.now = 0.1
    assert answers.due() == [] and answers.waiting == 1  # answered 0.1 s ago: it waits
    clock.now = 0.2
    assert answers.due() == [b"a"]


def test_a_trusted_peer_is_answered_through_a_flood_that_fills_the_waiting_table():
    """~1,100 strangers asking every 10 ms keep the 1,024-entry table full (review A, item 2):
    the supervisor, trusted, is still answered at every interval; an untrusted one is not."""
    clock = Clock()
    answers = StatusAnswers(interval_s=0.2, max_waiting=1024, clock=clock)
    strangers = [b"s%d" % i for i in range(1100)]
    heard = {b"supervisor": 0, b"stranger-observer": 0}
    for tick in range(1000):  # 10 s of 10 ms passes
        clock.now = tick * 0.01
        for s in strangers:
            answers.ask(s)
        if tick % 100 == 50:  # one request a second each
            answers.ask(b"supervisor", trusted=True)
            answers.ask(b"stranger-observer")
        for identity in answers.due():
            if identity in heard:
                heard[identity] += 1
    assert heard == {b"supervisor": 10, b"stranger-observer": 0} and answers.dropped > 0
