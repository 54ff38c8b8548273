"""`dflash-ipc health` against real processes and a fake dispatcher (a ZMQ ROUTER in a thread)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import yaml
import zmq

from dflash_ipc.run.files import RunFiles
from dflash_ipc.run.process_start import start_ticks
from dflash_ipc.wire import protocol as p
from dflash_ipc.wire.status import JobStatus
from dflash_ipc.supervise.health import (format_health, gpu_memory_by_pid,
                                         health_report)

HB_TIMEOUT_S = 4.0  # the run's dispatch.heartbeat_timeout_s: default stale threshold 2 s
QUICK = {"timeout_s": 0.5, "cpu_window_s": 0.1}
ROLES = ("dispatcher", "target/0", "drafter/0")


class FakeDispatcher:
    """Answers StatusRequest with `self.status` (mutable by the test) and Heartbeat with Heartbeat."""

    def __init__(self, status: dict) -> None:
        self.status = status
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind("tcp://127.0.0.1:*")
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            if not self.socket.poll(50):
                continue
            sender, *frames = self.socket.recv_multipart()
            msg = p.decode(frames)
            if isinstance(msg, p.StatusRequest):
                reply = p.StatusReply(status=self.status)
            else:
                reply = p.Heartbeat(metrics={})
            self.socket.send_multipart([sender, *p.encode(reply)])

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.socket.close()
        self.context.term()


def canned_status(*, target_batches=3, drafter_step=2, hb_age_s=0.3, pending=5, finished=False,
                  targets=("0",), drafters=("0",)) -> JobStatus:
    return JobStatus.from_json({
        "elapsed_s": 12.0, "policy": "pull", "num_batches": 10,
        "batches": {"pending": pending, "leased": 1, "produced": 1, "consumed": 1, "committed": 2, "assigned": 0},
        "epochs": [{"epoch": 0, "batches": 10, "committed": 2}],
        "tokens": {"total": 3000, "produced": 900, "consumed": 600, "trained": 500, "committed": 400},
        "committed_tokens_by_epoch": {"0": 400}, "last_committed_step": 4,
        "rates": {"tgt_rate": 80.0, "dft_rate": 60.0, "tok_rate": 50.0}, "produced_waiting": 1,
        "targets": {r: {"pid": 10, "credits": 1, "free_slots": 2, "batches": target_batches, "tokens": 900,
                        "compute_s": 1.0, "metrics": {"busy_s": 1.0, "wait_s": 0.5},
                        "heartbeat_age_s": hb_age_s} for r in targets},
        "drafters": {r: {"pid": 20, "credits": 2, "batches": 2, "tokens": 600,
                         "metrics": {"step": float(drafter_step), "loss": 5.0, "trained_tokens": 500.0},
                         "heartbeat_age_s": hb_age_s} for r in drafters},
        "refusals": 0, "instance": "i", "drafter_generation": 0, "dropped_targets": {}, "finished": finished,
    }, "canned")


@pytest.fixture
def children():
    """Three sleeping python processes standing in for the dispatcher and two workers."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in ROLES]
    for proc in procs:  # a child still starting Python reads as 'running' on a loaded machine
        wait_state(proc.pid, "sleeping", timeout_s=30.0)
    yield dict(zip(ROLES, procs))
    for proc in procs:
        try:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def make_run(run_dir, children, *, address="tcp://127.0.0.1:1", supervisor=None,
             startup_timeout_s=30.0, age_s=0.0, ticks_shift: int | None = 0) -> str:
    """Writes config.yaml and processes.json (backdated by `age_s`) as the supervisor would:
    each process's start in clock ticks, plus `ticks_shift` (another process's start: the pid
    was reused); None: without them (as where /proc is not)."""
    run_dir = str(run_dir)
    cfg = {"run": {"run_dir": run_dir},
           "dispatch": {"address": address, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": HB_TIMEOUT_S},
           "supervise": {"startup_timeout_s": startup_timeout_s}}
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    record = {"supervisor": supervisor or os.getpid(), "run_dir": run_dir,
              "processes": [{"role": role, "pid": proc.pid, "log": f"{run_dir}/{role}.log"}
                            for role, proc in children.items()]}
    if ticks_shift is not None:
        def recorded(pid):  # a process already gone: any count (no /proc entry to match)
            ticks = start_ticks(pid)
            return 12345 if ticks is None else ticks + ticks_shift

        record["supervisor_start_ticks"] = recorded(record["supervisor"])
        for entry in record["processes"]:
            entry["start_ticks"] = recorded(entry["pid"])
    path = os.path.join(run_dir, "processes.json")
    with open(path, "w") as f:
        json.dump(record, f)
    if age_s:
        # Backdating past the children's start makes them look younger than the file.
        os.utime(path, (time.time() - age_s,) * 2)
    return run_dir


@pytest.fixture
def dispatcher():
    fake = FakeDispatcher(canned_status())
    yield fake
    fake.close()


def rows(report) -> dict:
    return {row.role: row for row in report.processes}


def wait_state(pid: int, state: str, timeout_s: float = 5.0) -> None:
    import psutil
    deadline = time.monotonic() + timeout_s
    while psutil.Process(pid).status() != state:
        assert time.monotonic() < deadline, f"pid {pid} never became {state}"
        time.sleep(0.01)


def test_no_processes_json_is_down(tmp_path):
    report = health_report(str(tmp_path), **QUICK)
    assert report.level == "down" and report.exit_code == 2
    assert "processes.json does not exist" in report.reasons[0]
    assert "DOWN (exit 2)" in format_health(report)


def test_malformed_processes_json_names_the_field(tmp_path, children):
    run_dir = make_run(tmp_path, children)
    with open(os.path.join(run_dir, "processes.json"), "w") as f:
        json.dump({"supervisor": os.getpid(), "processes": [{"role": "target/0", "pid": "x"}]}, f)
    report = health_report(run_dir, **QUICK)
    assert report.exit_code == 2
    assert "processes[0]" in report.reasons[0] and "'pid'" in report.reasons[0]


def test_silent_dispatcher_is_down(tmp_path, children):
    # nothing listens at the configured address, and the run is past its start-up time
    run_dir = make_run(tmp_path, children, startup_timeout_s=0.001)
    started = time.monotonic()
    report = health_report(run_dir, **QUICK)
    assert time.monotonic() - started < 10.0  # bounded (2 s timeout), generous for a loaded machine
    assert report.exit_code == 2
    assert any("dispatcher" in r and "does not answer" in r for r in report.reasons)
    by_role = rows(report)
    assert by_role["dispatcher"].state == "sleeping"
    assert by_role["supervisor"].pid == os.getpid() and by_role["supervisor"].rss_bytes > 0


def test_dead_dispatcher_is_down_without_asking(tmp_path, children, dispatcher):
    run_dir = make_run(tmp_path, children, address=dispatcher.address)
    children["dispatcher"].kill()
    wait_state(children["dispatcher"].pid, "zombie")
    report = health_report(run_dir, **QUICK)
    assert report.exit_code == 2
    assert rows(report)["dispatcher"].state == "zombie"
    assert report.job is None  # a dead dispatcher's address is not asked


def test_dead_supervisor_is_down(tmp_path, children, dispatcher):
    ghost = subprocess.Popen([sys.executable, "-c", "pass"])
    ghost.wait(timeout=10)
    run_dir = make_run(tmp_path, children, address=dispatcher.address, supervisor=ghost.pid)
    report = health_report(run_dir, **QUICK)
    assert report.exit_code == 2
    assert any(r.startswith("supervisor") for r in report.reasons)


def test_healthy_run(tmp_path, children, dispatcher):
    run_dir = make_run(tmp_path, children, address=dispatcher.address)
    report = health_report(run_dir, **QUICK)
    assert report.reasons == [] and report.level == "healthy" and report.exit_code == 0
    by_role = rows(report)
    assert list(by_role) == ["supervisor", *ROLES]
    for role in ROLES:
        row = by_role[role]
        assert row.pid == children[role].pid and row.state == "sleeping"
        assert row.rss_bytes > 1 << 20 and row.num_threads >= 1 and row.cpu_percent is not None
    assert by_role["target/0"].heartbeat_age_s == pytest.approx(0.3)
    assert by_role["target/0"].batches == 3 and by_role["drafter/0"].batches == 2
    assert by_role["dispatcher"].batches == 2  # committed
    assert report.thresholds["stale_after_s"] == HB_TIMEOUT_S / 2
    assert report.thresholds["stall_after_s"] == 2 * HB_TIMEOUT_S
    text = format_health(report)
    assert "HEALTHY (exit 0)" in text and "2/10 batches committed" in text
    assert all(role in text for role in ROLES)
    decoded = json.loads(json.dumps(report.to_json()))
    assert decoded["exit_code"] == 0 and decoded["level"] == "healthy"
    assert [r["role"] for r in decoded["processes"]] == ["supervisor", *ROLES]
    assert decoded["job"]["num_batches"] == 10


def test_a_node_other_than_0_asks_the_remote_dispatcher(tmp_path, children, dispatcher):
    """Node 1 runs no dispatcher: its check reads processes-node1.json and config-node1.yaml,
    and asks the dispatcher named in its config. Node 0's files are not touched."""
    node1 = {"target/1": children["target/0"], "drafter/1": children["drafter/0"]}
    make_run(tmp_path, node1, address=dispatcher.address)
    for name in ("config.yaml", "processes.json"):
        stem, ext = os.path.splitext(name)
        os.rename(tmp_path / name, tmp_path / f"{stem}-node1{ext}")
    dispatcher.status = canned_status(targets=("1",), drafters=("1",))
    report = health_report(str(tmp_path), node_rank=1, **QUICK)
    assert report.level == "healthy", report.reasons
    assert list(rows(report)) == ["supervisor", "target/1", "drafter/1"]
    assert rows(report)["target/1"].batches == 3 and report.job["num_batches"] == 10
    assert "node 1: HEALTHY" in format_health(report) and report.to_json()["node_rank"] == 1
    assert os.path.exists(tmp_path / "health_state-node1.json")
    assert not os.path.exists(tmp_path / "health_state.json")
    # Node 0's files are absent here: that check is down, naming its file.
    assert "processes.json does not exist" in health_report(str(tmp_path), **QUICK).reasons[0]
    # A silent dispatcher puts node 1 down too.
    dispatcher.close()
    report = health_report(str(tmp_path), node_rank=1, **QUICK)
    assert report.level == "down" and "does not answer" in report.reasons[0], report.reasons


def test_stopped_worker_is_degraded(tmp_path, children, dispatcher):
    run_dir = make_run(tmp_path, children, address=dispatcher.address)
    pid = children["target/0"].pid
    os.kill(pid, signal.SIGSTOP)
    wait_state(pid, "stopped")
    report = health_report(run_dir, **QUICK)
    assert report.level == "degraded" and report.exit_code == 1
    assert rows(report)["target/0"].state == "stopped"
    assert report.reasons == [f"target/0 (pid {pid}): process stopped"]
    os.kill(pid, signal.SIGCONT)
    wait_state(pid, "sleeping")
    assert health_report(run_dir, **QUICK).exit_code == 0


def test_killed_worker_is_degraded_as_zombie_then_gone(tmp_path, children, dispatcher):
    run_dir = make_run(tmp_path, children, address=dispatcher.address)
    proc = children["drafter/0"]
    proc.kill()
    wait_state(proc.pid, "zombie")
    report = health_report(run_dir, **QUICK)
    assert report.exit_code == 1 and rows(report)["drafter/0"].state == "zombie"
    proc.wait(timeout=10)
    report = health_report(run_dir, **QUICK)
    assert report.exit_code == 1 and rows(report)["drafter/0"].state == "gone"
    assert "drafter/0" in format_health(report)


@pytest.mark.parametrize("ticks_shift", [1, None], ids=["another-start-in-ticks", "younger-than-the-file"])
def test_reused_pid_is_not_ours(tmp_path, children, dispatcher, ticks_shift):
    # recorded starts in clock ticks that differ; without them, processes created after the file
    run_dir = make_run(tmp_path, children, address=dispatcher.address, age_s=100, ticks_shift=ticks_shift)
    report = health_report(run_dir, **QUICK)
    assert rows(report)["target/0"].state == "gone (pid reused)"
    assert rows(report)["target/0"].rss_bytes is None
    assert report.exit_code == 2  # the dispatcher's pid is "reused" too


def test_a_process_whose_start_in_ticks_matches_is_ours_whatever_the_wall_clock_did(tmp_path, children, dispatcher):
    """The file's time and psutil's create_time follow the wall clock, which a VM's time sync
    can step: a file 100 s "older" than its processes; their recorded starts in clock ticks
    since boot still match."""
    run_dir = make_run(tmp_path, children, address=dispatcher.address, age_s=100)
    report = health_report(run_dir, **QUICK)
    assert all(row.state != "gone (pid reused)" for row in report.processes), format_health(report)
    assert report.exit_code == 0, format_health(report)


def test_start_ticks_of_another_type_are_named(tmp_path, children):
    run_dir = make_run(tmp_path, children)
    path = os.path.join(run_dir, "processes.json")
    with open(path) as f:
        record = json.load(f)
    record["processes"][0]["start_ticks"] = "early"
    with open(path, "w") as f:
        json.dump(record, f)
    report = health_report(run_dir, **QUICK)
    assert report.level == "down" and "processes[0].start_ticks" in report.reasons[0]


def test_stale_heartbeat_uses_the_run_config(tmp_path, children, dispatcher):
    run_dir = make_run(tmp_path, children, address=dispatcher.address)
    dispatcher.status = canned_status(hb_age_s=3.0)  # > 4.0 / 2
    report = health_report(run_dir, **QUICK)
    assert report.exit_code == 1
    assert sorted(r.split(" ")[0] for r in report.reasons) == ["drafter/0", "target/0"]
    assert "heartbeat 3.0s old" in report.reasons[0]
    assert health_report(run_dir, stale_after_s=10.0, **QUICK).exit_code == 0


def test_unregistered_worker_is_degraded_after_startup(tmp_path, children, dispatcher):
    dispatcher.status = canned_status(targets=())
    run_dir = make_run(tmp_path, children, address=dispatcher.address, startup_timeout_s=30.0)
    assert health_report(run_dir, **QUICK).exit_code == 0  # still within the startup timeout
    run_dir = make_run(tmp_path, children, address=dispatcher.address, startup_timeout_s=0.05)
    time.sleep(0.1)
    report = health_report(run_dir, **QUICK)
    assert report.exit_code == 1
    assert report.reasons == [f"target/0 (pid {children['target/0'].pid}): not registered with the dispatcher"]


def test_progress_is_tracked_across_checks(tmp_path, children, dispatcher):
    run_dir = make_run(tmp_path, children, address=dispatcher.address)
    first = health_report(run_dir, stall_after_s=0.3, **QUICK)
    assert first.exit_code == 0 and rows(first)["target/0"].progress_age_s is None
    assert os.path.exists(RunFiles(run_dir).health_state)
    time.sleep(0.35)
    stalled = health_report(run_dir, stall_after_s=0.3, **QUICK)
    assert stalled.exit_code == 1
    assert {r.split(" ")[0] for r in stalled.reasons} == {"dispatcher", "target/0", "drafter/0"}
    assert rows(stalled)["target/0"].progress_age_s > 0.3
    # Only the target moves: it is healthy again, the drafter and the job are not.
    dispatcher.status = canned_status(target_batches=4)
    moved = health_report(run_dir, stall_after_s=0.3, **QUICK)
    assert rows(moved)["target/0"].progress_age_s == 0.0
    assert {r.split(" ")[0] for r in moved.reasons} == {"dispatcher", "drafter/0"}
    # Nothing pending: targets may idle. Finished: nobody has to move.
    dispatcher.status = canned_status(target_batches=4, pending=0)
    assert "target/0" not in {r.split(" ")[0] for r in health_report(run_dir, stall_after_s=0.3, **QUICK).reasons}
    dispatcher.status = canned_status(target_batches=4, pending=0, finished=True)
    assert health_report(run_dir, stall_after_s=0.3, **QUICK).exit_code == 0


def test_gpu_memory_by_pid_sums_devices_and_skips_unknown():
    procs = {0: [SimpleNamespace(pid=10, usedGpuMemory=100), SimpleNamespace(pid=11, usedGpuMemory=None)],
             1: [SimpleNamespace(pid=10, usedGpuMemory=50), SimpleNamespace(pid=12, usedGpuMemory=7)]}
    calls = []
    nvml = SimpleNamespace(nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
                           nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
                           nvmlDeviceGetComputeRunningProcesses=lambda h: procs[h])
    assert gpu_memory_by_pid(nvml) == {10: 150, 12: 7}
    assert calls == ["init", "shutdown"]

    def no_driver():
        raise RuntimeError("NVML Shared Library Not Found")
    assert gpu_memory_by_pid(SimpleNamespace(nvmlInit=no_driver)) is None


def test_status_and_health_name_the_checkpoints_set_aside_as_never_committed(tmp_path, children, dispatcher):
    from dflash_ipc.run.checkpoints import CheckpointStore
    from dflash_ipc.supervise.status_query import query_status
    run_dir = make_run(tmp_path, children, address=dispatcher.address)
    store = CheckpointStore(RunFiles(run_dir).checkpoints)
    for step in (8, 12):
        os.makedirs(store.path(step))
    assert "never committed" not in query_status(run_dir) + format_health(health_report(run_dir, **QUICK))
    (moved,) = store.quarantine_after(8)  # what the next start does with a checkpoint never committed
    text = query_status(run_dir)
    assert text.splitlines()[-1] == f"  set aside, never committed (never resumed from): {moved}"
    assert json.loads(query_status(run_dir, as_json=True))["uncommitted_checkpoints"] == [moved]
    report = health_report(run_dir, **QUICK)
    assert report.uncommitted_checkpoints == [moved] and report.to_json()["uncommitted_checkpoints"] == [moved]
    assert f"never committed (never resumed from): {moved}" in format_health(report)
    assert report.level == "healthy"  # set aside is safe: nothing resumes from it


def test_a_follower_of_a_target_worker_is_judged_by_its_leaders_seat():
    from dflash_ipc.supervise.health import _worker_status
    status = canned_status(targets=("0", "1"), drafters=("0",))
    assert _worker_status(status, "target/1.1") is status.targets["1"]
    assert _worker_status(status, "drafter/0") is status.drafters["0"]
    assert _worker_status(status, "target/7") is None
    assert _worker_status(status, "supervisor") is None and _worker_status(status, "dispatcher") is None


def test_a_drafters_beacon_shows_its_phase_and_tells_a_long_step_from_a_stopped_process(
        tmp_path, children, dispatcher):
    """A drafter sends nothing while it steps: an old heartbeat with a fresh beacon is a long
    step (healthy, its phase shown); a beacon older than supervise.drafter_stall_s is not."""
    run_dir = make_run(tmp_path, children, address=dispatcher.address)
    pid = children["drafter/0"].pid
    dispatcher.status = canned_status()
    dispatcher.status.drafters["0"].heartbeat_age_s = 40.0
    path = RunFiles(run_dir).beacon("drafter/0")
    os.makedirs(os.path.dirname(path))
    now = time.time()
    with open(path, "w") as f:
        json.dump({"time": now, "pid": pid, "phase": "step", "since": now - 42, "step": 9}, f)
    report = health_report(run_dir, **QUICK)
    assert report.level == "healthy", report.reasons
    phase = rows(report)["drafter/0"].phase
    assert phase in ("step 42s", "step 43s") and phase in format_health(report)
    with open(path, "w") as f:
        json.dump({"time": now - 31, "pid": pid, "phase": "step", "since": now - 42, "step": 9}, f)
    report = health_report(run_dir, **QUICK)
    assert report.level == "degraded"
    (reason,) = report.reasons
    assert reason.startswith(f"drafter/0 (pid {pid}): its liveness beacon stopped 31.")
    assert reason.endswith("s ago (supervise.drafter_stall_s=30): stopped or frozen")


# --- starting and finished, not down ----------------------------------------------------------


def test_a_job_whose_dispatcher_has_not_answered_yet_is_starting(tmp_path, children):
    run_dir = make_run(tmp_path, children)  # nothing answers yet; 30 s of start-up time
    report = health_report(run_dir, **QUICK)
    assert (report.level, report.exit_code) == ("starting", 0)
    assert report.reasons[0].startswith("the dispatcher does not answer yet: the job started ")
    assert format_health(report).startswith(f"{run_dir}: STARTING (exit 0)")
    children["dispatcher"].kill()  # its dispatcher died while starting: down
    wait_state(children["dispatcher"].pid, "zombie")
    assert health_report(run_dir, **QUICK).level == "down"


def test_a_supervisor_holding_the_run_directory_before_processes_json_is_starting(tmp_path):
    from dflash_ipc.run.lock import RunLock
    lock = RunLock(str(tmp_path))
    lock.acquire()  # as `up` does before it resolves and starts anything: this process's pid
    try:
        report = health_report(str(tmp_path), **QUICK)
        assert (report.level, report.exit_code) == ("starting", 0)
        assert report.reasons == [f"supervisor (pid {os.getpid()}) holds the run directory and has not started "
                                  "its processes yet"]
        path = os.path.join(tmp_path, ".lock")
        with open(path) as f:
            assert f.read() == f"{os.getpid()} {start_ticks(os.getpid())}\n"  # its start, in ticks since boot
        old = time.time() - 100  # the wall clock stepped: the lock looks older than its writer
        os.utime(path, (old, old))
        assert health_report(str(tmp_path), **QUICK).level == "starting"  # the recorded start decides
        with open(path, "w") as f:
            f.write(f"{os.getpid()} {start_ticks(os.getpid()) + 1}\n")  # another process's start: a reused pid
        assert health_report(str(tmp_path), **QUICK).level == "down"
        with open(path, "w") as f:
            f.write(f"{os.getpid()}\n")  # written without /proc: the mtime rule (fresh file: holds)
        assert health_report(str(tmp_path), **QUICK).level == "starting"
    finally:
        lock.release()
    ghost = subprocess.Popen([sys.executable, "-c", "pass"])
    ghost.wait(timeout=10)
    with open(os.path.join(tmp_path, ".lock"), "w") as f:
        f.write(f"{ghost.pid}\n")  # the lock of a supervisor that is gone
    assert health_report(str(tmp_path), **QUICK).level == "down"


@pytest.mark.parametrize("finished", [True, False])
def test_a_job_that_ended_with_every_batch_committed_is_finished(tmp_path, children, finished):
    ghost = subprocess.Popen([sys.executable, "-c", "pass"])
    ghost.wait(timeout=10)
    run_dir = make_run(tmp_path, children, supervisor=ghost.pid)
    for proc in children.values():
        proc.kill()
        proc.wait(timeout=10)
    final = canned_status(pending=0, finished=finished)
    with open(RunFiles(run_dir).final_status, "w") as f:
        json.dump(final.to_json(), f)
    report = health_report(run_dir, **QUICK)
    if not finished:  # stopped before the end (Ctrl-C): down, as before
        assert report.level == "down"
        return
    assert (report.level, report.exit_code) == ("finished", 0)
    assert report.reasons == [f"the job finished: every batch committed ({RunFiles(run_dir).final_status})"]
    text = format_health(report)
    assert text.startswith(f"{run_dir}: FINISHED (exit 0)") and "job: 2/10 batches committed" in text


def test_a_fifo_at_the_run_lock_does_not_hang_health(tmp_path):
    import threading

    from dflash_ipc.supervise.job_phase import lock_holder
    os.mkfifo(os.path.join(tmp_path, ".lock"))
    result = []
    probe = threading.Thread(target=lambda: result.append(lock_holder(str(tmp_path))), daemon=True)
    probe.start()
    probe.join(timeout=5)
    assert not probe.is_alive() and result == [None]  # blocked in open() before
