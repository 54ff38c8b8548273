"""Fault injection on a real job (`dflash-ipc up`, 3 targets + 2 drafters on CPU, real sockets,
real shared memory): a target SIGKILLed or SIGSTOPped mid-epoch is replaced, a drafter
SIGKILLed or SIGSTOPped restarts the drafter group from its last commit, a SIGKILLed
dispatcher is restarted from its ledger while the targets live on, and in each case the
committed ledger holds every sample exactly once; a SIGKILLed supervisor leaves no process
and no shared-memory segment behind; Ctrl-C checkpoints, and a rerun resumes from there.

Each test kills everything it started, by pid, in a `finally`, within bounded time.
"""

import json
import os
import signal
import time

import pytest

from dflash_ipc.config_load import load_config
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.dispatch.ledger import Ledger
from dflash_ipc.supervise.status_query import fetch_status
from supervised_job import SMALL_JOB, SupervisedJob
from supervised_job import alive as _alive

RUN_TIMEOUT_S = 180     # one run; measured 50-120 s on 2 busy cores
PROGRESS_TIMEOUT_S = 90  # start-up (9 processes import torch) until the first batches

# The e2e test's small job on 3 targets + 2 drafters. The work itself takes ~10-20 s: a
# fault lands while batches are pending.
FAULT_OVERRIDES = [*SMALL_JOB, "supervise.max_restarts=3", "target.num_workers=3", "drafter.num_workers=2"]


class Job(SupervisedJob):
    """One `dflash-ipc up` of the fault job, output to a file."""

    def __init__(self, tmp_path, cache_dir, extra=(), log_name="up.log"):
        # The tiny target by path, not by the built-in name: the job then skips the embedded
        # default's closing evaluation (~10 s) that has nothing to do with faults.
        tiny = f"target.path={os.path.join(cache_dir, 'tiny-target')}"
        super().__init__(tmp_path / "run", tmp_path / log_name, cache_dir, [tiny, *FAULT_OVERRIDES, *extra])

    def wait_progress(self, rank: int, min_batches: int = 1) -> dict:
        """Polls the dispatcher until target `rank` produced `min_batches` while at least half
        the job's batches are still pending; returns that status."""
        deadline = time.monotonic() + PROGRESS_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()[-4000:]
            if (self.run_dir / "config.yaml").exists():
                try:
                    status = fetch_status(str(self.run_dir), timeout_s=2.0)
                except Exception:  # not serving yet
                    status = None
                target = (status or {}).get("targets", {}).get(str(rank))
                if target and target["batches"] >= min_batches:
                    pending = status["batches"]["pending"]
                    assert pending >= status["num_batches"] // 2, f"too late for a fault: {status['batches']}"
                    self.processes()
                    return status
            time.sleep(0.3)
        pytest.fail(f"target/{rank} produced nothing within {PROGRESS_TIMEOUT_S}s:\n{self.output()[-4000:]}")

    def wait_status(self, predicate, what: str) -> dict:
        """Polls the dispatcher until `predicate(status)`; returns that status."""
        deadline = time.monotonic() + PROGRESS_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()[-4000:]
            status = None
            if (self.run_dir / "config.yaml").exists():
                try:
                    status = fetch_status(str(self.run_dir), timeout_s=2.0)
                except Exception:  # not serving yet
                    pass
            if status and predicate(status):
                self.processes()
                return status
            time.sleep(0.3)
        pytest.fail(f"no {what} within {PROGRESS_TIMEOUT_S}s:\n{self.output()[-4000:]}")

    def drafter_steps(self) -> list[int]:
        return [json.loads(line)["step"] for line in
                (self.run_dir / "drafter_metrics.jsonl").read_text().splitlines()]

    def wait(self, timeout_s: float = RUN_TIMEOUT_S, during=None) -> int:
        return super().wait(timeout_s, during)

    def audit(self):
        cfg = load_config(str(self.run_dir / "config.yaml"))
        ledger = Ledger.load(str(self.run_dir / "ledger.npz"))
        n = len(TokenDataset(cfg.data.path))
        return cfg, ledger, ledger.audit({epoch: range(n) for epoch in range(cfg.data.num_epochs)})


def _segments(cfg) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(cfg.files.shm_prefix)]


@pytest.mark.slow
def test_sigkilled_target_is_restarted_and_nothing_is_lost(tmp_path, tiny_cache):
    job = Job(tmp_path, tiny_cache)
    try:
        job.wait_progress(rank=1)
        victim = job.processes()["target/1"]
        os.kill(victim, signal.SIGKILL)
        code = job.wait()
        out = job.output()
        assert code == 0, out[-5000:]
        assert "target/1 (pid %d) exited with code -9" % victim in out, out[-5000:]
        assert "restarted target/1" in out

        cfg, ledger, report = job.audit()
        assert ledger.all_committed() and report.ok, report
        # The dead target's work went round again: some batch was leased twice.
        assert max(ledger.entry(b).attempts for b in ledger.history()) >= 2
        final = json.loads((job.run_dir / "final_status.json").read_text())
        assert str(victim) in final["dropped_targets"], final["dropped_targets"]
        record = json.loads((job.run_dir / "processes.json").read_text())
        entry, = [e for e in record["processes"] if e["role"] == "target/1"]
        assert entry["pid"] != victim and entry["restarts"] == 1
        assert not _alive(victim) and not _segments(cfg)
    finally:
        job.kill_all()


@pytest.mark.slow
def test_sigstopped_target_is_killed_restarted_and_nothing_is_lost(tmp_path, tiny_cache):
    timeout_s, status_s = 6.0, 2.0
    job = Job(tmp_path, tiny_cache, extra=[f"dispatch.heartbeat_timeout_s={timeout_s:g}",
                                           "dispatch.heartbeat_interval_s=0.5"])
    victim = None
    try:
        job.wait_progress(rank=2)
        victim = job.processes()["target/2"]
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        died_after = []

        def watch_victim():
            if not died_after and not _alive(victim):
                died_after.append(time.monotonic() - stopped_at)

        code = job.wait(during=watch_victim)
        out = job.output()
        assert code == 0, out[-5000:]
        assert "target/2 (pid %d) hangs:" % victim in out, out[-5000:]
        # Found once the dispatcher gives up on it, at the next status poll: timeout + interval.
        assert died_after and died_after[0] < timeout_s + status_s + 4.0, died_after

        cfg, ledger, report = job.audit()
        assert ledger.all_committed() and report.ok, report
        final = json.loads((job.run_dir / "final_status.json").read_text())
        assert str(victim) in final["dropped_targets"], final["dropped_targets"]
        record = json.loads((job.run_dir / "processes.json").read_text())
        entry, = [e for e in record["processes"] if e["role"] == "target/2"]
        assert entry["pid"] != victim and entry["restarts"] == 1
        assert not _segments(cfg)
    finally:
        if victim is not None and _alive(victim):
            os.kill(victim, signal.SIGKILL)
        job.kill_all()


def _committed_and_open(status) -> bool:
    """A commit exists and a good part of the job is still to do: time for a drafter fault."""
    b = status["batches"]
    return b["committed"] > 0 and b["pending"] >= status["num_batches"] // 3


@pytest.mark.slow
def test_sigkilled_drafter_restarts_the_group_from_its_last_commit(tmp_path, tiny_cache):
    job = Job(tmp_path, tiny_cache, extra=["checkpoint.every_steps=4"])
    try:
        job.wait_status(_committed_and_open, "commit")
        pids = job.processes()
        os.kill(pids["drafter/1"], signal.SIGKILL)
        code = job.wait()
        out = job.output()
        assert code == 0, out[-5000:]
        assert "drafter/1 (pid %d) exited with code -9" % pids["drafter/1"] in out, out[-5000:]
        assert "the drafter group will restart" in out and "restarted drafter/0" in out

        cfg, ledger, report = job.audit()
        assert ledger.all_committed() and report.ok, report
        final = json.loads((job.run_dir / "final_status.json").read_text())
        assert final["drafter_generation"] == 1, final["drafter_generation"]
        # The new group resumed from the checkpoint of the last commit: its steps continue
        # from there (falling back once if the old group had stepped past that commit).
        assert "resumed from" in (job.run_dir / "logs" / "drafter-0.log").read_text()
        steps = job.drafter_steps()
        drops = [(a, b) for a, b in zip(steps, steps[1:]) if b != a + 1]
        assert len(drops) <= 1 and all(b <= a for a, b in drops), steps
        record = json.loads((job.run_dir / "processes.json").read_text())
        restarts = {e["role"]: e["restarts"] for e in record["processes"]}
        assert restarts == {"dispatcher": 0, "target/0": 0, "target/1": 0, "target/2": 0,
                            "drafter/0": 1, "drafter/1": 1}, restarts
        assert not _segments(cfg)
    finally:
        job.kill_all()


@pytest.mark.slow
def test_sigstopped_drafter_is_found_hung_and_its_group_restarts(tmp_path, tiny_cache):
    job = Job(tmp_path, tiny_cache, extra=["supervise.drafter_timeout_s=5", "checkpoint.every_steps=4"])
    victim = None
    try:
        job.wait_status(_committed_and_open, "commit")
        victim = job.processes()["drafter/0"]
        os.kill(victim, signal.SIGSTOP)
        code = job.wait()
        out = job.output()
        assert code == 0, out[-5000:]
        assert "drafter/0 (pid %d) hangs: no heartbeat" % victim in out, out[-5000:]
        cfg, ledger, report = job.audit()
        assert ledger.all_committed() and report.ok, report
        assert not _alive(victim) and not _segments(cfg)
    finally:
        if victim is not None and _alive(victim):
            os.kill(victim, signal.SIGKILL)
        job.kill_all()


@pytest.mark.slow
def test_sigkilled_dispatcher_restarts_from_its_ledger_and_targets_register_again(tmp_path, tiny_cache):
    job = Job(tmp_path, tiny_cache, extra=["checkpoint.every_steps=4"])
    try:
        job.wait_status(_committed_and_open, "commit")
        pids = job.processes()
        os.kill(pids["dispatcher"], signal.SIGKILL)
        code = job.wait()
        out = job.output()
        assert code == 0, out[-5000:]
        assert "dispatcher (pid %d) exited with code -9" % pids["dispatcher"] in out, out[-5000:]
        assert "restarted dispatcher" in out
        cfg, ledger, report = job.audit()
        assert ledger.all_committed() and report.ok, report
        # The targets outlived it: same processes, registered again with the new dispatcher.
        after = job.processes()
        for rank in range(3):
            assert after[f"target/{rank}"] == pids[f"target/{rank}"], (pids, after)
            log = (job.run_dir / "logs" / f"target-{rank}.log").read_text()
            assert "registering again" in log, log[-3000:]
        assert after["dispatcher"] != pids["dispatcher"] and after["drafter/0"] != pids["drafter/0"]
        assert not _segments(cfg)
    finally:
        job.kill_all()


@pytest.mark.slow
def test_sigkilled_supervisor_leaves_no_process_and_no_segment(tmp_path, tiny_cache):
    job = Job(tmp_path, tiny_cache)
    try:
        job.wait_progress(rank=0)
        pids = job.processes()
        assert len(pids) == 6
        cfg = load_config(str(job.run_dir / "config.yaml"))
        assert _segments(cfg)  # the targets' pools exist while the job runs
        os.kill(job.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < 10 and (any(_alive(p) for p in pids.values()) or _segments(cfg)):
            time.sleep(0.2)
        alive = {role: pid for role, pid in pids.items() if _alive(pid)}
        assert not alive, f"still running 10 s after the supervisor's SIGKILL: {alive}"
        assert not _segments(cfg), _segments(cfg)
    finally:
        job.kill_all()


@pytest.mark.slow
def test_interrupted_job_resumes_from_its_last_commit(tmp_path, tiny_cache):
    """Ctrl-C a job after its first checkpoint: the drafters checkpoint what they trained
    and commit it before the job stops. Run it again in the same run directory: the drafters
    resume from that checkpoint, only uncommitted batches are served again, and the
    committed history holds every sample exactly once."""
    extra = ["checkpoint.every_steps=4"]
    first = Job(tmp_path, tiny_cache, extra=extra, log_name="first.log")
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            assert first.proc.poll() is None, first.output()[-4000:]
            try:
                status = fetch_status(str(first.run_dir), timeout_s=2.0)
            except Exception:  # not serving yet
                status = None
            if status and status["batches"]["committed"] > 0:
                break
            time.sleep(0.3)
        first.processes()
        os.kill(first.proc.pid, signal.SIGINT)
        assert first.wait() == 130, first.output()[-4000:]
    finally:
        first.kill_all()
    ledger = Ledger.load(str(first.run_dir / "ledger.npz"))
    resume_step = ledger.last_committed_step()
    steps_before = len(first.drafter_steps())
    assert resume_step is not None and not ledger.all_committed()
    # Ctrl-C made a checkpoint of the last step, off the every-4-steps schedule if need be.
    assert resume_step == first.drafter_steps()[-1], (resume_step, first.drafter_steps())
    assert "drafters checkpointed and exited" in first.output()

    second = Job(tmp_path, tiny_cache, extra=extra, log_name="second.log")
    try:
        code = second.wait()
        assert code == 0, second.output()[-5000:]
        cfg, ledger, report = second.audit()
        assert ledger.all_committed() and report.ok, report
        steps = [json.loads(line)["step"] for line in
                 (second.run_dir / "drafter_metrics.jsonl").read_text().splitlines()]
        # The second run's first step continues from the checkpoint, not from scratch.
        assert steps[steps_before] == resume_step + 1, (resume_step, steps_before, steps)
        assert steps[steps_before:] == list(range(resume_step + 1, steps[-1] + 1))
    finally:
        second.kill_all()
