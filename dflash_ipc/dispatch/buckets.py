"""Epoch planning: length buckets, token-budget batches, seeded shuffles.

Pure planning (numpy only; no sockets, no torch). The dispatcher plans each epoch once
and feeds the batches to the ledger; targets run them in the planned order as they pull.

How an epoch is planned (``plan_epoch``):

1. Every sample goes to the first bucket whose upper boundary is >= its length; a sample
   longer than the largest boundary, or whose padded length exceeds the token budget,
   is a ``DataError`` naming the sample index and the limit.
2. Inside a bucket the samples are shuffled (seeded by ``(seed, epoch)``), cut into
   windows of ``sort_window`` samples, and each window is sorted by length. Sorting keeps
   padding small (neighbours have nearly equal lengths); sorting only inside windows of a
   fresh shuffle keeps batch composition different from epoch to epoch. Windows are
   sorted alternately ascending and descending ("snake" order) so the batch that
   straddles two windows joins long with long (or short with short), not long with short.
3. The sorted stream is packed greedily: a batch grows while
   ``batch_size * padded_len <= token_budget`` (``padded_len`` = longest length in the
   batch rounded up to ``pad_multiple``) and ``batch_size <= max_batch_size``.
4. The order of all batches of the epoch is shuffled across buckets with the same
   seeded generator, so training sees mixed lengths while inference stays bucketed.
   Batch ids are assigned in that final order from ``first_batch_id`` on; pass the end
   of the previous epoch (``plan_epochs`` does) to keep ids unique across epochs.

Same ``(lengths, spec, seed, epoch)`` -> same plan, on any machine (numpy's PCG64 seeded
through ``SeedSequence([seed, epoch])``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from dflash_ipc.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

DEFAULT_SORT_WINDOW = 1024


@dataclass(frozen=True, slots=True)
class PlannedBatch:
    """One target batch: which samples, from which bucket, padded to which length."""

    batch_id: int
    epoch: int
    bucket: int
    sample_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    padded_len: int

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens in the batch."""
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        """Tokens the target computes if it pads every sample to ``padded_len``."""
        return len(self.sample_ids) * self.padded_len


@dataclass(kw_only=True, frozen=True)
class BucketSpec:
    """How to bucket and pack an epoch."""

    boundaries: tuple[int, ...]
    """Strictly increasing upper length bounds, one per bucket (inclusive)."""
    token_budget: int
    """Upper bound of ``batch_size * padded_len`` per batch."""
    pad_multiple: int = 8
    """``padded_len`` is the batch's longest length rounded up to this multiple."""
    max_batch_size: int | None = None
    """Optional cap on samples per batch (None: only the token budget limits)."""
    sort_window: int = DEFAULT_SORT_WINDOW
    """Samples per length-sorted window inside a bucket; 0 sorts the whole bucket."""

    def __post_init__(self) -> None:
        try:
            bounds = tuple(int(b) for b in self.boundaries)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"BucketSpec.boundaries must be a sequence of ints, got {self.boundaries!r}"
            ) from exc
        object.__setattr__(self, "boundaries", bounds)
        if not bounds or bounds[0] < 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ConfigError(
                f"BucketSpec.boundaries must be non-empty, positive and strictly "
                f"increasing, got {list(bounds)}"
            )
        _check_int("token_budget", self.token_budget, low=1)
        _check_int("pad_multiple", self.pad_multiple, low=1)
        _check_int("sort_window", self.sort_window, low=0)
        if self.max_batch_size is not None:
            _check_int("max_batch_size", self.max_batch_size, low=1)


def _check_int(field: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(f"BucketSpec.{field} must be an int >= {low}, got {value!r}")


def assign_buckets(lengths: np.ndarray, boundaries: Sequence[int]) -> np.ndarray:
    """Bucket index per sample: the first bucket whose boundary is >= the length.

    Raises DataError for a length < 1 or above the largest boundary (naming the first
    offending sample index).
    """
    lengths = _as_lengths(lengths)
    bounds = np.asarray(tuple(boundaries), dtype=np.int64)
    too_long = np.flatnonzero(lengths > bounds[-1])
    if too_long.size:
        i = int(too_long[0])
        raise DataError(
            f"sample {i} has length {int(lengths[i])} > largest bucket boundary "
            f"{int(bounds[-1])} (boundaries={bounds.tolist()}; {too_long.size} samples "
            f"too long); raise the largest boundary or truncate/filter the data"
        )
    return np.searchsorted(bounds, lengths, side="left").astype(np.int64)


def _as_lengths(lengths: np.ndarray) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise DataError(
            f"lengths must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}"
        )
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        i = int(bad[0])
        raise DataError(f"sample {i} has length {int(arr[i])}; lengths must be >= 1")
    return arr


def _check_budget(lengths: np.ndarray, spec: BucketSpec) -> np.ndarray:
    """Per-sample padded lengths; DataError if one sample alone exceeds the budget."""
    m = spec.pad_multiple
    padded = -(-lengths // m) * m  # [N]
    over = np.flatnonzero(padded > spec.token_budget)
    if over.size:
        i = int(over[0])
        raise DataError(
            f"sample {i} has length {int(lengths[i])} (padded to {int(padded[i])}) > "
            f"token_budget {spec.token_budget}; raise token_budget or truncate the data"
        )
    return padded


def _snake_sorted(ids: np.ndarray, lengths: np.ndarray, window: int) -> np.ndarray:
    """``ids`` (already shuffled) sorted by length inside windows, alternating direction."""
    if window <= 0 or window >= ids.size:
        window = max(ids.size, 1)
    parts = []
    for k, start in enumerate(range(0, ids.size, window)):
        chunk = ids[start : start + window]
        # Stable sort keeps the shuffled order among equal lengths.
        order = np.argsort(lengths[chunk], kind="stable")
        if k % 2:
            order = order[::-1]
        parts.append(chunk[order])
    return np.concatenate(parts) if parts else ids


def _pack_greedy(
    ids: np.ndarray, padded: np.ndarray, budget: int, cap: int | None
) -> list[tuple[int, int, int]]:
    """Cut ``ids`` into consecutive runs (start, end, padded_len) within the budget."""
    runs: list[tuple[int, int, int]] = []
    start, cur_max = 0, 0
    pl = padded[ids].tolist()
    for i, length in enumerate(pl):
        new_max = max(cur_max, length)
        count = i - start + 1
        if i > start and (count * new_max > budget or (cap is not None and count > cap)):
            runs.append((start, i, cur_max))
            start, cur_max = i, length
        else:
            cur_max = new_max
    if pl:
        runs.append((start, len(pl), cur_max))
    return runs


def plan_epoch(
    lengths: np.ndarray, spec: BucketSpec, *, seed: int, epoch: int, first_batch_id: int = 0
) -> list[PlannedBatch]:
    """Plan one epoch: every sample index of ``lengths`` in exactly one batch.

    Returns the batches in training order, ids ``first_batch_id ..`` consecutive.
    """
    lengths = _as_lengths(lengths)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"plan_epoch seed must be an int >= 0, got {seed!r}")
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ConfigError(f"plan_epoch epoch must be an int >= 0, got {epoch!r}")
    buckets = assign_buckets(lengths, spec.boundaries)  # [N]
    padded = _check_budget(lengths, spec)  # [N]
    rng = np.random.default_rng([int(seed), int(epoch)])

    # (bucket, sample ids, padded_len) per batch, grouped by bucket for now.
    staged: list[tuple[int, np.ndarray, int]] = []
    for b in range(len(spec.boundaries)):
        ids = rng.permutation(np.flatnonzero(buckets == b))
        if not ids.size:
            continue
        ids = _snake_sorted(ids, lengths, spec.sort_window)
        for start, end, plen in _pack_greedy(ids, padded, spec.token_budget, spec.max_batch_size):
            staged.append((b, ids[start:end], plen))

    order = rng.permutation(len(staged))
    batches = []
    for k, j in enumerate(order.tolist()):
        b, ids, plen = staged[j]
        batches.append(
            PlannedBatch(
                batch_id=int(first_batch_id) + k,
                epoch=int(epoch),
                bucket=b,
                sample_ids=tuple(ids.tolist()),
                lengths=tuple(lengths[ids].tolist()),
                padded_len=int(plen),
            )
        )
    logger.debug("planned epoch %d: %d samples in %d batches", epoch, lengths.size, len(batches))
    return batches


def plan_epochs(
    lengths: np.ndarray, spec: BucketSpec, *, seed: int, num_epochs: int, first_batch_id: int = 0
) -> list[list[PlannedBatch]]:
    """Plan epochs ``0..num_epochs-1`` with batch ids unique across all of them."""
    epochs: list[list[PlannedBatch]] = []
    next_id = first_batch_id
    for epoch in range(num_epochs):
        batches = plan_epoch(lengths, spec, seed=seed, epoch=epoch, first_batch_id=next_id)
        next_id += len(batches)
        epochs.append(batches)
    return epochs


def plan_stats(batches: Iterable[PlannedBatch], *, token_budget: int | None = None) -> dict:
    """Summary of a plan: sizes, padding, per-bucket counts.

    ``padding_fraction`` = 1 - tokens / padded_tokens. With ``token_budget``, also
    ``budget_fill`` = padded_tokens / (num_batches * token_budget).
    """
    batches = list(batches)
    num_tokens = sum(b.num_tokens for b in batches)
    padded_tokens = sum(b.padded_tokens for b in batches)
    num_samples = sum(len(b.sample_ids) for b in batches)
    stats = {
        "num_batches": len(batches),
        "num_samples": num_samples,
        "num_tokens": num_tokens,
        "padded_tokens": padded_tokens,
        "padding_fraction": 1.0 - num_tokens / padded_tokens if padded_tokens else 0.0,
        "mean_batch_size": num_samples / len(batches) if batches else 0.0,
        "batches_per_bucket": dict(sorted(Counter(b.bucket for b in batches).items())),
    }
    if token_budget is not None:
        capacity = len(batches) * token_budget
        stats["budget_fill"] = padded_tokens / capacity if capacity else 0.0
    return stats
