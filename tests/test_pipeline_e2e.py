"""The whole job, for real: `dflash-ipc up` with 1 dispatcher + 5 targets + 3 drafters on CPU.

Real processes, real ZMQ sockets in a temporary run directory, real shared memory. Asserts
exactly-once production and consumption, that pull spread work over every target, that the
loss fell, that the checkpoint loads back, and that nothing is left running or in /dev/shm.
"""

import json
import os
import time

import psutil
import pytest

from dflash_ipc.config.load import load_config
from dflash_ipc.dispatch.ledger import BatchState
from dflash_ipc.dispatch.ledger_file import load_ledger
from dflash_ipc.drafter.inference_format import load_inference_checkpoint
from supervised_job import CHEAP_STEPS, SMALL_JOB, SupervisedJob, trained_tokens_by_step

TIMEOUT_S = 420


@pytest.mark.slow
def test_full_topology_end_to_end(tmp_path, tiny_cache):
    run_dir = tmp_path / "run"
    # Cheaper steps: the same data, batches and steps per epoch; the loss still falls as far
    # (the last fifth of the steps at 0.69-0.76 of the first two over 8 runs, 0.72-0.76 without).
    job = SupervisedJob(run_dir, tmp_path / "up.log", tiny_cache, [*SMALL_JOB, *CHEAP_STEPS])
    try:
        # Every worker pid seen during the run is remembered for the clean-up.
        _check_finished_job(run_dir, job.wait(TIMEOUT_S, during=job.processes), job.output())
    finally:
        job.kill_all()  # after the checks: they include that nothing is left running


def _check_finished_job(run_dir, code: int, out: str) -> None:
    assert code == 0, out[-5000:]
    assert "done, averages:" in out and "tgt_rate" in out

    cfg = load_config(str(run_dir / "config.yaml"))
    assert cfg.target.num_workers == 5 and cfg.drafter.num_workers == 3

    # Exactly once: every batch committed, leased once, every sample once, every token of the
    # data through the optimizer once per epoch (the drafters' own step records).
    ledger = load_ledger(str(run_dir / "ledger.npz"))
    assert ledger.all_committed()
    assert all(e.state is BatchState.COMMITTED and e.leases == 1 for e in ledger.entries())
    from dflash_ipc.data.dataset import TokenDataset
    lengths = TokenDataset(cfg.data.path).lengths
    report = ledger.audit({epoch: range(len(lengths)) for epoch in range(cfg.data.num_epochs)})
    assert report.ok, report
    assert sum(trained_tokens_by_step(run_dir).values()) == int(lengths.sum()) * cfg.data.num_epochs

    # Pull spread the work: every target produced, every drafter consumed.
    final = json.loads((run_dir / "final_status.json").read_text())
    assert final["audit"]["ok"] and final["audit"]["committed_samples"] == len(lengths) * cfg.data.num_epochs
    assert all(t["batches"] > 0 for t in final["targets"].values()), final["targets"]
    assert sum(t["batches"] for t in final["targets"].values()) == len(ledger)
    assert all(d["batches"] > 0 for d in final["drafters"].values())

    # The loss fell.
    steps = [json.loads(line) for line in (run_dir / "drafter_metrics.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if s["loss"] == s["loss"]]
    # The last fifth of the steps against the first two (the untrained drafter): per-step
    # losses swing +-5 % with the batches' lengths, the fall over the job is 10 % or more.
    k = max(3, len(losses) // 5)
    assert sum(losses[-k:]) / k < 0.93 * sum(losses[:2]) / 2, losses
    # Rank 0's transport totals grow with what it read; the copy is part of the read.
    last = steps[-1]
    assert last["read_bytes"] > 0 and 0 < last["copy_s"] <= last["read_s"], last
    assert 0 < last["reads"] <= final["drafters"]["0"]["batches"]
    assert steps[0]["read_bytes"] < last["read_bytes"]

    # The checkpoint loads back in the inference format.
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == ledger.last_committed_step() == steps[-1]["step"]
    model = load_inference_checkpoint(str(run_dir / "checkpoints" / latest["path"]))
    assert model.config.num_hidden_layers == 1

    # Nothing left running, in /dev/shm, or as a socket file.
    processes = json.loads((run_dir / "processes.json").read_text())["processes"]
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p["pid"]) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [p for p in processes if psutil.pid_exists(p["pid"]) and
             psutil.Process(p["pid"]).status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(cfg.files.shm_prefix)]
    assert not os.path.exists(cfg.files.socket)
