"""The cost of one dispatcher status at the end of a long job: what the supervisor, `status` and
`health` ask for several times a second.

    python -m benchmarks.status_cost [--samples 1000000]

Plans one epoch of ``--samples`` samples of 512 tokens (token budget 16,384: 32 per batch),
drives every batch through the ledger to a commit (50 commits per checkpoint step), then
times `Dispatcher.status()`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dflash_ipc.dispatch.buckets import BucketSpec, plan_epoch
from dflash_ipc.dispatch.dispatcher import Dispatcher
from dflash_ipc.dispatch.ledger import Ledger, TrainedCopy


def commit_every_batch(ledger: Ledger, per_step: int = 50) -> int:
    """Drive every pending batch through lease, produce, assign, consume and commit (``per_step``
    commits per checkpoint step), as one target and one drafter would; returns the commits."""
    commits = 0
    ledger.open_pool("t", 1)
    while (batch := ledger.next_pending()) is not None:
        ledger.produced(batch.batch_id, "t", ledger.lease(batch.batch_id, "t").slot)
        attempt = ledger.assign(batch.batch_id, "d")
        ledger.consumed(batch.batch_id, "d", attempt)
        commits += 1
        ledger.commit(commits // per_step, [TrainedCopy(batch.batch_id, "d", attempt, tuple(batch.sample_ids))])
    return commits


def status_ms(num_samples: int, repeats: int = 20) -> tuple[int, float]:
    """(commit records, ms per status) of a job whose every sample is committed."""
    epochs = [plan_epoch(np.full(num_samples, 512), BucketSpec(boundaries=(512,), token_budget=16384),
                         seed=0, epoch=0)]
    dispatcher = Dispatcher(epochs, policy="pull", num_targets=1, num_drafters=1)
    commits = commit_every_batch(dispatcher.ledger)
    started = time.perf_counter()
    for _ in range(repeats):
        dispatcher.status()
    return commits, (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    args = parser.parse_args()
    commits, ms = status_ms(args.samples)
    print(f"status of a finished job: {args.samples:,} samples in {commits:,} commit records: {ms:.2f} ms")


if __name__ == "__main__":
    main()
