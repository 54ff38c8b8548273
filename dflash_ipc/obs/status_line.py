"""The supervisor's status line and epoch progress bar, from the dispatcher's `JobStatus`.

`StatusLine` gives both for each poll and the closing pair at the end of a job (the
supervisor writes them with obs/status_writer.py); the `format_*` functions draw one status
each. Rates come smoothed from the dispatcher (token_rate.py); the progress shown never goes
backwards (see `StatusLine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(slots=True)
class Trained:
    """What the drafters trained or hold to train: batches committed or copied into a drafter
    (the ledger's, so a resumed job's committed work counts at once), per epoch and of the job,
    and tokens through a step (the drafters' counts, at least the ledger's committed ones). A
    copied batch counts before its step: a drafter's queue runs at most `drafter.fifo_sequences`
    sequences ahead of it."""

    tokens: float
    batches: int
    by_epoch: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, status: JobStatus) -> Trained:
        by_epoch = {e.epoch: min(e.batches, e.committed + e.consumed) for e in status.epochs}
        b = status.batches
        batches = sum(by_epoch.values()) if by_epoch else min(status.num_batches, b.committed + b.consumed)
        return cls(tokens=max(status.tokens.trained, float(status.tokens.committed)), batches=batches,
                   by_epoch=by_epoch)

    def at_least(self, other: Trained) -> Trained:
        """The larger of the two, figure by figure (the job's batches: the sum of its epochs')."""
        by_epoch = {e: max(n, other.by_epoch.get(e, 0)) for e, n in self.by_epoch.items()}
        by_epoch.update({e: n for e, n in other.by_epoch.items() if e not in by_epoch})
        batches = sum(by_epoch.values()) if by_epoch else max(self.batches, other.batches)
        return Trained(tokens=max(self.tokens, other.tokens), batches=batches, by_epoch=by_epoch)


def format_progress(status: JobStatus, width: int = 30, *, trained: Trained | None = None) -> str:
    """The epoch progress bar, e.g.
    `epoch 2/3 [############..................]  41% 120/290 batches  job 47%  trained 45% of tokens  ETA 3m12s`.
    The bar, its batches and `job` (several epochs only) count what was trained (`Trained`:
    committed, or copied into a drafter); the current epoch is the first not fully trained;
    `trained` is the share of the job's tokens through a step; the ETA is `--` while the
    trained-token rate is 0 or unknown, and `done` once every batch is committed. `trained`
    replaces the status' own figures (not in the ETA): `StatusLine` keeps them monotone."""
    num_batches = status.num_batches
    trained = trained or Trained.of(status)
    epochs = status.epochs
    finished = status.finished or (num_batches > 0 and status.batches.committed >= num_batches)
    if epochs:
        done_of = [min(e.batches, trained.by_epoch.get(e.epoch, 0)) for e in epochs]
        index = next((i for i, e in enumerate(epochs) if done_of[i] < e.batches), len(epochs) - 1)
        done, total = done_of[index], epochs[index].batches
        label = f"epoch {index + 1}/{len(epochs)} "
    else:
        done, total, label = trained.batches, num_batches, ""
    fraction = min(1.0, done / total) if total > 0 else (1.0 if finished else 0.0)
    filled = int(width * fraction)
    parts = [f"{label}[{'#' * filled}{'.' * (width - filled)}] {int(100 * fraction):3d}% "
             f"{done}/{total} batches"]
    if len(epochs) > 1 and num_batches > 0:
        parts.append(f"job {int(100 * min(1.0, trained.batches / num_batches))}%")
    total_tokens = status.tokens.total
    if not finished and total_tokens and trained.tokens:
        parts.append(f"trained {int(100 * min(1.0, trained.tokens / total_tokens))}% of tokens")
    if finished:
        parts.append("ETA done")
    else:
        eta = estimate_eta_s(status)
        parts.append(f"ETA {format_duration(eta)}" if eta is not None else "ETA --")
    return "  ".join(parts)


class StatusLine:
    """The status and the progress bar, poll after poll: `lines` gives both of one status.

    Progress shown is monotone: a drafter group that restarts from its last checkpoint drops
    the batches its drafters held and restarts their token counts, a rollback undoes commits,
    and that work is trained again; the figures printed hold the most the job has reached until
    the new counts pass it. The closing pair is final: the whole-run averages and a bar at
    100 %, so nothing printed before it reads as the end.
    """

    def __init__(self, width: int = 30) -> None:
        self.width = width
        self._trained: Trained | None = None

    def lines(self, status: JobStatus) -> list[str]:
        """The status line and the progress bar of one live status."""
        now = Trained.of(status)
        self._trained = now if self._trained is None else self._trained.at_least(now)
        return [format_status(status), format_progress(status, self.width, trained=self._trained)]

    def final_lines(self, status: JobStatus) -> list[str]:
        """The closing pair, from the dispatcher's final status (every batch committed)."""
        return [format_status(status, final=True), format_progress(status, self.width)]
