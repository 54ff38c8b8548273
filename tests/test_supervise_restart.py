"""The restart policy with a fake clock: budget per window, exponential backoff, reasons."""

import pytest

from dflash_ipc.supervise.restart import RestartPolicy


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_budget_per_window_and_backoff_doubles():
    clock = Clock()
    policy = RestartPolicy(max_restarts=3, window_s=60, backoff_s=1.0, max_backoff_s=30, role="target/2",
                           clock=clock)
    delays = []
    for _ in range(3):
        decision = policy.on_death()
        assert decision.allowed and decision.reason == ""
        delays.append(decision.delay_s)
        clock.now += 5
    assert delays == [1.0, 2.0, 4.0]
    refused = policy.on_death()
    assert not refused.allowed and refused.restarts_in_window == 3
    for part in ("target/2", "3 times within 60s", "supervise.max_restarts=3", "supervise.restart_window_s=60"):
        assert part in refused.reason, refused.reason


def test_old_restarts_leave_the_window():
    clock = Clock()
    policy = RestartPolicy(max_restarts=2, window_s=60, backoff_s=1.0, clock=clock)
    assert policy.on_death().allowed            # t=100
    clock.now = 130
    assert policy.on_death().delay_s == 2.0     # second within the window: doubled
    clock.now = 159.9
    assert not policy.on_death().allowed        # both still within 60 s
    clock.now = 160.0                           # the first one is 60 s old: out
    decision = policy.on_death()
    assert decision.allowed and decision.delay_s == 2.0 and policy.restarts_in_window() == 2
    assert policy.total_restarts == 3


def test_backoff_is_capped():
    clock = Clock()
    policy = RestartPolicy(max_restarts=10, window_s=1000, backoff_s=1.0, max_backoff_s=5.0, clock=clock)
    assert [policy.on_death().delay_s for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_zero_restarts_means_every_death_fails():
    decision = RestartPolicy(max_restarts=0, window_s=10, role="target/0", clock=Clock()).on_death()
    assert not decision.allowed
    assert "target/0" in decision.reason and "supervise.max_restarts=0" in decision.reason


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_restarts=-1, window_s=1), "max_restarts"),
    (dict(max_restarts=1, window_s=0), "window_s"),
    (dict(max_restarts=1, window_s=1, backoff_s=10, max_backoff_s=1), "backoff_s"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RestartPolicy(**kwargs)
