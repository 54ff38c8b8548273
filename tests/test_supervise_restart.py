"""The restart policy with a fake clock (budget per window, exponential backoff, reasons), and
the supervisor applying it to stand-in processes: restart, give up, kill a hung target."""

import json
import os
import signal
import time
import sys

import pytest

from dflash_ipc.config_load import load_config
from dflash_ipc.supervise.children import Child, stop_children
from dflash_ipc.supervise.restart import RestartPolicy
from dflash_ipc.supervise.supervisor import Supervisor


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


# --- the supervisor's use of it, with stand-in processes (no job, ~1 s) -----------------------


def _supervisor(tmp_path, max_restarts):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "target.num_workers=2", "drafter.num_workers=2",
                             f"supervise.max_restarts={max_restarts}", "dispatch.heartbeat_timeout_s=5"])
    sup = Supervisor(cfg, print_status=lambda line: None)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    roles = ["dispatcher", "target/0", "target/1", "drafter/0", "drafter/1"]
    sup.children = [Child(role=r, argv=sleeper, env=dict(os.environ), log_path=str(tmp_path / "logs" / f"{r.replace('/', '-')}.log"))
                    for r in roles]
    for child in sup.children:
        child.start()
    sup.policies = {r: RestartPolicy(max_restarts=max_restarts, window_s=60, backoff_s=0.0, role=r)
                    for r in ["target/0", "target/1", "drafters", "dispatcher"]}
    sup._write_processes()
    return sup


def _kill_and_wait(child):
    os.kill(child.pid, signal.SIGKILL)
    child.popen.wait(timeout=10)


def test_supervisor_restarts_a_dead_target_until_its_budget_is_spent(tmp_path):
    sup = _supervisor(tmp_path, max_restarts=2)
    try:
        target = sup.children[1]
        pids = [target.pid]
        for n in (1, 2):
            _kill_and_wait(target)
            assert sup._handle_deaths()
            sup._start_due_restarts()
            assert target.poll() is None and target.pid not in pids
            pids.append(target.pid)
            record = {e["role"]: e for e in json.loads((tmp_path / "processes.json").read_text())["processes"]}
            assert record["target/0"]["pid"] == target.pid and record["target/0"]["restarts"] == n
            assert record["target/1"]["pid"] == sup.children[2].pid and record["target/1"]["restarts"] == 0
        _kill_and_wait(target)
        assert not sup._handle_deaths()  # the third death in the window fails the job
    finally:
        stop_children(sup.children, 5.0)


def test_a_drafter_death_restarts_the_whole_group(tmp_path):
    sup = _supervisor(tmp_path, max_restarts=1)
    try:
        sup.children[2].signal(signal.SIGTERM)  # SIGTERM: exit code -15, a death
        sup.children[2].popen.wait(timeout=10)
        assert sup._handle_deaths() and "target/1" in sup._restart_due
        d0, d1 = sup.children[3], sup.children[4]
        old = (d0.pid, d1.pid)
        _kill_and_wait(d0)
        assert sup._handle_deaths() and "drafters" in sup._restart_due
        assert d1.poll() == -signal.SIGKILL  # the survivor of a broken group is killed at once
        sup._start_due_restarts()
        assert d0.poll() is None and d1.poll() is None and (d0.pid, d1.pid) != old
        assert sup.children[0].restarts == []  # the dispatcher was left alone
        _kill_and_wait(d1)
        assert not sup._handle_deaths()  # max_restarts=1: the second group death fails the job
    finally:
        stop_children(sup.children, 5.0)


def test_a_dispatcher_death_restarts_it_with_the_drafters_and_keeps_the_targets(tmp_path):
    sup = _supervisor(tmp_path, max_restarts=1)
    try:
        dispatcher, t0, d0 = sup.children[0], sup.children[1], sup.children[3]
        target_pid, old = t0.pid, (dispatcher.pid, d0.pid)
        _kill_and_wait(dispatcher)
        assert sup._handle_deaths() and sup._restart_due.keys() == {"dispatcher"}
        assert d0.poll() == -signal.SIGKILL
        assert sup._handle_deaths()  # the killed drafters are not deaths of their own
        sup._start_due_restarts()
        assert dispatcher.poll() is None and d0.poll() is None and (dispatcher.pid, d0.pid) != old
        assert t0.pid == target_pid and t0.poll() is None
    finally:
        stop_children(sup.children, 5.0)


def test_a_hung_drafter_restarts_the_group_and_a_silent_dispatcher_is_killed(tmp_path):
    sup = _supervisor(tmp_path, max_restarts=3)
    sup.cfg.supervise.drafter_timeout_s = 5.0
    try:
        d0, d1 = sup.children[3], sup.children[4]
        status = {"drafters": {"0": {"pid": d0.pid, "heartbeat_age_s": 6.0},
                               "1": {"pid": d1.pid, "heartbeat_age_s": 0.1}}}
        fresh = {"drafters": {"0": {"pid": d0.pid, "heartbeat_age_s": 1.0},
                              "1": {"pid": d1.pid, "heartbeat_age_s": 0.1}}}
        assert sup._restart_hung_drafters(fresh) and not sup._restart_due
        assert sup._restart_hung_drafters(status) and "drafters" in sup._restart_due
        assert d0.poll() == -signal.SIGKILL and d1.poll() == -signal.SIGKILL
        # The dispatcher answered once, then went silent past dispatch.heartbeat_timeout_s (5 s).
        sup.children[0].started_at -= 30.0
        sup._last_reply_at = time.monotonic() - 1.0
        sup._kill_hung_dispatcher()
        assert sup.children[0].poll() is None
        sup._last_reply_at = time.monotonic() - 6.0
        sup._kill_hung_dispatcher()
        assert sup.children[0].popen.wait(timeout=10) == -signal.SIGKILL
    finally:
        stop_children(sup.children, 5.0)


def test_supervisor_kills_a_hung_target_from_the_status(tmp_path):
    sup = _supervisor(tmp_path, max_restarts=3)
    try:
        t0, t1 = sup.children[1], sup.children[2]
        fresh = {"pid": t1.pid, "heartbeat_age_s": 0.5}
        status = {"targets": {"0": {"pid": t0.pid, "heartbeat_age_s": 5.5}, "1": fresh}, "dropped_targets": {}}
        sup._kill_hung_targets(status)
        assert t0.popen.wait(timeout=10) == -signal.SIGKILL and t1.poll() is None
        assert sup._handle_deaths() and sup._restart_due.keys() == {"target/0"}
        sup._start_due_restarts()
        # Dropped by the dispatcher (silent), not seated any more: killed too.
        status = {"targets": {"0": {"pid": t0.pid, "heartbeat_age_s": 0.1}}, "dropped_targets": {str(t1.pid): "silent"}}
        sup._kill_hung_targets(status)
        assert t1.popen.wait(timeout=10) == -signal.SIGKILL and t0.poll() is None
    finally:
        stop_children(sup.children, 5.0)
