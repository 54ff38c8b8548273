"""A real `dflash-ipc up` run by a test: the small job it runs, and a handle that starts the
supervisor in its own session, reads its processes, waits for it with a bound and kills
everything it ever started, by pid."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from dflash_ipc.run.files import RunFiles

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 120 synthetic samples in 18 batches an epoch, 3 epochs, a 1-layer drafter: the work takes
# ~10-20 s, and start-up (every process imports torch) is most of a run on 2 cores.
SMALL_JOB = [
    "builtin.samples=120", "builtin.min_len=24", "builtin.max_len=200",
    "data.bucket_boundaries=[64,128,200]", "data.token_budget=800", "data.num_epochs=3",
    "model.num_layers=1", "model.target_layer_ids=[1,2]", "objective.anchors_per_step=128",
    "objective.max_anchors_per_seq=32", "optimizer.lr=5e-3", "checkpoint.every_steps=10",
    "drafter.fifo_sequences=32", "dispatch.status_interval_s=2",
]

# Cheaper optimizer steps, for the jobs whose claims are about processes, faults and
# exactly-once bookkeeping rather than about what a step learns: 64 anchors a step, at most 16
# from one sequence (SMALL_JOB: 128 and 32). A step still takes about as many sequences (~14
# steps an epoch against ~13, so the step-based moments the fault tests wait for come at the
# same place in the data), with less than half the drafter compute, which is most of the work
# on CPU: the work of 3 epochs on 3 + 2 workers took ~6 s instead of 12-14 s (same data, same
# batches, same sample and token counts).
CHEAP_STEPS = ["objective.anchors_per_step=64", "objective.max_anchors_per_seq=16"]


class SupervisedJob:
    """One `dflash-ipc up ARGS -o run.run_dir=RUN_DIR -o OVERRIDE...` in its own session,
    its output in `out_path`. `node_rank` picks the processes file it reads (node K's own)."""

    def __init__(self, run_dir, out_path, cache_dir, overrides, *, args=(), node_rank=0,
                 env_drop=(), env_extra=None) -> None:
        self.run_dir = run_dir
        self.out_path = out_path
        self.node_rank = node_rank
        env = dict(os.environ, DFLASH_IPC_CACHE=str(cache_dir), PYTHONUNBUFFERED="1")
        env.update(env_extra or {})
        for key in env_drop:
            env.pop(key, None)
        argv = [sys.executable, "-m", "dflash_ipc.cli", "up", *args, "-o", f"run.run_dir={run_dir}"]
        for o in overrides:
            argv += ["-o", o]
        self.out = open(out_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.started = time.monotonic()
        self.seen_pids: set[int] = set()

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def processes(self) -> dict[str, int]:
        """role -> pid, from the processes file (every pid ever listed is remembered for clean-up)."""
        try:
            with open(RunFiles(str(self.run_dir), self.node_rank).processes) as f:
                record = json.load(f)
        except (OSError, ValueError):
            return {}
        pids = {e["role"]: e["pid"] for e in record["processes"]}
        self.seen_pids.update(pids.values())
        return pids

    def wait(self, timeout_s: float, during=None) -> int:
        """Waits for the supervisor to exit (counted from its start), calling `during()` every
        0.2 s meanwhile; fails the test with the output's tail after `timeout_s`."""
        deadline = self.started + timeout_s
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"dflash-ipc up did not finish in {timeout_s}s:\n{self.output()[-5000:]}")
            if during is not None:
                during()
            time.sleep(0.2)
        return self.proc.returncode

    def kill_all(self) -> None:
        """SIGKILL the supervisor's session and every worker pid it ever listed, then reap."""
        self.processes()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in self.seen_pids:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.out.close()


def trained_tokens_by_step(run_dir) -> dict[int, int]:
    """Tokens of each optimizer step of the final model, from the drafters' own records: the
    last record of each step (a step redone after a restart from a checkpoint replaces the
    record of the lineage that was lost)."""
    import pathlib
    steps: dict[int, int] = {}
    record = None
    for line in (pathlib.Path(run_dir) / "drafter_metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record["tokens"]
    last = record["step"]  # the final lineage wrote last; a lost one may have gone further
    steps = {s: n for s, n in steps.items() if s <= last}
    assert sorted(steps) == list(range(1, last + 1)), f"steps missing: {sorted(set(range(1, last + 1)) - set(steps))}"
    return steps


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
