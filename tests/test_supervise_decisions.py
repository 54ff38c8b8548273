"""The supervisor's decisions, stepped with made-up children, statuses and beacons (no processes)."""

import pytest

from dflash_ipc.config.load import load_config
from dflash_ipc.errors import EXIT_CONFIG_ERROR
from dflash_ipc.supervise.decisions import (ChildView, Died, Fail, Kill, KillDrafters, Scheduled, Start,
                                            SupervisorLogic, SweepPool)
from dflash_ipc.supervise.roles import DISPATCHER, Role
from statuses import drafter, make_status, target

T0, T1, D0, D1 = Role("target", 0), Role("target", 1), Role("drafter", 0), Role("drafter", 1)
ROLES = [DISPATCHER, T0, T1, D0, D1]


class World:
    """Five children (pids 10..14) and the logic, with a clock under the test's control."""

    def __init__(self, *overrides, now=1000.0):
        self.now = now
        self.cfg = load_config(None, ["target.num_workers=2", "drafter.num_workers=2", "dispatch.heartbeat_timeout_s=5",
                                      "supervise.startup_timeout_s=60", "supervise.drafter_stall_s=10",
                                      "supervise.drafter_step_timeout_s=100", *overrides])
        self.logic = SupervisorLogic(self.cfg, ROLES, clock=lambda: self.now)
        self.children = {r: ChildView(r, 10 + i, None, started_at=now) for i, r in enumerate(ROLES)}
        self.next_pid = 20

    def exit(self, role, code):
        c = self.children[role]
        self.children[role] = ChildView(role, c.pid, code, c.started_at)

    def start(self, role):
        self.children[role] = ChildView(role, self.next_pid, None, started_at=self.now)
        self.next_pid += 1

    def step(self, **kw):
        actions = self.logic.step(self.now, list(self.children.values()), **kw)
        for a in actions:
            if isinstance(a, Start):
                self.start(a.role)
            if isinstance(a, KillDrafters):
                for r in (D0, D1):
                    self.exit(r, -9)
            if isinstance(a, Kill):
                self.exit(a.role, -9)
        return actions


def kinds(actions):
    return [type(a).__name__ for a in actions]


def test_a_dead_target_restarts_until_its_budget_is_spent():
    w = World("supervise.max_restarts=2")
    for n in (1, 2):
        w.exit(T1, -9)
        actions = w.step()
        assert kinds(actions) == ["Died", "SweepPool", "Scheduled"] and actions[1] == SweepPool(1)
        assert actions[2].restarts_in_window == n and w.step() == []  # the backoff runs
        w.now += actions[2].delay_s
        assert w.step() == [Start(T1)]
    w.exit(T1, 1)
    actions = w.step()
    assert isinstance(actions[-1], Fail) and "target/1 died" in actions[-1].reason
    assert w.children[T0].exit_code is None  # the other target is untouched


def test_a_drafter_death_restarts_the_whole_group_and_the_killed_ones_are_no_deaths():
    w = World("supervise.max_restarts=1")
    w.exit(D1, 1)
    actions = w.step()
    assert kinds(actions) == ["Died", "KillDrafters", "Scheduled"] and actions[-1].key == "drafters"
    assert w.children[D0].exit_code == -9
    assert w.step() == []  # D0, killed by us, is not a death of its own
    w.now += actions[-1].delay_s
    assert w.step() == [Start(D0), Start(D1)]
    assert w.children[DISPATCHER].exit_code is None
    w.exit(D0, 1)
    assert isinstance(w.step()[-1], Fail)  # max_restarts=1: the second group death fails the job


def test_a_dispatcher_death_restarts_it_with_the_drafters_and_keeps_the_targets():
    w = World()
    w.exit(DISPATCHER, -9)
    actions = w.step()
    assert kinds(actions) == ["Died", "KillDrafters", "Scheduled"] and actions[-1].key == "dispatcher"
    assert w.step() == []
    w.now += actions[-1].delay_s
    assert w.step() == [Start(DISPATCHER), Start(D0), Start(D1)]
    assert w.children[T0].pid == 11 and w.children[T0].exit_code is None


def test_a_configuration_error_is_never_restarted():
    w = World()
    w.exit(T0, EXIT_CONFIG_ERROR)
    actions = w.step()
    assert kinds(actions) == ["Died", "Fail"] and "configuration error" in actions[-1].reason


def seated(w, **ages):
    status = make_status([(10, 0)])
    for role in (T0, T1):
        status.targets[str(role.rank)] = target(pid=w.children[role].pid, heartbeat_age_s=ages.get(str(role), 0.1))
    for role in (D0, D1):
        status.drafters[str(role.rank)] = drafter(pid=w.children[role].pid, heartbeat_age_s=0.1)
    return status


def test_a_hung_target_is_killed_then_restarted_and_a_dropped_one_too():
    w = World()
    assert w.step(status=seated(w), dispatcher_replied_at=w.now) == []
    actions = w.step(status=seated(w, **{"target/0": 5.5}), dispatcher_replied_at=w.now)
    assert actions == [Kill(T0, "no heartbeat for 5.5s (dispatch.heartbeat_timeout_s=5)")]
    assert kinds(w.step()) == ["Died", "SweepPool", "Scheduled"]
    status = seated(w)
    del status.targets["1"]
    status.dropped_targets = {str(w.children[T1].pid): "silent for 6.0s"}
    assert w.step(status=status, dispatcher_replied_at=w.now) == [Kill(T1, "the dispatcher dropped it (silent for 6.0s)")]


def beacon(pid, *, time, phase="step", since=None):
    return {"time": time, "pid": pid, "phase": phase, "since": time if since is None else since, "step": 3}


def test_a_stopped_drafter_is_found_by_its_stale_beacon_and_a_slow_step_is_not():
    w = World()
    wall = 5000.0
    fresh = {D0: beacon(w.children[D0].pid, time=wall - 0.4, since=wall - 50),  # a slow step, alive
             D1: beacon(w.children[D1].pid, time=wall - 0.2, phase="wait")}
    assert w.step(status=seated(w), beacons=fresh, wall_now=wall, dispatcher_replied_at=w.now) == []
    stopped = {**fresh, D1: beacon(w.children[D1].pid, time=wall - 11, phase="wait")}
    actions = w.step(status=seated(w), beacons=stopped, wall_now=wall, dispatcher_replied_at=w.now)
    assert kinds(actions) == ["KillDrafters", "Scheduled"]
    assert "beacon stopped 11.0s ago (supervise.drafter_stall_s=10)" in actions[-1].reason


def test_a_stale_beacon_is_judged_without_waiting_for_a_status_poll():
    """The beacon needs no dispatcher: a stopped drafter is found on the next pass even when
    no status came (a poll not due yet, or a slow dispatcher); a seat check waits for one."""
    w = World()
    wall = 5000.0
    w.now += 61  # past the start-up timeout: without a status nobody is judged unregistered
    alive = {D0: beacon(w.children[D0].pid, time=wall - 0.3), D1: beacon(w.children[D1].pid, time=wall - 0.1)}
    assert w.step(beacons=alive, wall_now=wall, dispatcher_replied_at=w.now) == []
    stopped = {**alive, D0: beacon(w.children[D0].pid, time=wall - 10.5)}
    actions = w.step(beacons=stopped, wall_now=wall, dispatcher_replied_at=w.now)
    assert kinds(actions) == ["KillDrafters", "Scheduled"] and "drafter/0" in actions[-1].reason
    assert all(w.children[r].exit_code == -9 for r in (D0, D1))


def test_a_drafter_stuck_in_a_phase_past_its_limit_hangs_but_its_first_compiled_step_has_longer():
    w = World()
    wall = 5000.0
    compiling = {D0: beacon(w.children[D0].pid, time=wall, phase="compile", since=wall - 500)}
    assert w.step(status=seated(w), beacons=compiling, wall_now=wall, dispatcher_replied_at=w.now) == []
    stuck = {D0: beacon(w.children[D0].pid, time=wall, phase="step", since=wall - 101)}
    actions = w.step(status=seated(w), beacons=stuck, wall_now=wall, dispatcher_replied_at=w.now)
    assert "101s in phase 'step' (limit 100s)" in actions[-1].reason


def test_a_beacon_of_an_earlier_process_or_none_yet_is_no_hang_but_never_registering_is():
    w = World()
    wall = 5000.0
    old = {D0: beacon(999, time=wall - 100)}  # the predecessor's file, not yet rewritten
    status = seated(w)
    del status.drafters["0"]
    assert w.step(status=status, beacons=old, wall_now=wall, dispatcher_replied_at=w.now) == []
    w.now += 61
    actions = w.step(status=status, beacons=old, wall_now=wall, dispatcher_replied_at=w.now)
    assert "not registered 60s after its start" in actions[-1].reason


def test_a_silent_dispatcher_is_killed():
    w = World()
    w.now += 30  # it started 30 s ago and has answered since
    assert w.step(dispatcher_replied_at=w.now - 1) == []
    assert w.step(dispatcher_replied_at=w.now - 6) == [
        Kill(DISPATCHER, "no status reply for 6.0s (dispatch.heartbeat_timeout_s=5)")]
    w2 = World()
    w2.now += 61  # never answered at all: the start-up timeout applies
    assert "supervise.startup_timeout_s" in w2.step()[0].reason


def test_roles_parse_and_print():
    assert [str(r) for r in ROLES] == ["dispatcher", "target/0", "target/1", "drafter/0", "drafter/1"]
    assert Role.parse("drafter/7") == Role("drafter", 7) and Role.parse("dispatcher") == DISPATCHER
    for bad in ("target", "dispatcher/1", "boss/2", "target/x"):
        with pytest.raises(ValueError):
            Role.parse(bad)
    assert {r.restart_key for r in ROLES} == {"dispatcher", "target/0", "target/1", "drafters"}


def test_a_two_process_target_worker_is_one_restart_key():
    """target.gpus_per_worker=2: target/0 (the leader) and target/0.1 die, hang and restart together."""
    from dflash_ipc.supervise.decisions import KillWorker
    leader, follower = Role("target", 0), Role("target", 0, tp_rank=1)
    assert str(follower) == "target/0.1" and Role.parse("target/0.1") == follower
    assert follower.restart_key == leader.restart_key == "target/0"
    roles = [DISPATCHER, leader, follower, D0]
    now = [1000.0]
    cfg = load_config(None, ["target.num_workers=1", "target.gpus_per_worker=2", "drafter.num_workers=1",
                             "supervise.startup_timeout_s=60"])
    logic = SupervisorLogic(cfg, roles, clock=lambda: now[0])
    children = {r: ChildView(r, 10 + i, None, started_at=now[0]) for i, r in enumerate(roles)}
    children[follower] = ChildView(follower, 11, -9, now[0])  # SIGKILL of the follower
    actions = logic.step(now[0], list(children.values()))
    assert kinds(actions) == ["Died", "KillWorker", "SweepPool", "Scheduled"]
    assert actions[1] == KillWorker(0, actions[1].reason) and "target/0.1" in actions[1].reason
    children[leader] = ChildView(leader, 10, -9, now[0])  # killed by KillWorker: no death of its own
    assert logic.step(now[0], list(children.values())) == []
    now[0] += actions[-1].delay_s
    assert logic.step(now[0], list(children.values())) == [Start(leader), Start(follower)]
    # Only the leader holds a seat: a follower is never "not registered", its leader is.
    children = {r: ChildView(r, 20 + i, None, started_at=now[0]) for i, r in enumerate(roles)}
    now[0] += 61
    status = make_status([(10, 0)])
    status.drafters = {"0": drafter(pid=23)}
    hangs = logic.step(now[0], list(children.values()), status=status, beacons={D0: None}, wall_now=0.0,
                       dispatcher_replied_at=now[0])
    assert [a.role for a in hangs if isinstance(a, Kill)] == [leader]
