"""A real job with one two-process target worker (target.gpus_per_worker=2, tensor parallel on
CPU over gloo) and one drafter, whose follower rank is SIGKILLed mid-job.

One job shows both halves of "done": the K=2 worker serves a whole job, and the death of a
follower is a fault of the worker: the supervisor stops its leader too, starts both again, the
new leader takes the seat (the dispatcher returns the old one's batches), and the exactly-once
audit of tests/test_faults.py holds (the committed ledger holds every sample of every epoch
once; the tokens of the final model's steps equal the data's tokens times the epochs).
"""

import os
import signal

import pytest

from supervised_job import CHEAP_STEPS
from test_faults import Job, produced_early
from test_target_tensor_parallel import needs_accelerate

# 2 epochs (of 18 batches) and cheaper steps: the new worker still serves all but the first
# batches of the job, across an epoch boundary; a step's learning is no part of the claim.
TP_JOB = ["target.num_workers=1", "target.gpus_per_worker=2", "drafter.num_workers=1", "data.num_epochs=2",
          *CHEAP_STEPS]


@needs_accelerate
@pytest.mark.slow
def test_a_two_process_worker_serves_a_job_and_a_killed_follower_restarts_the_worker(tmp_path, tiny_cache):
    job = Job(tmp_path, tiny_cache, extra=TP_JOB)
    try:
        job.wait_status(produced_early(0), "a batch of the two-process worker")
        pids = job.processes()
        os.kill(pids["target/0.1"], signal.SIGKILL)
        assert job.wait() == 0, job.output()[-5000:]
        assert job.restarts() == {"dispatcher": 0, "target/0": 1, "target/0.1": 1, "drafter/0": 0}
        after = job.processes()
        assert after["target/0"] != pids["target/0"] and after["target/0.1"] != pids["target/0.1"]
        assert str(pids["target/0"]) in job.final_status()["dropped_targets"]  # its seat went to the new leader
        job.check_exactly_once()
        follower_log = (job.run_dir / "logs" / "target-0.1.log").read_text()
        assert "tensor parallel over 2 ranks" in follower_log and "the leader finished" in follower_log
    finally:
        job.kill_all()
