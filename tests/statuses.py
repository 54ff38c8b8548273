"""JobStatus values for tests: a status of planned and committed batches per epoch, and seats."""

from dflash_ipc.wire import status as st


def make_status(epochs, *, tok_rate=0.0, trained=0, committed_tokens=0, consumed_tokens=0, consumed=0,
                total_tokens=0, finished=False) -> st.JobStatus:
    """A JobStatus of `epochs` ((planned, committed) batches each); `total_tokens` planned,
    shared by the epochs as their batches are (0: unknown, to the epochs too)."""
    committed = sum(c for _, c in epochs)
    num_batches = sum(b for b, _ in epochs)
    return st.JobStatus(
        elapsed_s=42.0, policy="pull", num_batches=num_batches,
        batches=st.BatchCounts(pending=0, leased=0, produced=0, consumed=consumed, committed=committed, assigned=0),
        epochs=[st.EpochProgress(epoch=e, batches=b, committed=c, tokens=total_tokens * b // max(1, num_batches))
                for e, (b, c) in enumerate(epochs)],
        tokens=st.TokenCounts(total=total_tokens, produced=consumed_tokens, consumed=consumed_tokens,
                              trained=float(trained), committed=committed_tokens),
        committed_tokens_by_epoch={}, last_committed_step=None,
        rates=st.Rates(tgt_rate=0.0, dft_rate=0.0, tok_rate=tok_rate),
        produced_waiting=0, targets={}, drafters={}, refusals=0, instance="i", drafter_generation=0,
        dropped_targets={}, finished=finished)


def target(**kw):
    return st.TargetStatus(**{**dict(pid=1, credits=0, free_slots=0, batches=0, tokens=0, compute_s=0.0, metrics={},
                                     heartbeat_age_s=0.0), **kw})


def drafter(**kw):
    return st.DrafterStatus(**{**dict(pid=1, credits=0, batches=0, tokens=0, metrics={}, heartbeat_age_s=0.0), **kw})
