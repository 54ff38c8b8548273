"""What the supervisor does about its children: a steppable function of what it sees.

    logic = SupervisorLogic(cfg, roles, clock=...)
    actions = logic.step(now, children, status=status_or_None, beacons={...},
                         dispatcher_replied_at=..., dispatcher_changed_at=...)

It holds the restart budgets and the restarts waiting for their backoff, and returns
`Action`s; the process side (`supervisor.py`) only carries them out. Tests step it with
made-up children and statuses (tests/test_supervise_decisions.py).

Rules:
- A target that dies is started again for the same rank, within its own `RestartPolicy`;
  its shared-memory pool is swept first (a SIGKILLed target cannot unlink its own). A target
  worker of several processes (`target.gpus_per_worker` > 1) is one restart key: the death of
  any of them kills the others (`KillWorker`: their group is broken) and starts all again.
- A drafter that dies or hangs restarts the whole group: every drafter is killed at once
  (the survivors' collective group is broken and must not train on), and after the backoff
  all start again. Hangs come from its liveness beacon (`liveness.py`): stopped (the beacon
  is stale) or stuck in a phase past its limit; or it never registered.
- The dispatcher that dies or stops answering status requests is restarted with the drafter
  group (drafters left running would train past what the restored ledger holds).
- A target that hangs (heartbeat too old, dropped by the dispatcher, never registered) is
  killed; its death then restarts it.
- A child that exits with the configuration-error code never restarts: the job fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dflash_ipc.errors import EXIT_CONFIG_ERROR
from dflash_ipc.run.liveness import beacon_problem
from dflash_ipc.supervise.restart import RestartPolicy
from dflash_ipc.supervise.roles import DISPATCHER, Role
from dflash_ipc.wire.status import JobStatus


@dataclass(frozen=True, slots=True)
class ChildView:
    """What the logic sees of one child process."""
    role: Role
    pid: int | None
    exit_code: int | None  # None: running
    started_at: float


@dataclass(frozen=True, slots=True)
class Died:
    role: Role
    pid: int | None
    exit_code: int


@dataclass(frozen=True, slots=True)
class Kill:
    role: Role
    reason: str


@dataclass(frozen=True, slots=True)
class KillDrafters:
    reason: str


@dataclass(frozen=True, slots=True)
class KillWorker:
    """SIGKILL every living process of target rank `rank` (a multi-process worker), and reap them."""
    rank: int
    reason: str


@dataclass(frozen=True, slots=True)
class Start:
    role: Role
    delayed_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SweepPool:
    target_rank: int


@dataclass(frozen=True, slots=True)
class Scheduled:
    key: str
    delay_s: float
    reason: str
    restarts_in_window: int
    max_restarts: int
    window_s: float


@dataclass(frozen=True, slots=True)
class Fail:
    reason: str


Action = Died | Kill | KillDrafters | KillWorker | Start | SweepPool | Scheduled | Fail


class SupervisorLogic:
    def __init__(self, cfg, roles: list[Role], *, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.roles = list(roles)
        sup = cfg.supervise
        keys = sorted({r.restart_key for r in roles} | {"drafters", "dispatcher"})
        self.policies = {key: RestartPolicy(max_restarts=sup.max_restarts, window_s=sup.restart_window_s,
                                            role="the drafter group" if key == "drafters" else key, clock=clock)
                         for key in keys}
        self.restart_due: dict[str, float] = {}  # restart key -> when

    def busy_restarting(self, key: str) -> bool:
        return key in self.restart_due

    def step(self, now: float, children: list[ChildView], *, status: JobStatus | None = None,
             beacons: dict[Role, dict | None] | None = None, wall_now: float | None = None,
             dispatcher_replied_at: float | None = None, dispatcher_changed_at: float = 0.0) -> list[Action]:
        """Deaths, then due restarts, then hangs. `now` is monotonic; beacons carry wall-clock
        times, read against `wall_now`. Drafter beacons are judged on every step: a stopped
        drafter is found within its bound whether or not the dispatcher answered a status
        poll. What needs the dispatcher's view (heartbeats, seats) waits for a fresh `status`."""
        actions = self._deaths(children, now)
        if any(isinstance(a, Fail) for a in actions):
            return actions
        actions += self._due(now)
        if status is not None:
            actions += self._hung_targets(children, status, now, dispatcher_changed_at)
        actions += self._hung_drafters(children, status, beacons or {}, now, now if wall_now is None else wall_now)
        actions += self._hung_dispatcher(children, now, dispatcher_replied_at)
        return actions

    # --- deaths ----------------------------------------------------------------------------

    def _deaths(self, children: list[ChildView], now: float) -> list[Action]:
        actions: list[Action] = []
        for child in children:
            if child.exit_code in (None, 0) or child.role.restart_key in self.restart_due:
                continue
            if child.role.kind == "drafter" and "dispatcher" in self.restart_due:
                continue  # killed by us: the dispatcher's restart brings the drafters
            actions.append(Died(child.role, child.pid, child.exit_code))
            if child.exit_code == EXIT_CONFIG_ERROR:
                return actions + [Fail(f"{child.role} (pid {child.pid}) stopped on a configuration error "
                                       f"(exit {EXIT_CONFIG_ERROR}): it would fail again; see its log")]
            why = f"{child.role} (pid {child.pid}) exited with code {child.exit_code}"
            if child.role.kind == "target":
                if self._worker_size(child.role.rank) > 1:
                    actions.append(KillWorker(child.role.rank, why))
                actions += [SweepPool(child.role.rank)]
            actions += self._schedule(child.role.restart_key, why, now)
            if isinstance(actions[-1], Fail):
                return actions
        return actions

    def _schedule(self, key: str, why: str, now: float) -> list[Action]:
        policy = self.policies[key]
        decision = policy.on_death()
        if not decision.allowed:
            return [Fail(f"{decision.reason} ({why})")]
        actions: list[Action] = []
        if key in ("drafters", "dispatcher"):
            self.restart_due.pop("drafters", None)  # the dispatcher's restart brings them
            # The drafters go first and at once: a broken group must not train on, and after a
            # dispatcher death nothing may read slots the new dispatcher will hand out again.
            actions.append(KillDrafters(why))
        self.restart_due[key] = now + decision.delay_s
        return actions + [Scheduled(key, decision.delay_s, why, decision.restarts_in_window,
                                    policy.max_restarts, policy.window_s)]

    def _due(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for key, due in sorted(self.restart_due.items()):
            if now < due:
                continue
            del self.restart_due[key]
            if key == "dispatcher":
                actions += [Start(DISPATCHER)] + [Start(r) for r in self.roles if r.kind == "drafter"]
            elif key == "drafters":
                actions += [Start(r) for r in self.roles if r.kind == "drafter"]
            else:  # a target worker: all of its processes
                actions += [Start(r) for r in self.roles if r.restart_key == key]
        return actions

    def _worker_size(self, rank: int) -> int:
        return sum(r.kind == "target" and r.rank == rank for r in self.roles)

    # --- hangs -----------------------------------------------------------------------------

    def _hung_targets(self, children, status: JobStatus, now: float, changed_at: float) -> list[Action]:
        actions: list[Action] = []
        for child in children:
            # A follower has no seat: its hang stalls its leader's next forward, which is seen.
            if (child.role.kind == "target" and child.role.is_leader and child.exit_code is None
                    and child.role.restart_key not in self.restart_due):
                why = self._target_hang(child, status, now, changed_at)
                if why:
                    actions.append(Kill(child.role, why))
        return actions

    def _target_hang(self, child: ChildView, status: JobStatus, now: float, changed_at: float) -> str | None:
        seat = status.targets.get(str(child.role.rank))
        seated = seat is not None and seat.pid == child.pid
        timeout = self.cfg.dispatch.heartbeat_timeout_s
        if seated and seat.heartbeat_age_s > timeout:
            return f"no heartbeat for {seat.heartbeat_age_s:.1f}s (dispatch.heartbeat_timeout_s={timeout:g})"
        dropped = status.dropped_targets.get(str(child.pid))
        if not seated and dropped is not None:
            return f"the dispatcher dropped it ({dropped})"
        return self._unregistered(child, seated, now, since=max(child.started_at, changed_at))

    def _hung_drafters(self, children, status: JobStatus | None, beacons: dict, now: float,
                       wall_now: float) -> list[Action]:
        if "drafters" in self.restart_due or "dispatcher" in self.restart_due:
            return []
        sup = self.cfg.supervise
        for child in children:
            if child.role.kind != "drafter" or child.exit_code is not None:
                continue
            why = beacon_problem(beacons.get(child.role), pid=child.pid, now=wall_now, stall_s=sup.drafter_stall_s,
                                 limits=sup.drafter_phase_limits())
            if why is None and status is not None:
                seat = status.drafters.get(str(child.role.rank))
                seated = seat is not None and seat.pid == child.pid
                why = self._unregistered(child, seated, now, since=child.started_at)
            if why:
                return self._schedule("drafters", f"{child.role} (pid {child.pid}) hangs: {why}", now)
        return []

    def _unregistered(self, child: ChildView, seated: bool, now: float, *, since: float) -> str | None:
        startup = self.cfg.supervise.startup_timeout_s
        if not seated and now - since > startup:
            return f"not registered {startup:g}s after its start (supervise.startup_timeout_s)"
        return None

    def _hung_dispatcher(self, children, now: float, replied_at: float | None) -> list[Action]:
        dispatcher = next((c for c in children if c.role == DISPATCHER), None)
        if dispatcher is None or dispatcher.exit_code is not None or "dispatcher" in self.restart_due:
            return []
        if replied_at is None or replied_at < dispatcher.started_at:
            since, limit, what = dispatcher.started_at, self.cfg.supervise.startup_timeout_s, "supervise.startup_timeout_s"
        else:
            since, limit, what = replied_at, self.cfg.dispatch.heartbeat_timeout_s, "dispatch.heartbeat_timeout_s"
        silent = now - since
        if silent > limit:
            return [Kill(DISPATCHER, f"no status reply for {silent:.1f}s ({what}={limit:g})")]
        return []

