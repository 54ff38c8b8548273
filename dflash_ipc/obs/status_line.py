"""The supervisor's status line and epoch progress bar, from the dispatcher's `JobStatus`.

`StatusLine` gives both for each poll and the closing pair at the end of a job (the
supervisor writes them with obs/status_writer.py); the `format_*` functions draw one status
each. Rates come smoothed from the dispatcher (token_rate.py); the progress shown never goes
backwards (see `StatusLine`).
"""

from __future__ import annotations

from dflash_ipc.obs.progress import format_duration
from dflash_ipc.wire.status import JobStatus


def _mean_metric(workers: dict, name: str) -> float | None:
    """The workers' mean of a metric (a seat's metrics are what its heartbeats named)."""
    values = [v for w in workers.values() if (v := w.metrics.get(name)) is not None]
    return sum(values) / len(values) if values else None


def format_status(status: JobStatus, *, final: bool = False) -> str:
    """e.g. `[   42s]  61% 18/30 batches committed | tgt_rate 5,210 dft_rate 5,050 tok_rate 4,980 tok/s |
    step 12 loss 4.812 | pending 8 leased 5 produced 2 consumed 3 | free slots 14`."""
    b = status.batches
    # The last line of a job shows whole-run averages; live lines a trailing window.
    rates = status.average_rates if final and status.average_rates is not None else status.rates
    done = b.committed
    total = max(1, status.num_batches)
    loss = _mean_metric(status.drafters, "loss")
    step = _mean_metric(status.drafters, "step")
    free = sum(t.free_slots for t in status.targets.values())
    parts = [
        # floor: 100% only once every batch is committed
        f"[{status.elapsed_s:5.0f}s] {100 * done // total:3d}% {done}/{status.num_batches} batches committed",
        f"tgt_rate {rates.tgt_rate:,.0f} dft_rate {rates.dft_rate:,.0f} tok_rate {rates.tok_rate:,.0f} tok/s",
        (f"step {step:.0f} loss {loss:.3f}" if loss is not None else "step - loss -"),
        f"pending {b.pending} leased {b.leased} produced {b.produced} consumed {b.consumed}",
        f"free slots {free}",
    ]
    line = " | ".join(parts)
    return ("done, averages: " + line) if final else line


def _job_tokens(status: JobStatus) -> float | None:
    """Tokens of the whole job: `tokens.total` when known, else the planned batches times the
    mean tokens per batch seen so far (committed, else consumed batches)."""
    tokens, batches = status.tokens, status.batches
    if tokens.total:
        return float(tokens.total)
    if batches.committed and tokens.committed:
        return status.num_batches * tokens.committed / batches.committed
    consumed = batches.committed + batches.consumed
    if consumed and tokens.consumed:
        return status.num_batches * tokens.consumed / consumed
    return None


def estimate_eta_s(status: JobStatus) -> float | None:
    """Seconds left: the job's remaining tokens over the trailing trained-token rate
    (`rates.tok_rate`); None when the rate is 0 or unknown or no batch size is known yet.
    Done is the trained tokens (the committed ones when the drafter group started plus its
    counts since), at least the ledger's committed ones: what is trained now, after a
    rollback or a restart too (no mark held here)."""
    rate = status.rates.tok_rate
    total = _job_tokens(status)
    if not rate > 0 or total is None:  # 0, negative or NaN
        return None
    done = max(status.tokens.trained, status.tokens.committed)
    return max(0.0, total - done) / rate


def _fractions(status: JobStatus, trained: float, finished: bool) -> tuple[list[float], float, str]:
    """Each epoch's share done, the job's, and what they count. Trained tokens where the epochs'
    planned tokens are known: the job's trained tokens fill the epochs in plan order (the
    order batches are served in), so the shares add up to the job's trained share; else (a
    status without them) committed batches."""
    epochs = status.epochs
    if finished:
        return [1.0] * len(epochs), 1.0, "trained"
    planned = sum(e.tokens for e in epochs) if epochs else status.tokens.total
    if planned > 0 and all(e.tokens > 0 for e in epochs):
        shares, before = [], 0.0
        for e in epochs:
            shares.append(min(1.0, max(0.0, (trained - before) / e.tokens)))
            before += e.tokens
        return shares, min(1.0, trained / planned), "trained"
    shares = [min(1.0, e.committed / e.batches) if e.batches > 0 else 0.0 for e in epochs]
    job = min(1.0, status.batches.committed / status.num_batches) if status.num_batches > 0 else 0.0
    return shares, job, "committed"


def format_progress(status: JobStatus, width: int = 30, *, trained_tokens: float | None = None) -> str:
    """The epoch progress bar, e.g.
    `epoch 2/3 [###########...................]  37% of 100 batches trained  job 45%  ETA 3m12s`.
    The shares are of tokens through an optimizer step (`tokens.trained`, at least the
    committed ones), placed in the epochs in plan order; the current epoch is the first not
    fully trained; `job` (several epochs only) is the job's share; the ETA is `--` while the
    trained-token rate is 0 or unknown, and `done` once every batch is committed.
    `trained_tokens` replaces the status' own count in the shares (not in the ETA):
    `StatusLine` keeps it monotone."""
    num_batches = status.num_batches
    epochs = status.epochs
    finished = status.finished or (num_batches > 0 and status.batches.committed >= num_batches)
    if trained_tokens is None:
        trained_tokens = max(status.tokens.trained, float(status.tokens.committed))
    shares, job, counted = _fractions(status, trained_tokens, finished)
    if epochs:
        index = next((i for i, share in enumerate(shares) if share < 1.0), len(epochs) - 1)
        fraction, batches = shares[index], epochs[index].batches
        label = f"epoch {index + 1}/{len(epochs)} "
    else:
        fraction, batches, label = job, num_batches, ""
    filled = int(width * fraction)
    parts = [f"{label}[{'#' * filled}{'.' * (width - filled)}] {int(100 * fraction):3d}% "
             f"of {batches} batches {counted}"]
    if len(epochs) > 1 and num_batches > 0:
        parts.append(f"job {int(100 * job)}%")
    if finished:
        parts.append("ETA done")
    else:
        eta = estimate_eta_s(status)
        parts.append(f"ETA {format_duration(eta)}" if eta is not None else "ETA --")
    return "  ".join(parts)


class StatusLine:
    """The status line and the progress bar, poll after poll: `lines` gives both of one status.

    Progress shown is monotone: the job's trained tokens fall back when a drafter group
    restarts from its last checkpoint (the work since is trained again), or resumes from an
    older one (a rollback undoes commits); the shares printed hold the most the job has
    reached until the new count passes it. The closing pair is final: the whole-run averages
    and a bar at 100 %, so nothing printed before it reads as the end.
    """

    def __init__(self, width: int = 30) -> None:
        self.width = width
        self._trained_mark = 0.0

    def lines(self, status: JobStatus) -> list[str]:
        """The status line and the progress bar of one live status."""
        self._trained_mark = max(self._trained_mark, status.tokens.trained, float(status.tokens.committed))
        return [format_status(status), format_progress(status, self.width, trained_tokens=self._trained_mark)]

    def final_lines(self, status: JobStatus) -> list[str]:
        """The closing pair, from the dispatcher's final status (every batch committed)."""
        return [format_status(status, final=True), format_progress(status, self.width)]
